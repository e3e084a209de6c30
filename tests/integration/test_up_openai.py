"""`pdserve up` with the default model on CPU (1 prefill + 1 decode worker), driven by the
official `openai` client: completions and chat, streamed and not, a prompt long enough to
be handed off P -> D, a client that hangs up, and Ctrl-C leaving no process behind."""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from up_process import UpProcess, child_pids, wait_gone

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
LONG_PROMPT = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 80)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    process = UpProcess(log_dir=tmp_path_factory.mktemp("up-logs"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_up_prints_a_curl_example_and_registers_both_workers(up: UpProcess) -> None:
    assert f"curl -N {up.url}/v1/chat/completions" in up.output
    assert sorted(w["role"] for w in up.workers()) == ["decode", "prefill"]


def test_chat_non_streaming(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 8


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                           messages=messages)
    chunks = list(client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, messages=messages, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_long_prompt_is_handed_off_and_spliced_exactly_once(
        client: openai.OpenAI, model: str, up: UpProcess) -> None:
    # Greedy decoding: the handed-off stream must equal the non-streamed answer token for
    # token; a duplicated or lost token at the splice would change the text and the count.
    args = dict(model=model, prompt=LONG_PROMPT, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    assert whole.usage.prompt_tokens > 256  # above the default tier's local-prefill threshold
    assert whole.usage.completion_tokens == 12
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    metrics = urllib.request.urlopen(f"{up.url}/metrics", timeout=5).read().decode()
    assert "pdserve_gateway_splice_mismatch_total 0" in metrics


def test_completions_streaming_short_prompt(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 1
    assert chunks[-1].choices[0].finish_reason == "length"


def _held(up: UpProcess, state_urls: dict[str, str]) -> dict[str, int]:
    """Blocks-holding requests per worker role, from the workers' own /internal/state."""
    held = {}
    for role, url in state_urls.items():
        state = up.internal_get(url)
        held[role] = state["num_held_tables"] + state["num_running"] + state["num_waiting"]
    return held


def test_client_disconnect_frees_kv_on_both_workers(client: openai.OpenAI, model: str,
                                                   up: UpProcess) -> None:
    state_urls = {w["role"]: w["control_url"] + "/internal/state" for w in up.workers()}
    stream = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert sum(_held(up, state_urls).values()) > 0
    stream.close()
    gone_at = time.monotonic()
    # Each /internal/state answer waits for the worker's engine thread (it checks the
    # engine's invariants), so on a busy machine one poll can take hundreds of ms: the
    # bound below is "freed promptly". The strict 100 ms check, with abort arrival times
    # observable, is test_gateway_handoff.py's disconnect test.
    while True:
        held = _held(up, state_urls)
        freed_s = time.monotonic() - gone_at
        if sum(held.values()) == 0:
            break
        assert freed_s < 3, f"KV still held {freed_s:.1f} s after the disconnect: {held}"
        time.sleep(0.002)
    print(f"disconnect -> KV freed on both workers (seen by a poll ending) {freed_s * 1000:.0f} ms")
    assert freed_s < 2


def test_ctrl_c_stops_everything(up: UpProcess) -> None:
    children = child_pids(up.process.pid)
    assert len(children) >= 4  # redis, two workers, the gateway
    worker_pids = [w["pid"] for w in up.workers()]
    assert up.stop() == 0
    assert "stopped." in up.output
    assert wait_gone(children + worker_pids) == []
