"""The gateway process against stub workers: the P -> D handoff, the splice of the first
token, failures on either leg, and client disconnects freeing every worker's hold."""

from __future__ import annotations

import threading
import time
import uuid

import httpx2 as httpx
import pytest
from gateway_cluster import (GatewayCluster, launch, leave_during_prefill, restart, shutdown,
                             sse_events, wait_ready, wait_workers)

from protocol.messages import AbortRequest, Role
from testing.stub_worker import DecodeCut, StubWorker

pytestmark = pytest.mark.timeout(60)
MODEL = "default"


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    running = launch(redis_url, tmp_path_factory.mktemp("gateway"))
    yield running
    assert shutdown(running) == 0, "the gateway did not exit cleanly on SIGTERM"


@pytest.fixture(autouse=True)
def reset_stubs(cluster: GatewayCluster):
    for stub in (cluster.prefill, cluster.decode):
        stub.token_interval_s = stub.prefill_delay_s = stub.transfer_delay_s = 0.0
        stub.fail_transfer = stub.fail_reserve = False
        stub.reserve_gate = stub.prefill_gate = None
        stub.decode_gate, stub.decode_hold_after = None, 0
        stub.tokens_sent.clear()
        stub.requests.clear()
        stub.aborts.clear()
    yield
    cluster.wait_released()
    state = httpx.get(cluster.url + "/admin/state", timeout=5).json()
    assert state["invariant_error"] is None, state
    assert state["num_active"] == 0 and state["num_running"] == 0, state


def stream(cluster: GatewayCluster, body: dict, tier: str = "standard") -> list:
    with httpx.stream("POST", cluster.url + "/v1/completions", json={**body, "stream": True},
                      headers={"x-pdserve-tier": tier}, timeout=10) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response.iter_lines())


