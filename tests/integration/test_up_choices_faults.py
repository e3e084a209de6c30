"""`pdserve up` (1 prefill + 2 decode workers, fault injection on): n > 1 choices prefill
their prompt once, and a constrained stream keeps its constraint across a migration.

    n = 3      the first choice prefills; the other two wait for its first token and go
               where it went, so the prefill worker's counters show the prompt computed
               once and served twice from its prefix cache
    migration  a json_schema (strict) stream whose decode worker is SIGKILLed mid-stream
               resumes on the other decode worker, which replays the delivered tokens
               through the grammar: the answer is token-identical to an undisturbed greedy
               run, and valid

Both decode workers step slowly (FaultRequest step_delay_ms) until the migration test's
stream has started, so it is still running when its worker is killed; the other worker,
where it resumes, is back to full speed before the kill.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import jsonschema
import pytest
from test_reliability import Stream, assert_nothing_held, wait_restarted, worker_holding, workers
from up_process import HANDOFF_TIER, LONG_PROMPT, UpProcess

from protocol.agent_messages import FAULT_INJECTION_ENV, FaultRequest, FaultResponse

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TEAM = {
    "type": "object",
    "properties": {
        "team": {"type": "array", "minItems": 5, "maxItems": 5,
                 "items": {"type": "object",
                           "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 18,
                                                  "maximum": 99}},
                           "required": ["name", "age"], "additionalProperties": False}},
    },
    "required": ["team"], "additionalProperties": False,
}
TEAM_FORMAT = {"type": "json_schema",
               "json_schema": {"name": "team", "schema": TEAM, "strict": True}}
QUESTION = "List the five people of a team as JSON."


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(HANDOFF_TIER)
    process = UpProcess("--prefill", "1", "--decode", "2", "--tiers", str(tiers),
                        log_dir=tmp_path_factory.mktemp("choices-logs"),
                        env={FAULT_INJECTION_ENV: "1"})
    yield process
    process.stop()


def worker_counters(up: UpProcess, worker: dict) -> dict[str, float]:
    request = urllib.request.Request(worker["control_url"] + "/metrics",
                                     headers={"Authorization": f"Bearer {up.token}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("pdserve_prompt_tokens_total", "pdserve_prefix_cache_hit_tokens_total"):
            counters[name] = float(value)
    return counters


def post(up: UpProcess, body: dict) -> dict:
    request = urllib.request.Request(
        up.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "x-pdserve-tier": "handoff"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_n_choices_compute_their_prompt_once(up) -> None:
    prefill = next(w for w in workers(up) if w["role"] == "prefill")
    before = worker_counters(up, prefill)
    # A prompt no earlier request shares a prefix with (the counters then show this one).
    prompt = "Three short stories, please. " + LONG_PROMPT
    answer = post(up, {"model": "default", "n": 3, "max_tokens": 8, "temperature": 0.9,
                       "seed": 5, "messages": [{"role": "user", "content": prompt}]})
    after = worker_counters(up, prefill)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] for c in answer["choices"])
    num_prompt = answer["usage"]["prompt_tokens"]  # counted once, as OpenAI counts it
    started = after["pdserve_prompt_tokens_total"] - before["pdserve_prompt_tokens_total"]
    cached = (after["pdserve_prefix_cache_hit_tokens_total"]
              - before["pdserve_prefix_cache_hit_tokens_total"])
    assert started == 3 * num_prompt  # three prefills started on the prefill worker...
    # ...but the prompt was computed once: the two others found all its full blocks cached
    # (only their last, partial block is computed again).
    assert cached >= 2 * (num_prompt - 64), (num_prompt, started, cached)
    assert started - cached <= num_prompt + 2 * 64
    # The usage counts the prompt once, with the prefill of its first choice (a new prompt:
    # nothing cached); the same prompt again finds it in the prefix cache.
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] < 64
    again = post(up, {"model": "default", "max_tokens": 2,
                      "messages": [{"role": "user", "content": prompt}]})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= num_prompt - 64


class ConstrainedStream(Stream):
    """test_reliability's stream reader for a body of our own (a constraint, no ignore_eos)."""

    def __init__(self, up: UpProcess, body: dict) -> None:
        self.headers = {"x-pdserve-tier": "handoff"}
        self.body = {"model": "default", "stream": True,
                     "stream_options": {"include_usage": True}, **body}
        self.url = up.url + "/v1/chat/completions"
        self.events = []
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()


def num_migrations(up: UpProcess) -> float:
    with urllib.request.urlopen(f"{up.url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("pdserve_gateway_retries_total{") and 'type="migration"' in line)


def slow_steps(up: UpProcess, delay_ms: int, but: str | None = None) -> None:
    """Every decode worker (but the one with id `but`) steps `delay_ms` slower."""
    for worker in workers(up):
        if worker["role"] == "decode" and worker["id"] != but:
            answer = up.control_call(worker, FaultRequest(step_delay_ms=delay_ms), FaultResponse)
            assert answer.step_delay_ms == delay_ms


def test_a_constrained_stream_keeps_its_grammar_across_a_migration(up) -> None:
    body = {"temperature": 0, "max_tokens": 200, "response_format": TEAM_FORMAT}
    reference = post(up, {"model": "default", **body,
                          "messages": [{"role": "user", "content": QUESTION}]})
    expected = reference["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(expected), TEAM)
    migrations = num_migrations(up)
    slow_steps(up, 120)
    stream = ConstrainedStream(up, {**body, "messages": [{"role": "user", "content": QUESTION}]})
    stream.wait_tokens(6)
    victim = worker_holding(up, stream.request_id, "decode", "streams")
    slow_steps(up, 0, but=victim["id"])  # the stream resumes at full speed where it moves
    os.kill(victim["pid"], signal.SIGKILL)
    text, events = stream.result()
    wait_restarted(up, victim)  # it comes back without the fault
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
    assert text == expected
    assert num_migrations(up) == migrations + 1  # resumed mid-stream, not retried from scratch
    assert events[-2]["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    jsonschema.validate(json.loads(text), TEAM)
    assert_nothing_held(up)
