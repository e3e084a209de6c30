"""A decode worker whose KV pool holds fewer requests than arrive at once: every request
waits for blocks and completes (no 503), in a real `pdserve up` cluster (default model, CPU)
with two gateway replicas on one port, whose tier limit holds across both: the requests
beyond it wait in the cluster's queue (in Redis) and complete too. Each worker has a host
KV tier beside its tiny pool, and the answers stay transformers' greedy ones.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
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
max_running = 4
local_prefill_max_tokens = 0
"""
MAX_RUNNING = 4
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
    # so one request of ~20 prompt + 8 generated tokens at a time on the decode worker;
    # beside it a host KV tier of 10 MiB (14 blocks) for the prefix blocks it evicts.
    up = UpProcess("--prefill", "1", "--decode", "1", "--tiers", str(tiers),
                   "--kv-cache-mb", "2", "--kv-host-cache-gb", "0.01", "--gateways", "2",
                   log_dir=tmp_path / "logs")
    try:
        # Both replicas answer on the one port (the kernel spreads new connections).
        seen = set()
        for _ in range(40):
            with urllib.request.urlopen(up.url + "/ready", timeout=5) as response:
                limits = json.loads(response.read())["admission_limits"]
            assert limits["mode"] == "shared" and limits["replicas"] == 2
            seen.add(limits["gateway_id"])
        assert len(seen) == 2
        decode = next(w for w in up.workers() if w["role"] == "decode")
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0,
                               timeout=240)
        expected = hf_reference.greedy(hf_reference.prompt_ids(PROMPT), 8, ignore_eos=True)

        def complete(_: int) -> openai.types.Completion:
            return client.completions.create(
                model="default", prompt=PROMPT, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}, extra_headers={"x-pdserve-tier": "handoff"})

        most_running = 0
        with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = [pool.submit(complete, i) for i in range(NUM_REQUESTS)]
            while not all(f.done() for f in futures):
                # What the decode worker holds: never more than the tier admits in all.
                state = up.internal_get(decode["control_url"] + "/admin/state")
                most_running = max(most_running, state["num_running"] + state["num_waiting"]
                                   + state["num_reservations"] + state["num_waiting_for_blocks"])
                time.sleep(0.05)
            replies = [f.result() for f in futures]
        assert 1 <= most_running <= MAX_RUNNING
        assert [r.choices[0].text for r in replies] == [expected.text] * NUM_REQUESTS
        assert all(r.usage.completion_tokens == 8 for r in replies)
        metrics = decode["control_url"] + "/metrics"
        # Some of them did wait in line, and every wait ended with blocks.
        assert _metric_sum(metrics, 'pdserve_kv_waits_total{outcome="served"}') >= 1
        assert _metric_sum(metrics, 'pdserve_kv_waits_total{outcome="timed_out"}') == 0
        for worker in up.workers():  # the option reached every worker's engine
            assert _metric_sum(worker["control_url"] + "/metrics",
                               "pdserve_kv_host_blocks_total") == 14
        state = up.internal_get(decode["control_url"] + "/admin/state")  # checks invariants
        assert not state["invariant_error"]
        assert state["num_waiting_for_blocks"] == 0 and state["num_reservations"] == 0
    finally:
        assert up.stop() == 0