def test_handoff_streams_every_token_exactly_once(cluster: GatewayCluster) -> None:
    events = stream(cluster, {"model": MODEL, "prompt": "Say something", "max_tokens": 100,
                              "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    texts = [c["choices"][0]["text"] for c in chunks]
    # One event per token, the first from the prefill worker, the rest from the decode one.
    assert texts == [text for _, text in cluster.reply]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == len(cluster.reply)
    rid = next(r.split(":", 1)[1] for r in cluster.decode.requests)
    assert cluster.decode.requests == [f"reserve:{rid}", f"decode:{rid}"]
    # An early prefill (the decode worker has room): the destination follows the request
    # (two calls: the notice may even be handled first, and is then held for the request).
    assert sorted(cluster.prefill.requests) == [f"destination:{rid}", f"prefill:{rid}"]
    assert cluster.decode.aborts == [] and cluster.prefill.aborts == []


def test_token_one_reaches_the_client_while_the_reservation_is_still_pending(
        cluster: GatewayCluster) -> None:
    gate = cluster.decode.reserve_gate = threading.Event()  # D answers no reservation yet
    with httpx.stream("POST", cluster.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hi there", "max_tokens": 4,
                            "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        # The prefill ran beside the held reservation, and its token is out already.
        assert cluster.reply[0][1] in first
        rid = cluster.prefill.requests[0].split(":", 1)[1]
        assert cluster.prefill.requests == [f"prefill:{rid}"]  # no destination yet
        assert cluster.decode.requests == [f"reserve:{rid}"]
        gate.set()
        events = sse_events(lines)
    texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
    assert [cluster.reply[0][1], *texts] == [text for _, text in cluster.reply[:4]]
    assert events[-1] == "[DONE]"
    assert cluster.prefill.requests == [f"prefill:{rid}", f"destination:{rid}"]
    assert cluster.decode.requests == [f"reserve:{rid}", f"decode:{rid}"]


def test_a_refused_reservation_aborts_the_prefill_running_beside_it(
        cluster: GatewayCluster) -> None:
    cluster.prefill.prefill_delay_s = 5.0  # the prompt would compute this long
    cluster.decode.fail_reserve = True
    gate = cluster.decode.reserve_gate = threading.Event()  # refused once P is computing
    started = time.monotonic()
    answer: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answer.append(httpx.post(
        cluster.url + "/v1/completions", timeout=10,
        json={"model": MODEL, "prompt": "Hi there", "max_tokens": 4})))
    client.start()
    while not cluster.prefill.requests and time.monotonic() - started < 5.0:
        time.sleep(0.005)
    rid = cluster.prefill.requests[0].split(":", 1)[1]
    gate.set()
    client.join(10)
    assert answer[0].status_code >= 400, answer[0].text
    assert "error" in answer[0].json()
    cluster.wait_released()  # its stream closed, or the abort came (sent from a task)
    deadline = time.monotonic() + 2.0
    while not cluster.prefill.aborts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.prefill.aborts == [rid]
    # Aborted when the reservation failed, not when the prompt would have finished.
    assert cluster.prefill.released_at[rid] - started < 3.0


def test_first_token_reaches_the_client_before_decode_starts(cluster: GatewayCluster) -> None:
    gate = cluster.decode.decode_gate = threading.Event()  # the decode worker sends nothing
    with httpx.stream("POST", cluster.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True},
                      timeout=10) as response:
        lines = response.iter_lines()
        # Token 1 arrives while the decode stream is held (a gateway that waited for the
        # decode worker would time out here).
        first = next(line for line in lines if line.startswith("data: "))
        assert cluster.reply[0][1] in first
        assert not gate.is_set() and sum(cluster.decode.tokens_sent.values()) == 0
        gate.set()
        rest = sse_events(lines)
    assert len([e for e in rest if e != "[DONE]"]) == 2


def test_non_streaming_chat_prefilled_on_the_decode_worker(cluster: GatewayCluster) -> None:
    response = httpx.post(cluster.url + "/v1/chat/completions", timeout=10,
                          headers={"x-pdserve-tier": "interactive"},
                          json={"model": MODEL, "max_tokens": 5,
                                "messages": [{"role": "user", "content": "Hello"}]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "".join(t for _, t in cluster.reply[:5])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert [r.split(":")[0] for r in cluster.decode.requests] == ["decode"]
    assert cluster.prefill.requests == []


def test_max_tokens_one_ends_at_the_prefill_result(cluster: GatewayCluster) -> None:
    events = stream(cluster, {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    chunks = [e for e in events if e != "[DONE]"]
    assert [c["choices"][0]["text"] for c in chunks] == [cluster.reply[0][1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    cluster.wait_released()  # the unused reservation on the decode worker is freed at once
    assert len(cluster.decode.aborts) == 1


def test_failed_transfer_migrates_to_a_local_prefill_and_the_stream_completes(
        cluster: GatewayCluster) -> None:
    cluster.prefill.fail_transfer = True
    cluster.prefill.transfer_delay_s = 0.05
    cluster.decode.token_interval_s = 0.05
    events = stream(cluster, {"model": MODEL, "prompt": "Hi", "max_tokens": 50})
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))
    assert text == cluster.reply_text  # token 1 from the prefill worker, the rest resumed
    assert events[-1] == "[DONE]"
    cluster.wait_released(timeout_s=0.5)
    assert cluster.decode.aborts, "the failed attempt's reservation was not aborted"
    # The resumed attempt reached the decode worker under its own id.
    assert any(r.startswith("decode:") and r.endswith("-1") for r in cluster.decode.requests)
    metrics = httpx.get(cluster.url + "/metrics").text
    assert 'pdserve_gateway_retries_total{phase="transfer",kind="worker_error",' \
           'type="migration"} 1' in metrics


def test_decode_worker_cut_mid_stream_migrates_without_losing_a_token(
        cluster: GatewayCluster, redis_url: str) -> None:
    other = StubWorker(redis_url, Role.DECODE, f"stub-d2-{uuid.uuid4().hex[:6]}", cluster.reply,
                       namespace=cluster.namespace)
    cluster.loop.run(other.start())
    try:
        wait_workers(cluster, 3)
        cut = DecodeCut(after=3)  # whichever decode worker streams first dies after 3 tokens
        cluster.decode.decode_cut = other.decode_cut = cut
        for stub in (cluster.decode, other):
            stub.token_interval_s = 0.02
        events = stream(cluster, {"model": MODEL, "prompt": "Hi", "max_tokens": 50},
                        tier="interactive")
        assert not [e for e in events if isinstance(e, dict) and "error" in e], events
        text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))
        assert text == cluster.reply_text and events[-1] == "[DONE]"
        assert cut.after is None, "no stream was cut"
        streams = [r for stub in (cluster.decode, other) for r in stub.requests
                   if r.startswith("decode:")]
        assert sorted(s.endswith("-1") for s in streams) == [False, True], streams
    finally:
        cluster.loop.run(other.stop())
        cluster.decode.decode_cut = DecodeCut()
    # Until the gateway has seen the extra stub go and the cut worker (out of routing for a
    # few seconds) is back, the next test could find no decode worker.
    deadline = time.monotonic() + 15
    while any(w["id"] == other.worker_id for w in httpx.get(cluster.url + "/admin/workers")
              .json()["workers"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    wait_ready(cluster.url)


def test_token_one_is_not_lost_when_the_decode_worker_leaves_during_the_prefill(
        cluster: GatewayCluster, redis_url: str) -> None:
    """Token 1 is the client's once the prefill worker sent it: a decode worker gone from the
    registry before its stream opened fails the attempt after token 1, and the resumed attempt
    continues after it, so token 1's text must reach the client all the same."""
    other = StubWorker(redis_url, Role.DECODE, f"stub-d3-{uuid.uuid4().hex[:6]}", cluster.reply,
                       namespace=cluster.namespace)
    cluster.loop.run(other.start())
    victim: StubWorker | None = None
    try:
        wait_workers(cluster, 3)
        gate = cluster.prefill.prefill_gate = threading.Event()  # until the victim is gone
        answer: list[httpx.Response] = []
        client = threading.Thread(target=lambda: answer.append(httpx.post(
            cluster.url + "/v1/completions", timeout=30,
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 50})))
        client.start()
        victim = leave_during_prefill(cluster, [cluster.decode, other], gate)
        client.join(30)
        assert answer and answer[0].status_code == 200, answer and answer[0].text
        body = answer[0].json()
        assert body["choices"][0]["text"] == cluster.reply_text
        assert body["usage"]["completion_tokens"] == len(cluster.reply)
    finally:
        cluster.loop.run(other.stop())
        if victim is cluster.decode:
            restart(cluster, cluster.decode)
    deadline = time.monotonic() + 15
    while {w["id"] for w in httpx.get(cluster.url + "/admin/workers").json()["workers"]} \
            != {cluster.prefill.worker_id, cluster.decode.worker_id}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    wait_ready(cluster.url)


def test_client_disconnect_aborts_both_workers_before_another_token(
        cluster: GatewayCluster) -> None:
    cluster.prefill.transfer_delay_s = 5.0  # the prefill leg is still open when the client goes
    gate = cluster.decode.decode_gate = threading.Event()
    cluster.decode.decode_hold_after = 2  # tokens 2 and 3 flow, then the decode holds
    with httpx.stream("POST", cluster.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 50, "stream": True},
                      timeout=10) as response:
        lines, events = response.iter_lines(), []
        while len(events) < 3:  # token 1 from the prefill worker, 2 and 3 from decode
            line = next(lines, None)
            assert line is not None, f"the stream ended early: {events}"
            events += sse_events([line])
        assert cluster.decode.held and cluster.prefill.held
        (rid,) = cluster.decode.held
    # Leaving the block closed the connection: both legs are released while the decode is
    # still held (no token sent meanwhile), i.e. by the gateway ending them (abort or a
    # closed stream), not by the end of the stream; after the gate opens, nothing more.
    cluster.wait_released(timeout_s=5.0)
    assert rid in cluster.decode.released_at and rid in cluster.prefill.released_at
    assert cluster.decode.tokens_sent[rid] == 2
    gate.set()
    time.sleep(0.1)
    assert cluster.decode.tokens_sent[rid] == 2


def test_a_stream_aborted_on_its_only_decode_worker_gets_its_error_event_at_once(
        cluster: GatewayCluster) -> None:
    gate = cluster.decode.decode_gate = threading.Event()
    cluster.decode.decode_hold_after = 2
    with httpx.stream("POST", cluster.url + "/v1/completions", timeout=30,
                      headers={"x-pdserve-tier": "interactive"},  # prefilled on D
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 50,
                            "stream": True}) as response:
        lines, events = response.iter_lines(), []
        while len(events) < 2:
            line = next(lines, None)
            assert line is not None, f"the stream ended early: {events}"
            events += sse_events([line])
        (rid,) = cluster.decode.held
        # The worker aborts it (an operator's AbortRequest, a drain): its next frame says so.
        cluster.loop.run(cluster.decode._abort(AbortRequest(request_id=rid)))
        aborted_at = time.monotonic()
        gate.set()
        events += sse_events(lines)
        took_s = time.monotonic() - aborted_at
    # The only decode worker is up, and this request failed on it: nothing to wait for.
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]", events
    assert took_s < 3.0, f"the error event came {took_s:.1f} s after the abort"


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if not (sample == name or sample.startswith(name + "{")):
            continue
        if all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


def test_admin_workers_and_metrics(cluster: GatewayCluster) -> None:
    before = httpx.get(cluster.url + "/metrics").text
    for _ in range(2):
        stream(cluster, {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    workers = httpx.get(cluster.url + "/admin/workers").json()["workers"]
    by_role = {w["role"]: w for w in workers}
    assert set(by_role) == {"prefill", "decode"}
    for worker in workers:
        assert worker["state"] == "ready" and worker["control_url"].startswith("http://127.0.0.1:")
        assert set(worker["load"]) == {"num_running", "num_waiting", "kv_blocks_used",
                                       "kv_blocks_total", "num_queued_prefill_tokens",
                                       "num_decoding", "prefill_tokens_per_s",
                                       "host_blocks_used", "host_blocks_total"}
        assert worker["load"]["host_blocks_total"] == 0  # no host KV tier asked for
        assert worker["step_model"] is None or worker["step_model"]["base_s"] >= 0
        assert worker["sm_share_percent"] is None  # no MPS on the CPU
        assert worker["kv_dtype"] is None  # a stub worker does not say its KV dtype
    # The per-request counters moved by exactly the two requests (the plan when it is made,
    # the TTFT when the request's generation ends, before [DONE] goes out).
    metrics = httpx.get(cluster.url + "/metrics").text

    def moved(name: str, **labels: str) -> float:
        return metric_sum(metrics, name, **labels) - metric_sum(before, name, **labels)

    assert moved("pdserve_gateway_ttft_seconds_count", tier="standard") == 2
    assert moved("pdserve_gateway_plans_total", tier="standard") == 2
    assert 'pdserve_gateway_queue_depth{tier="interactive"} 0' in metrics
    assert "pdserve_gateway_splice_mismatch_total 0" in metrics
