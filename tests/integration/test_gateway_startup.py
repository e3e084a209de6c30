"""A gateway told to expect N workers stays "starting" until N have registered: /ready and
the OpenAI API answer 503 naming how many are ready; then it opens and stays open.
(A real gateway process, stub workers in the real Redis registry.)"""

from __future__ import annotations

import time
import uuid

import httpx2 as httpx
import pytest
from gateway_cluster import REPLY_TEXT, LoopThread, start_gateway

from gateway.api.model_files import read_model_info
from protocol.messages import Role
from testing.stub_worker import StubWorker, word_reply

pytestmark = pytest.mark.timeout(60)


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_api_opens_once_the_expected_workers_have_registered(redis_url, tmp_path) -> None:
    namespace = f"gwstart-{uuid.uuid4().hex[:8]}"
    _, tokenizer = read_model_info("default")
    reply = word_reply(tokenizer, REPLY_TEXT)
    loop = LoopThread()
    decode = StubWorker(redis_url, Role.DECODE, f"stub-d-{namespace}", reply, namespace=namespace)
    prefill: StubWorker | None = StubWorker(redis_url, Role.PREFILL, f"stub-p-{namespace}", reply,
                         namespace=namespace)
    loop.run(decode.start())
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("")
    process, url = start_gateway(redis_url, namespace, tiers, ("--expect-workers", "2"))
    try:
        _until(lambda: len(httpx.get(url + "/admin/workers").json()["workers"]) == 1)
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503
        body = ready.json()
        assert body.pop("admission_limits")["mode"] in ("solo", "shared")  # one gateway
        assert body | {"redis_connected": True} == {
            "ready": False, "decode_workers": 1, "draining": False, "redis_connected": True,
            "started": False, "workers_ready": 1, "workers_expected": 2}
        for answer in (httpx.get(url + "/v1/models"),
                       httpx.post(url + "/v1/completions",
                                  json={"model": "default", "prompt": "hi", "max_tokens": 2})):
            assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
            assert answer.json()["error"]["message"] == (
                "pdserve is starting: 1 of 2 workers are ready (loading the model); retry in "
                "a few seconds.")
        assert decode.requests == []  # nothing was routed while starting
        assert prefill is not None
        loop.run(prefill.start())
        _until(lambda: httpx.get(url + "/ready").status_code == 200)
        assert httpx.get(url + "/v1/models").status_code == 200
        completion = httpx.post(url + "/v1/completions", timeout=30,
                                json={"model": "default", "prompt": "hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
        loop.run(prefill.stop())  # a worker lost after start-up does not close it again
        prefill = None
        _until(lambda: len(httpx.get(url + "/admin/workers").json()["workers"]) == 1, 30.0)
        assert httpx.get(url + "/v1/models").status_code == 200
    finally:
        process.terminate()
        process.wait(10)
        process.stdout.close()
        loop.run(decode.stop())
        if prefill is not None:
            loop.run(prefill.stop())
        loop.close()
