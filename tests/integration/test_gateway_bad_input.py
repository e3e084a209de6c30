"""Bad requests against the real gateway process: each gets a 4xx OpenAI-style error, nothing
reaches a worker, and the gateway keeps serving good requests afterwards."""

from __future__ import annotations

import json
import random
import socket
import time

import httpx2 as httpx
import pytest
from gateway_cluster import GatewayCluster, launch, shutdown

pytestmark = pytest.mark.timeout(60)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    running = launch(redis_url, tmp_path_factory.mktemp("gateway"),
                     extra=("--body-timeout-s", "2"))
    yield running
    assert shutdown(running) == 0


def raw(path: str, body: bytes, headers: dict | None = None):
    return (path, body, {"Content-Type": "application/json", **(headers or {})})


def js(path: str, body: dict, headers: dict | None = None):
    return raw(path, json.dumps(body).encode(), headers)


BAD_REQUESTS = {
    "malformed json": (raw(CHAT, b'{"model": "default", "messages": ['), 400),
    "not an object": (raw(CHAT, b"[1, 2, 3]"), 400),
    "empty body": (raw(CHAT, b""), 400),
    "invalid utf-8": (raw(COMPLETIONS, b'{"model": "default", "prompt": "\xff\xfe"}'), 400),
    "messages wrong type": (js(CHAT, {"model": "default", "messages": "hello"}), 400),
    "max_tokens wrong type": (js(CHAT, {**GOOD_CHAT, "max_tokens": "ten"}), 400),
    "temperature wrong type": (js(CHAT, {**GOOD_CHAT, "temperature": [1]}), 400),
    "negative max_tokens": (js(CHAT, {**GOOD_CHAT, "max_tokens": -5}), 400),
    "zero max_tokens": (js(COMPLETIONS, {"model": "default", "prompt": "a", "max_tokens": 0}), 400),
    "huge max_tokens": (js(CHAT, {**GOOD_CHAT, "max_tokens": 10**12}), 400),
    "empty messages": (js(CHAT, {"model": "default", "messages": []}), 400),
    "empty prompt": (js(COMPLETIONS, {"model": "default", "prompt": ""}), 400),
    "missing model": (js(CHAT, {"messages": GOOD_CHAT["messages"]}), 400),
    "unknown role": (js(CHAT, {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]}), 400),
    "n > 16": (js(CHAT, {**GOOD_CHAT, "n": 17}), 400),
    "uncompilable schema": (js(CHAT, {**GOOD_CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}), 400),
    "token id out of vocabulary": (js(COMPLETIONS, {"model": "default", "prompt": [10**9]}), 400),
    "top_p out of range": (js(CHAT, {**GOOD_CHAT, "top_p": 7}), 400),
    "unknown model": (js(CHAT, {**GOOD_CHAT, "model": "gpt-9"}), 404),
    "invalid tier": (js(CHAT, GOOD_CHAT, {"x-pdserve-tier": "platinum"}), 400),
    "oversize body": (js(COMPLETIONS, {"model": "default", "prompt": "x" * (5 << 20)}), 413),
    "unknown path": (js("/v1/embeddings", GOOD_CHAT), 404),
    "form content type": (raw(CHAT, json.dumps(GOOD_CHAT).encode(),
                              {"Content-Type": "application/x-www-form-urlencoded"}), 415),
    "top_k past 64 bits": (js(COMPLETIONS, {"model": "default", "prompt": "a",
                                            "top_k": 10**20}), 400),
    "seed past 64 bits": (js(COMPLETIONS, {"model": "default", "prompt": "a", "seed": 2**70}), 400),
    "prompt too long to tokenize": (js(COMPLETIONS, {"model": "default",
                                                     "prompt": "x" * 3_000_000}), 400),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error(cluster: GatewayCluster, case: str) -> None:
    (path, body, headers), status = BAD_REQUESTS[case]
    cluster.decode.requests.clear()
    response = httpx.post(cluster.url + path, content=body, headers=headers, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert cluster.decode.requests == [] and cluster.prefill.requests == []


def test_gateway_still_serves_after_the_battery(cluster: GatewayCluster) -> None:
    for (path, body, headers), _ in BAD_REQUESTS.values():
        httpx.post(cluster.url + path, content=body, headers=headers, timeout=10)
    assert httpx.get(cluster.url + "/health").status_code == 200
    response = httpx.post(cluster.url + CHAT, json=GOOD_CHAT, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == \
        "".join(text for _, text in cluster.reply[:4])
    metrics = httpx.get(cluster.url + "/metrics").text
    assert 'status="500"' not in metrics
    assert 'pdserve_gateway_requests_total{endpoint="/v1/chat/completions",status="400"}' in metrics


def test_a_body_that_does_not_arrive_is_answered_408_and_closed(cluster: GatewayCluster) -> None:
    host, port = cluster.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": "default", "prompt": "')
        answer = b""
        while chunk := sock.recv(65536):  # until the gateway closes the connection
            answer += chunk
    took_s = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer
    assert took_s < 10, f"closed after {took_s:.1f} s (the limit is 2 s)"


def test_a_malformed_header_gets_a_json_400(cluster: GatewayCluster) -> None:
    # aiohttp's parser refuses it before any handler runs (gateway/api/http_server.py).
    cluster.decode.requests.clear()
    host, port = cluster.url.removeprefix("http://").split(":")
    body = json.dumps(GOOD_CHAT).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\x7f\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, raw = answer.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0] and b"application/json" in head, answer[:300]
    assert json.loads(raw)["error"]["code"] == "bad_http_request"
    assert cluster.decode.requests == []
    assert httpx.post(cluster.url + CHAT, json=GOOD_CHAT, timeout=10).status_code == 200


def _fuzzed_request(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """A request a fuzzer would send: mostly almost-valid bodies, some garbage."""
    path = rng.choice([CHAT, CHAT, COMPLETIONS, COMPLETIONS, "/v1/models", "/v1/x", "/"])
    method = rng.choice(["POST"] * 8 + ["GET", "PUT", "DELETE"])
    base = dict(GOOD_CHAT) if path == CHAT else {"model": "default", "prompt": "Hi",
                                                  "max_tokens": 4}
    weird = [None, -1, 0, 1, 2**31, 2**63, 2**64, 10**20, -10**20, 1.5, -0.0, 1e308, "",
             "x" * 300, [], [1, "a"], {}, {"a": [None]}, True, "\u0000", [[[]]]]
    fields = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k",
              "seed", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "stream",
              "stream_options", "min_tokens", "presence_penalty", "logit_bias", "echo",
              "max_completion_tokens", "response_format", "tools", "user"]
    for _ in range(rng.randint(0, 3)):
        base[rng.choice(fields)] = rng.choice(weird)
    kind = rng.random()
    if kind < 0.75:
        body = json.dumps(base).encode()
    elif kind < 0.9:
        encoded = json.dumps(base).encode()
        cut = rng.randint(0, len(encoded))
        body = encoded[:cut] + bytes(rng.randrange(256) for _ in range(rng.randint(0, 8)))
    else:
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    content_type = rng.choice(["application/json"] * 6 + ["text/plain", "",
                                                          "application/json; charset=utf-8"])
    headers = {"Content-Type": content_type} if content_type else {}
    if rng.random() < 0.05:
        headers["x-pdserve-tier"] = rng.choice(["interactive", "batch", "gold", ""])
    return method, path, body, headers


def test_three_thousand_fuzzed_requests_get_no_5xx_and_openai_errors(
        cluster: GatewayCluster) -> None:
    rng = random.Random(20261201)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        for i in range(3000):
            method, path, body, headers = _fuzzed_request(rng)
            response = client.request(method, path, content=body, headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (i, method, path, body[:200], response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text
                assert isinstance(error["message"], str) and error["message"]
    print("fuzzed statuses:", dict(sorted(statuses.items())))
    assert statuses.get(200, 0) > 50 and sum(v for k, v in statuses.items() if k >= 400) > 1000
    assert httpx.get(cluster.url + "/health").status_code == 200
    cluster.wait_released()
