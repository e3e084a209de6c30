"""Workers that take either role, and role changes at run time: `pdserve up --workers 2
--roles both` with the default model on CPU, checked against the single-process engine.

The tiers file forces each plan where a test needs it (the API is open, so the
`x-pdserve-tier` header picks the tier): `standard` hands every prompt from one worker to
the other (prefill there, KV over the wire, decode here), `interactive` prefills every
prompt where it is decoded, and `batch` sets no threshold: the router predicts.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx2 as httpx
import pytest
from test_reliability import assert_nothing_held, state_of, workers
from up_process import UpProcess

from engine.engine_builder import build_engine
from engine.llm_engine import EngineConfig, LLMEngine
from protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

# Targets a loaded 2-core host meets: the tests check plans and tokens, not latency (an
# interactive 500 ms TTFT would make admission turn streams away there).
TIERS = """
[tiers.standard]
local_prefill_max_tokens = 0
ttft_ms = 120000
tpot_ms = 60000
[tiers.interactive]
local_prefill_max_tokens = 1000000
ttft_ms = 120000
tpot_ms = 60000
[tiers.batch]
ttft_ms = 120000
tpot_ms = 60000
"""
SHORT = "Name three colours of the rainbow:"
LONG = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 50) + \
    ". Count them:"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(TIERS)
    process = UpProcess("--workers", "2", "--roles", "both", "--tiers", str(tiers),
                        "--drain-timeout-s", "3",
                        log_dir=tmp_path_factory.mktemp("any-role-logs"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return build_engine("default", EngineConfig(block_size=16, max_num_seqs=8,
                                                max_num_batched_tokens=512))


def reference(engine: LLMEngine, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[list, str]:
    ids = engine.tokenizer.encode(prompt)
    result = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True))[0]
    return ids, result.text


def complete(up: UpProcess, ids: list[int], tier: str, max_tokens: int = MAX_TOKENS) -> dict:
    response = httpx.post(up.url + "/v1/completions", timeout=120,
                          headers={"x-pdserve-tier": tier},
                          json={"model": "default", "prompt": ids, "temperature": 0,
                                "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def plan_counts(up: UpProcess) -> dict[tuple[str, str, str], float]:
    text = httpx.get(up.url + "/metrics", timeout=10).text
    pattern = r'pdserve_gateway_plans_total\{kind="(\w+)",how="(\w+)",tier="(\w+)"\} (\S+)'
    return {(k, h, t): float(v) for k, h, t, v in re.findall(pattern, text)}


def test_both_workers_register_with_role_both(up) -> None:
    rows = workers(up)
    assert sorted(w["role"] for w in rows) == ["both", "both"]
    assert all(w["load"] is not None for w in rows)


def test_a_both_pair_serves_short_and_long_prompts_by_either_plan(up, engine) -> None:
    for prompt in (SHORT, LONG):
        ids, text = reference(engine, prompt)
        for tier in ("standard", "interactive", "standard", "interactive"):
            answer = complete(up, ids, tier)
            assert answer["choices"][0]["text"] == text, (prompt[:20], tier)
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    counts = plan_counts(up)
    assert counts.get(("split", "rule", "standard"), 0) >= 4
    assert counts.get(("local", "rule", "interactive"), 0) >= 4
    assert_nothing_held(up)


def test_the_router_predicts_once_the_workers_have_fitted_their_step_times(up, engine) -> None:
    ids, text = reference(engine, SHORT)
    deadline = time.monotonic() + 120
    while not any(h == "predicted" for _, h, _ in plan_counts(up)):
        assert time.monotonic() < deadline, "no plan was ever predicted"
        assert complete(up, ids, "batch")["choices"][0]["text"] == text
    rows = workers(up)
    assert all(w["step_model"] and w["step_model"]["num_samples"] >= 16 for w in rows), rows
    assert complete(up, ids, "batch")["choices"][0]["text"] == text


class Streams:
    """Streamed completions read on threads; `texts` fills as they end."""

    def __init__(self, up: UpProcess, requests: list[tuple[list[int], str]]) -> None:
        self.texts: list[str | None] = [None] * len(requests)
        self.errors: list[str] = []
        self.tokens = [0] * len(requests)
        self.threads = [threading.Thread(target=self._run, args=(up, i, ids, tier), daemon=True)
                        for i, (ids, tier) in enumerate(requests)]
        for thread in self.threads:
            thread.start()

    def _run(self, up: UpProcess, i: int, ids: list[int], tier: str) -> None:
        body = {"model": "default", "prompt": ids, "temperature": 0, "max_tokens": 40,
                "ignore_eos": True, "stream": True}
        parts: list[str] = []
        try:
            with httpx.stream("POST", up.url + "/v1/completions", json=body, timeout=180,
                              headers={"x-pdserve-tier": tier}) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            self.errors.append(str(event["error"]))
                        elif event["choices"]:
                            parts.append(event["choices"][0]["text"])
                            self.tokens[i] += 1
            self.texts[i] = "".join(parts)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(repr(exc))

    def join(self, timeout_s: float = 180.0) -> None:
        for thread in self.threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a stream never ended"


def change_role(up: UpProcess, worker_id: str, role: str, drain_s: float = 1.0,
                token: str | None = None) -> httpx.Response:
    """POST the role change with the cluster's admin token (or `token`)."""
    return httpx.post(f"{up.url}/admin/workers/{worker_id}/role", timeout=60,
                      json={"role": role, "drain_timeout_s": drain_s},
                      headers={"Authorization": f"Bearer {token or up.admin_token}"})


