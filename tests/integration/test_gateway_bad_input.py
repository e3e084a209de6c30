"""Bad requests against the real gateway process: each gets a 4xx OpenAI-style error, nothing
reaches a worker, and the gateway keeps serving good requests afterwards."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from gateway_cluster import GatewayCluster, launch, shutdown

pytestmark = pytest.mark.timeout(60)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    running = launch(redis_url, tmp_path_factory.mktemp("gateway"))
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
    "n > 1": (js(CHAT, {**GOOD_CHAT, "n": 3}), 400),
    "token id out of vocabulary": (js(COMPLETIONS, {"model": "default", "prompt": [10**9]}), 400),
    "top_p out of range": (js(CHAT, {**GOOD_CHAT, "top_p": 7}), 400),
    "unknown model": (js(CHAT, {**GOOD_CHAT, "model": "gpt-9"}), 404),
    "invalid tier": (js(CHAT, GOOD_CHAT, {"x-pdserve-tier": "platinum"}), 400),
    "oversize body": (js(COMPLETIONS, {"model": "default", "prompt": "x" * (5 << 20)}), 413),
    "unknown path": (js("/v1/embeddings", GOOD_CHAT), 404),
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
