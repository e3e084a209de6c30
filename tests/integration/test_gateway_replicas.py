"""Two real gateway processes on one Redis admit what one gateway would.

A stub worker (testing/stub_worker.py) holds every stream before its first
token until the test lets it go, so admitted requests stay admitted while the test counts
the refusals. Redis is the test's own: it is stopped mid-test to see the 1/N fallback.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest
from gateway_cluster import LoopThread, start_gateway, wait_ready

from gateway.api.model_files import read_model_info
from launcher.redis_server import RedisServer
from protocol.messages import Role
from testing.stub_worker import StubWorker, word_reply

pytestmark = pytest.mark.timeout(120)

MAX_RUNNING = 3
TOKENS_PER_MIN = 600
TIERS_TOML = f"""
[tiers.standard]
max_running = {MAX_RUNNING}
max_queued = 0
local_prefill_max_tokens = 1000000
[tiers.batch]
tokens_per_min = {TOKENS_PER_MIN}
local_prefill_max_tokens = 1000000

[[keys]]
key = "sk-slots"
name = "slots"
tier = "standard"
admin = true

[[keys]]
key = "sk-meter"
name = "meter"
tier = "batch"
"""


class Replicas:
    def __init__(self, redis: RedisServer, tmp_path: Path) -> None:
        self.namespace = f"gwrep-{uuid.uuid4().hex[:8]}"
        _, tokenizer = read_model_info("default")
        self.loop = LoopThread()
        self.stub = StubWorker(redis.url, Role.DECODE, f"stub-{self.namespace}",
                               word_reply(tokenizer, " one two three four"),
                               namespace=self.namespace, colocated=True)
        self.loop.run(self.stub.start())
        self.hold()
        tiers = tmp_path / "tiers.toml"
        tiers.write_text(TIERS_TOML)
        self.processes, self.urls = [], []
        for _ in range(2):
            process, url = start_gateway(redis.url, self.namespace, tiers,
                                         ("--admission", "static", "--replicas", "2"))
            self.processes.append(process)
            self.urls.append(url)
        for url in self.urls:
            wait_ready(url)
        self.pool = ThreadPoolExecutor(32)

    def hold(self) -> None:
        """Streams wait before their first token from now on."""
        self.stub.decode_gate = threading.Event()

    def let_go(self) -> None:
        assert self.stub.decode_gate is not None
        self.stub.decode_gate.set()

    def fire(self, key: str, num_per_gateway: int, max_tokens: int = 4) -> list[Future]:
        """Requests sent at once, alternating between the gateways."""
        return [self.pool.submit(_chat, self.urls[i % 2], key, max_tokens)
                for i in range(2 * num_per_gateway)]

    def ready(self, index: int) -> dict:
        return httpx.get(self.urls[index] + "/ready", timeout=5.0).json()

    def close(self) -> None:
        if self.stub.decode_gate is not None:
            self.stub.decode_gate.set()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(15)
            except Exception:
                process.kill()
                process.wait(5)
            process.stdout.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.loop.run(self.stub.stop())
        self.loop.close()


def _chat(url: str, key: str, max_tokens: int) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60.0,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "default", "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "Count to four."}]})


def _settle(futures: list[Future], num_refused: int, timeout_s: float = 10.0) -> list:
    """Waits until `num_refused` answers came back; then checks nothing else did (the rest
    are admitted and held) and returns the refusals."""
    deadline = time.monotonic() + timeout_s
    while sum(f.done() for f in futures) < num_refused and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # time for an admission that should not happen to show
    done = [f.result() for f in futures if f.done()]
    assert len(done) == num_refused, [(r.status_code, r.text[:120]) for r in done]
    for response in done:
        assert response.status_code == 429, response.text
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"]
    return done


def _wait_mode(replicas: Replicas, mode: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        modes = [replicas.ready(i)["admission_limits"]["mode"] for i in (0, 1)]
        if modes == [mode, mode]:
            return
        assert time.monotonic() < deadline, f"admission limits {modes}, expected {mode}"
        time.sleep(0.1)


def test_two_gateways_share_tier_limits_and_key_rates(tmp_path: Path) -> None:
    with RedisServer() as redis:
        replicas = Replicas(redis, tmp_path)
        try:
            status = replicas.ready(0)["admission_limits"]
            assert status["mode"] == "shared" and status["replicas"] == 2

            # A tier limited to 3 running admits 3 across both gateways, not 3 each.
            slots = replicas.fire("sk-slots", 4)
            refused = _settle(slots, 2 * 4 - MAX_RUNNING)
            assert {r.json()["error"]["code"] for r in refused} == {"tier_queue_full"}
            assert len(replicas.stub.held) == MAX_RUNNING

            # A key's token rate: every request is charged prompt + max_tokens up front
            # (held streams refund nothing yet), so the bucket admits floor(600 / cost).
            started = time.monotonic()
            meter = replicas.fire("sk-meter", 5, max_tokens=100)
            deadline = time.monotonic() + 10
            while sum(f.done() for f in meter) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.5)
            elapsed_s = time.monotonic() - started
            num_refused = sum(f.done() for f in meter)
            replicas.let_go()
            answers = [f.result() for f in slots + meter]
            admitted = [r for r in answers[len(slots):] if r.status_code == 200]
            assert len(admitted) == len(meter) - num_refused
            cost = admitted[0].json()["usage"]["prompt_tokens"] + 100
            lowest = math.floor(TOKENS_PER_MIN / cost)
            highest = math.floor((TOKENS_PER_MIN + elapsed_s * TOKENS_PER_MIN / 60) / cost)
            assert lowest <= len(admitted) <= highest, (len(admitted), cost, elapsed_s)
            assert all(r.status_code in (200, 429) for r in answers)
            assert sum(r.status_code == 200 for r in answers[:len(slots)]) == MAX_RUNNING

            # Redis gone: each gateway admits 1/2 of the limit on its own, never more.
            replicas.hold()
            redis.stop()
            _wait_mode(replicas, "local")
            metrics = httpx.get(replicas.urls[0] + "/metrics", timeout=5.0,
                                headers={"Authorization": "Bearer sk-slots"}).text
            assert "pdserve_gateway_limits_shared 0" in metrics
            assert "pdserve_gateway_replicas 2" in metrics
            slots = replicas.fire("sk-slots", 4)
            _settle(slots, 2 * 4 - 2 * (MAX_RUNNING // 2))
            replicas.let_go()
            for future in slots:
                future.result()

            redis.start()  # back on its port: shared admission resumes
            _wait_mode(replicas, "shared", timeout_s=15.0)
        finally:
            replicas.close()
