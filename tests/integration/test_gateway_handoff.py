"""The gateway process against stub workers: the P -> D handoff, the splice of the first
token, failures on either leg, and client disconnects freeing every worker's hold."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest
from gateway_cluster import GatewayCluster, launch, shutdown, sse_events

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
        stub.fail_transfer = False
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
    assert cluster.prefill.requests == [f"prefill:{rid}"]
    assert cluster.decode.aborts == [] and cluster.prefill.aborts == []


def test_first_token_reaches_the_client_before_decode_starts(cluster: GatewayCluster) -> None:
    cluster.decode.token_interval_s = 0.3  # token 2 comes 300 ms after the decode starts
    started = time.monotonic()
    with httpx.stream("POST", cluster.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True},
                      timeout=10) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        first_at = time.monotonic() - started
        rest = sse_events(lines)
    assert cluster.reply[0][1] in first
    assert first_at < 0.25, f"token 1 waited for the decode worker ({first_at:.3f} s)"
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


def test_failed_transfer_is_an_in_band_error_and_frees_both_workers(cluster: GatewayCluster) -> None:
    cluster.prefill.fail_transfer = True
    cluster.prefill.transfer_delay_s = 0.05
    cluster.decode.token_interval_s = 0.05
    events = stream(cluster, {"model": MODEL, "prompt": "Hi", "max_tokens": 50})
    assert events[0]["choices"][0]["text"] == cluster.reply[0][1]  # token 1 was already out
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "transfer" in errors[0]["error"]["message"].lower()
    assert events[-1] == "[DONE]"
    cluster.wait_released(timeout_s=0.5)
    assert cluster.decode.aborts, "the decode worker was not told to abort"


def test_client_disconnect_frees_both_workers_within_100_ms(cluster: GatewayCluster) -> None:
    cluster.decode.token_interval_s = 0.05
    cluster.prefill.transfer_delay_s = 5.0  # the prefill leg is still open when the client goes
    with httpx.stream("POST", cluster.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 50, "stream": True},
                      timeout=10) as response:
        lines, num_events = response.iter_lines(), 0
        while num_events < 3:  # token 1 from the prefill worker, 2 and 3 from decode
            num_events += len(sse_events([next(lines)]))
        assert cluster.decode.held and cluster.prefill.held
        gone_at = time.monotonic()
    # Leaving the block closed the connection.
    cluster.wait_released(timeout_s=1.0)
    released = [*cluster.decode.released_at.values(), *cluster.prefill.released_at.values()]
    latency_s = max(released) - gone_at
    print(f"disconnect -> all freed: {latency_s * 1000:.1f} ms")
    assert latency_s < 0.1, f"workers freed {latency_s * 1000:.0f} ms after the disconnect"


def test_admin_workers_and_metrics(cluster: GatewayCluster) -> None:
    stream(cluster, {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    workers = httpx.get(cluster.url + "/admin/workers").json()["workers"]
    by_role = {w["role"]: w for w in workers}
    assert set(by_role) == {"prefill", "decode"}
    for worker in workers:
        assert worker["state"] == "ready" and worker["control_url"].startswith("http://127.0.0.1:")
        assert set(worker["load"]) == {"num_running", "num_waiting", "kv_blocks_used",
                                       "kv_blocks_total"}
    metrics = httpx.get(cluster.url + "/metrics").text
    assert 'pdserve_gateway_ttft_seconds_count{tier="standard"}' in metrics
    assert 'pdserve_gateway_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert 'pdserve_gateway_queue_depth{tier="interactive"} 0' in metrics
    assert "pdserve_gateway_splice_mismatch_total 0" in metrics