def wait_for_role(up: UpProcess, worker_id: str, role: str) -> None:
    deadline = time.monotonic() + 10
    while next(w for w in workers(up) if w["id"] == worker_id)["role"] != role:
        assert time.monotonic() < deadline, f"the gateway never saw {worker_id} become {role}"
        time.sleep(0.1)


def test_a_role_change_under_load_loses_no_request_and_leaks_no_block(up, engine) -> None:
    short_ids, short_text = reference(engine, SHORT, 40)
    long_ids, long_text = reference(engine, LONG, 40)
    requests = [(short_ids, "interactive"), (long_ids, "standard"), (short_ids, "batch"),
                (long_ids, "interactive"), (short_ids, "standard"), (long_ids, "batch")]
    expected = [short_text if ids is short_ids else long_text for ids, _ in requests]
    streams = Streams(up, requests)
    deadline = time.monotonic() + 120
    while min(streams.tokens) < 2:
        assert time.monotonic() < deadline and not streams.errors, streams.errors
        time.sleep(0.05)
    victim = next(w for w in workers(up) if state_of(up, w).get("num_streams"))
    answer = change_role(up, victim["id"], "prefill")
    assert answer.status_code == 200, answer.text
    changed = answer.json()
    assert changed["role"] == "prefill" and changed["epoch"] > victim["epoch"]
    streams.join()
    assert not streams.errors, streams.errors
    assert streams.texts == expected  # streams cut by the change moved to the other worker
    wait_for_role(up, victim["id"], "prefill")
    # Only one worker decodes now; every tier's plan still works.
    ids, text = reference(engine, SHORT)
    for tier in ("standard", "interactive", "batch"):
        assert complete(up, ids, tier)["choices"][0]["text"] == text
    assert change_role(up, victim["id"], "both").json()["role"] == "both"
    wait_for_role(up, victim["id"], "both")
    assert_nothing_held(up)


def test_bad_role_changes_get_clear_errors_and_change_nothing(up) -> None:
    worker_id = workers(up)[0]["id"]
    bad = change_role(up, worker_id, "janitor")
    assert bad.status_code == 400 and "role must be one of" in bad.json()["error"]["message"]
    assert change_role(up, "no-such-worker", "decode").status_code == 404
    garbage = httpx.post(f"{up.url}/admin/workers/{worker_id}/role", content=b"{not json",
                         timeout=10, headers={**up.admin_headers,
                                              "Content-Type": "application/json"})
    assert garbage.status_code == 400 and garbage.json()["error"]["type"]
    # Closed by default: no admin token, or the workers' internal token instead, is refused.
    assert httpx.post(f"{up.url}/admin/workers/{worker_id}/role", timeout=10,
                      json={"role": "decode"}).status_code == 401
    assert change_role(up, worker_id, "decode", token=up.token).status_code == 401
    assert sorted(w["role"] for w in workers(up)) == ["both", "both"]
