"""A real `pdserve gateway` process in front of stub workers (testing/stub_worker.py).

The stubs run in-process on their own event loop thread, so tests can change their
behaviour between requests and read what they hold; the gateway is a real subprocess
found through the real Redis registry. Tiers used by the tests (the API is open, so the
`x-pdserve-tier` header picks one):

    standard     local_prefill_max_tokens = 0     every prompt is handed off P -> D
    interactive  local_prefill_max_tokens = 10**6 every prompt is prefilled on D
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx

from gateway.api.model_files import read_model_info
from protocol.messages import Role
from testing.stub_worker import StubWorker, word_reply

REPO = Path(__file__).resolve().parents[2]
TIERS_TOML = """
[tiers.standard]
local_prefill_max_tokens = 0
[tiers.interactive]
local_prefill_max_tokens = 1000000
"""
REPLY_TEXT = " The quick brown fox jumps over the lazy dog again and again"


class LoopThread:
    """An event loop on a daemon thread; `run` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class GatewayCluster:
    url: str
    prefill: StubWorker
    decode: StubWorker
    reply: list[tuple[int, str]]
    process: subprocess.Popen
    loop: LoopThread
    namespace: str

    @property
    def reply_text(self) -> str:
        return "".join(text for _, text in self.reply)

    def wait_released(self, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.prefill.held or self.decode.held:
            if time.monotonic() > deadline:
                raise AssertionError(f"still held: prefill {self.prefill.held}, "
                                     f"decode {self.decode.held}")
            time.sleep(0.005)


def start_gateway(redis_url: str, namespace: str, tiers_file: Path,
                  extra: tuple[str, ...] = (), env: dict[str, str] | None = None
                  ) -> tuple[subprocess.Popen, str]:
    """`env`: on top of this process's environment (e.g. PDSERVE_ADMIN_TOKEN). The URL holds
    the password: it goes in the environment, never on the command line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "gateway", "--port", "0",
         "--namespace", namespace, "--tiers", str(tiers_file), "--log-level", "warning", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=None, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_REDIS_URL": redis_url,
             **(env or {})})
    line = process.stdout.readline()  # the process prints its URL once it listens
    if "listening on" not in line:
        process.kill()
        raise RuntimeError(f"gateway did not start: {line!r}")
    return process, line.rsplit(" ", 1)[-1].strip()


def wait_ready(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url}/ready did not answer 200 within {timeout_s} s")


def launch(redis_url: str, tmp_dir: Path, extra: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> GatewayCluster:
    namespace = f"gwtest-{uuid.uuid4().hex[:8]}"
    _, tokenizer = read_model_info("default")
    reply = word_reply(tokenizer, REPLY_TEXT)
    loop = LoopThread()
    prefill = StubWorker(redis_url, Role.PREFILL, f"stub-p-{namespace}", reply, namespace=namespace)
    decode = StubWorker(redis_url, Role.DECODE, f"stub-d-{namespace}", reply, namespace=namespace)
    loop.run(prefill.start())
    loop.run(decode.start())
    tiers_file = tmp_dir / "tiers.toml"
    tiers_file.write_text(TIERS_TOML)
    process, url = start_gateway(redis_url, namespace, tiers_file, extra, env)
    wait_ready(url)
    cluster = GatewayCluster(url, prefill, decode, reply, process, loop, namespace)
    wait_workers(cluster, 2)  # /ready needs one decode worker; wait for the prefill worker too
    return cluster


def wait_workers(cluster: GatewayCluster, num_workers: int, timeout_s: float = 10.0) -> None:
    """Until the gateway lists `num_workers` ready workers."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = httpx.get(cluster.url + "/admin/workers").json()["workers"]
        if sum(w["state"] == "ready" for w in workers) >= num_workers:
            return
        assert time.monotonic() < deadline, f"the gateway lists {workers}"
        time.sleep(0.05)


def leave_during_prefill(cluster: GatewayCluster, decodes: list[StubWorker],
                         gate: threading.Event, timeout_s: float = 10.0) -> StubWorker:
    """With the prefill held by `gate`: stop the decode stub that was asked to reserve,
    wait until the gateway no longer lists it, then let the prefill answer; returns it
    (`restart` brings it back)."""
    deadline = time.monotonic() + timeout_s
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, "no decode worker was asked to reserve"
        victim = next((s for s in decodes if any(r.startswith("reserve:") for r in s.requests)),
                      None)
        time.sleep(0.005)
    cluster.loop.run(victim.stop())  # leaves the registry; the prefill still computes
    while any(w["id"] == victim.worker_id
              for w in httpx.get(cluster.url + "/admin/workers").json()["workers"]):
        assert time.monotonic() < deadline, "the gateway still lists the stopped worker"
        time.sleep(0.02)
    gate.set()
    return victim


def restart(cluster: GatewayCluster, stub: StubWorker) -> None:
    """A stopped stub back in the registry, holding nothing of its past run."""
    stub.held.clear()
    cluster.loop.run(stub.start())


def shutdown(cluster: GatewayCluster) -> int:
    cluster.process.terminate()
    try:
        code = cluster.process.wait(10)
    except subprocess.TimeoutExpired:
        cluster.process.kill()
        code = cluster.process.wait(5)
    cluster.process.stdout.close()
    cluster.loop.run(cluster.prefill.stop())
    cluster.loop.run(cluster.decode.stop())
    cluster.loop.close()
    return code


def sse_events(lines) -> list[Any]:
    """The JSON payloads of an SSE stream's `data:` lines, "[DONE]" as the string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
