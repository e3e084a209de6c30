"""Faults drawn at random against the real gateway process and stub workers: every request
either gets its whole answer, exactly once, or (only where no retry can help) a clean error.

Each request draws its shape (streamed or not, handed off P -> D or prefilled on D,
max_tokens); the faults the gateway must hide from the client take turns:

    none          nothing goes wrong
    prefill       the prefill stream dies before token 1 (a retry from the start)
    transfer      the prefill worker's KV push fails after token 1 (a migration)
    cut N         the decode stream dies after N tokens (a migration; N = 0 before any)
    gone          the decode worker holding the reservation leaves the registry while the
                  prompt computes (the attempt fails after token 1; a migration)

The stubs check what a resumed decode is told (the tokens the client has, in order), so a
token lost or repeated at a splice fails the request there, and the text is compared with
the scripted reply. After each request nothing may be held on any worker and the gateway's
invariants must hold.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import httpx2 as httpx
import pytest
from gateway_cluster import (GatewayCluster, launch, leave_during_prefill, restart, shutdown,
                             sse_events, wait_workers)

from protocol.messages import Role
from testing.stub_worker import DecodeCut, StubWorker

pytestmark = pytest.mark.timeout(240)
MODEL = "default"
NUM_REQUESTS = 30
FAULTS = ("none", "prefill", "transfer", "cut", "gone")


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    running = launch(redis_url, tmp_path_factory.mktemp("gateway-faults"))
    yield running
    assert shutdown(running) == 0, "the gateway did not exit cleanly on SIGTERM"


def answer(cluster: GatewayCluster, body: dict, tier: str, streamed: bool) -> tuple[str, str]:
    """(text, finish reason) of one completion; fails on any error the client sees."""
    headers = {"x-pdserve-tier": tier}
    if not streamed:
        response = httpx.post(cluster.url + "/v1/completions", json=body, headers=headers,
                              timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    with httpx.stream("POST", cluster.url + "/v1/completions", json={**body, "stream": True},
                      headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response.iter_lines())
    assert events and events[-1] == "[DONE]", events
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    chunks = [e["choices"][0] for e in events[:-1] if e.get("choices")]
    return "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]


def wait_all_released(stubs: list[StubWorker], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(stub.held for stub in stubs):
        assert time.monotonic() < deadline, {s.worker_id: s.held for s in stubs}
        time.sleep(0.005)


def test_random_faults_lose_or_repeat_no_token(cluster: GatewayCluster, redis_url: str) -> None:
    other = StubWorker(redis_url, Role.DECODE, f"stub-d2-{uuid.uuid4().hex[:6]}", cluster.reply,
                       namespace=cluster.namespace)
    cluster.loop.run(other.start())
    decodes = [cluster.decode, other]
    stubs = [cluster.prefill, *decodes]
    rng = random.Random(20261204)
    drawn: list[tuple[str, str, bool, int]] = []
    try:
        for i in range(NUM_REQUESTS):
            wait_workers(cluster, 3, timeout_s=20)  # a cut worker is out of routing a while
            for stub in stubs:
                stub.requests.clear()
                stub.token_interval_s = 0.002
            fault = FAULTS[i % len(FAULTS)]
            # Handed off P -> D, or prefilled on D where the fault allows.
            tier = rng.choice(["standard", "interactive"]) if fault in ("none", "cut") \
                else "standard"
            streamed = rng.random() < 0.5
            max_tokens = rng.randrange(2, len(cluster.reply) + 3)
            drawn.append((tier, fault, streamed, max_tokens))
            cut = DecodeCut()
            gate = None
            if fault == "prefill":
                cluster.prefill.prefill_cut = True
            elif fault == "transfer":
                cluster.prefill.fail_transfer = True
            elif fault == "cut":
                cut.after = rng.randrange(0, max(1, min(max_tokens, len(cluster.reply)) - 1))
            elif fault == "gone":
                gate = cluster.prefill.prefill_gate = threading.Event()
            for stub in decodes:
                stub.decode_cut = cut
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens}
            result: list[tuple[str, str]] = []
            client = threading.Thread(
                target=lambda: result.append(answer(cluster, body, tier, streamed)))
            client.start()
            victim = leave_during_prefill(cluster, decodes, gate) if gate is not None else None
            client.join(60)
            assert result, f"request {drawn[-1]} failed (see the assertion above)"
            expected = cluster.reply[:max_tokens]
            text, finish = result[0]
            assert text == "".join(t for _, t in expected), drawn[-1]
            assert finish == ("length" if max_tokens < len(cluster.reply) else "stop"), drawn[-1]
            if fault == "cut":
                assert cut.after is None, f"no stream was cut: {drawn[-1]}"
            assert not cluster.prefill.prefill_cut, f"no prefill was cut: {drawn[-1]}"
            cluster.prefill.fail_transfer = False
            cluster.prefill.prefill_gate = None
            if victim is not None:
                restart(cluster, victim)
            wait_all_released(stubs)
            state = httpx.get(cluster.url + "/admin/state", timeout=5).json()
            assert state["invariant_error"] is None, state
            assert state["num_active"] == 0, state
        metrics = httpx.get(cluster.url + "/metrics").text
        assert "pdserve_gateway_splice_mismatch_total 0" in metrics
    finally:
        for stub in decodes:
            stub.decode_cut = DecodeCut()
            stub.token_interval_s = 0.0
        cluster.prefill.fail_transfer = cluster.prefill.prefill_cut = False
        cluster.prefill.prefill_gate = None
        cluster.loop.run(other.stop())
