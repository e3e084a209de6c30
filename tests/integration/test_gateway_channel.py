"""The gateway reaches stub workers over their channels: one connection per worker for every
request, plain tokens written to the client from the channel's read callback (by aiohttp's
response, chunked or, for an HTTP/1.0 client, not), each token exactly once and in order
whichever way it went."""

from __future__ import annotations

import socket
import time

import httpx2 as httpx
import pytest
from gateway_cluster import GatewayCluster, launch, shutdown, sse_events
from test_gateway_handoff import metric_sum

pytestmark = pytest.mark.timeout(90)
MODEL = "default"


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    running = launch(redis_url, tmp_path_factory.mktemp("gateway"))
    yield running
    assert shutdown(running) == 0, "the gateway did not exit cleanly on SIGTERM"


@pytest.fixture(autouse=True)
def paced(cluster: GatewayCluster):
    cluster.decode.token_interval_s = 0.004  # the handler waits between tokens
    yield
    cluster.decode.token_interval_s = 0.0
    cluster.wait_released()
    state = httpx.get(cluster.url + "/admin/state", timeout=5).json()
    assert state["invariant_error"] is None, state


def texts(cluster: GatewayCluster, tier: str, max_tokens: int = 100) -> list[str]:
    with httpx.stream("POST", cluster.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Say it", "max_tokens": max_tokens,
                            "stream": True},
                      headers={"x-pdserve-tier": tier}, timeout=20) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    return [e["choices"][0]["text"] for e in events[:-1]]


def test_every_request_to_a_worker_shares_one_channel_and_tokens_skip_the_handler(
        cluster: GatewayCluster) -> None:
    before = httpx.get(cluster.url + "/metrics").text
    expected = [text for _, text in cluster.reply]
    for tier in ("standard", "interactive", "standard"):  # handed off, local, handed off
        assert texts(cluster, tier) == expected
    metrics = httpx.get(cluster.url + "/metrics").text

    def moved(name: str) -> float:
        return metric_sum(metrics, name) - metric_sum(before, name)

    direct = moved("pdserve_gateway_direct_tokens_total")
    assert moved("pdserve_gateway_tokens_total") == 3 * len(expected)
    assert metric_sum(metrics, "pdserve_gateway_channels") == 2
    assert cluster.prefill.server.num_channels == 1
    assert cluster.decode.server.num_channels == 1
    # Paced tokens find the handler waiting: most are written by the read callback.
    assert direct >= len(expected), f"{direct} tokens written from the read callback"


def test_an_http_10_client_gets_every_token_unchunked(cluster: GatewayCluster) -> None:
    # No chunked encoding for HTTP/1.0: aiohttp's response frames what the read callback
    # writes as it does the handler's writes, and the body ends with the connection.
    before = httpx.get(cluster.url + "/metrics").text
    host, port = cluster.url.removeprefix("http://").split(":")
    body = b'{"model": "default", "prompt": "Say it", "max_tokens": 100, "stream": true}'
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nx-pdserve-tier: interactive\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, raw = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower(), head
    events = sse_events(raw.decode().splitlines())
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == [t for _, t in cluster.reply]
    direct = metric_sum(httpx.get(cluster.url + "/metrics").text,
                        "pdserve_gateway_direct_tokens_total") \
        - metric_sum(before, "pdserve_gateway_direct_tokens_total")
    assert direct > 0, "no token was written from the read callback"


def test_a_client_that_reads_slowly_gets_every_token_once_in_order(
        cluster: GatewayCluster) -> None:
    # 1000 tokens of 8 KB each: more than socket buffers hold (4 MB), so the gateway's writes
    # back up while the client sleeps (the read callback's writes step aside, then take
    # over again).
    reply = [(1000 + i, f" <{i}>" + "x" * 8000) for i in range(1000)]
    before = httpx.get(cluster.url + "/metrics").text
    saved = cluster.prefill.reply, cluster.decode.reply
    cluster.prefill.reply = cluster.decode.reply = reply
    cluster.decode.token_interval_s = 0.0005
    try:
        host, port = cluster.url.removeprefix("http://").split(":")
        body = (b'{"model": "default", "prompt": "Say it", "max_tokens": %d, "stream": true}'
                % len(reply))
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nx-pdserve-tier: interactive\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            data = sock.recv(2048)
            time.sleep(1.0)  # the gateway's writes pile up behind this reader
            sock.settimeout(20)
            while not data.endswith(b"0\r\n\r\n"):
                chunk = sock.recv(65536)
                assert chunk, "the stream was cut"
                data += chunk
    finally:
        cluster.prefill.reply, cluster.decode.reply = saved
    head, _, chunked = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
    lines = dechunk(chunked).decode().splitlines()
    got = [e["choices"][0]["text"] for e in sse_events(lines)[:-1]]
    assert got == [text for _, text in reply]
    direct = metric_sum(httpx.get(cluster.url + "/metrics").text,
                        "pdserve_gateway_direct_tokens_total") \
        - metric_sum(before, "pdserve_gateway_direct_tokens_total")
    # Both ways carried tokens of this one stream.
    assert 0 < direct < len(reply), f"{direct} of {len(reply)} tokens from the read callback"


def dechunk(body: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        assert body[end + 2 + size:end + 4 + size] == b"\r\n", "a chunk is malformed"
        pos = end + 4 + size
