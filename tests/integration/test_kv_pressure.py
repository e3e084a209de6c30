"""A decode worker whose KV pool holds fewer requests than arrive at once: every request
waits for blocks and completes (no 503), in a real `pdserve up` cluster (default model, CPU).
"""

from __future__ import annotations

import concurrent.futures
import urllib.request

import openai
import pytest
from up_process import UpProcess

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# Every prompt handed off P -> D, so each needs a reservation on the decode worker.
TIERS = """
[tiers.handoff]
priority = 1
ttft_ms = 60000
tpot_ms = 5000
max_queued = 64
max_running = 64
local_prefill_max_tokens = 0
"""
PROMPT = "Count slowly from one to twenty, one number per line: one, two,"
NUM_REQUESTS = 6


def _metric_sum(url: str, prefix: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def test_requests_beyond_the_kv_pool_wait_and_all_complete(tmp_path, hf_reference) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(TIERS)
    # 2 MiB of KV per worker: 2 blocks of 16 tokens on this model in fp32 (45 KiB a token),
    # so one request of ~20 prompt + 8 generated tokens at a time on the decode worker.
    up = UpProcess("--tiers", str(tiers), "--kv-cache-mb", "2", log_dir=tmp_path / "logs")
    try:
        decode = next(w for w in up.workers() if w["role"] == "decode")
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0,
                               timeout=240)
        expected = hf_reference.greedy(hf_reference.prompt_ids(PROMPT), 8, ignore_eos=True)

        def complete(_: int) -> openai.types.Completion:
            return client.completions.create(
                model="default", prompt=PROMPT, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}, extra_headers={"x-pdserve-tier": "handoff"})

        with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
            replies = list(pool.map(complete, range(NUM_REQUESTS)))
        assert [r.choices[0].text for r in replies] == [expected.text] * NUM_REQUESTS
        assert all(r.usage.completion_tokens == 8 for r in replies)
        metrics = decode["control_url"] + "/metrics"
        # Some of them did wait in line, and every wait ended with blocks.
        assert _metric_sum(metrics, 'pdserve_kv_waits_total{outcome="served"}') >= 1
        assert _metric_sum(metrics, 'pdserve_kv_waits_total{outcome="timed_out"}') == 0
        state = up.internal_get(decode["control_url"] + "/internal/state")  # checks invariants
        assert not state["invariant_error"]
        assert state["num_waiting_for_blocks"] == 0 and state["num_reservations"] == 0
    finally:
        assert up.stop() == 0
