"""Registry entries bound to the cluster's secret, against real processes: a real
`pdserve gateway` and a real `pdserve agent` (both with the cluster's internal token), stub
workers that bind their entries with it (testing/stub_worker.py), and an insider: a process
that can write Redis (it holds the Redis password, say) but not the token. It registers
fake workers the way the project's own code does (`next_epoch` + `heartbeat`), each a
copy of a real worker's entry pointing elsewhere:

    decoy     control_url: the insider's own listener; idle by its load, so the router
              would prefer it; the gateway's pid; renewed every 0.3 s
    argv      named like an element of the gateway's command line (its namespace), with
              the gateway's pid, its lease left to run down (a worker that stopped
              answering and heartbeating: "dead"): what an agent that matched a pid's
              command line against the worker id SIGKILLed (the issue's probe did it with
              an entry named `gateway`)
    copied    a real worker's entry, binding and all, with the listener as control_url;
              renewed every 0.3 s

The listener records every byte and never answers. What must show: it gets no connection
at all (so no token, no greeting, no prompt); every request is served by the real
workers; the gateway lists only them; the agent decides nothing about the fakes and the
gateway lives on; each fake is logged once as ignored.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import msgspec
import pytest
from gateway_cluster import REPO, TIERS_TOML, LoopThread, wait_ready

from gateway.api.model_files import read_model_info
from protocol.messages import LoadReport, Role, WorkerInfo
from protocol.worker_load import WorkerLoad
from state.redis_state import RedisState, connect
from testing.stub_worker import StubWorker, word_reply

pytestmark = [pytest.mark.timeout(120)]

TOKEN = "binding-test-token-7d3e9a"
NUM_REQUESTS = 12


@dataclass
class Listener:
    """The insider's control port: accepts, records, answers nothing."""

    received: bytearray = field(default_factory=bytearray)
    num_connections: int = 0
    url: str = ""
    server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self.url

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        while chunk := await reader.read(65536):
            self.received += chunk
        writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


class Insider:
    """Writes fake registry entries with plain Redis access, renewed like a heartbeat."""

    def __init__(self, redis_url: str, namespace: str, renewed: list[WorkerInfo],
                 lapsing: list[WorkerInfo], seen: Callable[[WorkerInfo], bool]) -> None:
        """`lapsing` entries are renewed too until `seen` says every reader logged them (or
        for 30 s), then left to lapse: a reader slow to start must still meet them."""
        self.state = RedisState(connect(redis_url), namespace)  # no registry key: no token
        self.renewed, self.lapsing, self.seen = renewed, lapsing, seen
        self.task: asyncio.Task[None] | None = None

    @property
    def fakes(self) -> list[WorkerInfo]:
        return self.renewed + self.lapsing

    async def start(self) -> None:
        self.renewed = [await self._register(fake) for fake in self.renewed]
        self.lapsing = [await self._register(fake) for fake in self.lapsing]
        await self._renew(self.fakes, lease_ttl_ms=2500)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _register(self, fake: WorkerInfo) -> WorkerInfo:
        return msgspec.structs.replace(fake, epoch=await self.state.next_epoch(fake.worker_id))

    async def _renew(self, fakes: list[WorkerInfo], lease_ttl_ms: int = 3000) -> None:
        for fake in fakes:
            idle = LoadReport(worker_id=fake.worker_id, epoch=fake.epoch,
                              load=WorkerLoad(num_kv_blocks_total=fake.num_kv_blocks))
            await self.state.heartbeat(fake, idle, lease_ttl_ms=lease_ttl_ms)

    async def _run(self) -> None:
        lapse_by = time.monotonic() + 30.0
        while True:
            await asyncio.sleep(0.3)
            held = [fake for fake in self.lapsing
                    if time.monotonic() < lapse_by and not self.seen(fake)]
            await self._renew(self.renewed + held)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.state.aclose()


def start_process(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1",
                                 "PDSERVE_INTERNAL_TOKEN": TOKEN})


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
    if process.stdout is not None:
        process.stdout.close()


@dataclass
class Probe:
    gateway: subprocess.Popen
    agent: subprocess.Popen
    url: str
    stubs: list[StubWorker]
    listener: Listener
    fakes: list[WorkerInfo]
    audit_log: Path
    logs: dict[str, Path]
    answers: list[str]


@pytest.fixture(scope="module")
def probe(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probe]:
    tmp = tmp_path_factory.mktemp("binding")
    namespace = f"bind-{uuid.uuid4().hex[:8]}"
    _, tokenizer = read_model_info("default")
    reply = word_reply(tokenizer, " one two three four")
    loop = LoopThread()
    stubs = [StubWorker(redis_url, role, f"stub-{role.value}-{namespace}", reply,
                        namespace=namespace, token=TOKEN)
             for role in (Role.PREFILL, Role.DECODE)]
    for stub in stubs:
        loop.run(stub.start())
    tiers = tmp / "tiers.toml"
    tiers.write_text(TIERS_TOML)
    logs = {"gateway": tmp / "gateway.log", "agent": tmp / "agent.log"}
    gateway = start_process(["gateway", "--redis-url", redis_url, "--port", "0", "--namespace",
                             namespace, "--tiers", str(tiers), "--log-level", "info"],
                            logs["gateway"])
    line = gateway.stdout.readline()
    assert "listening on" in line, line
    url = line.rsplit(" ", 1)[-1].strip()
    wait_ready(url)
    audit_log = tmp / "agent-audit.jsonl"
    agent = start_process(["agent", "--redis-url", redis_url, "--namespace", namespace,
                           "--restart", "auto", "--port", "0", "--period-s", "0.2",
                           "--control-timeout-s", "0.3", "--hung-after-s", "1",
                           "--lease-margin-s", "0.5", "--cooldown-s", "1", "--rebalance", "off",
                           "--audit-log", str(audit_log)], logs["agent"])
    listener = Listener()
    loop.run(listener.start())
    real = stubs[1].publisher.info
    decoy = msgspec.structs.replace(real, worker_id=f"decoy-{namespace}", binding=b"",
                                    control_url=listener.url, pid=gateway.pid)
    argv = msgspec.structs.replace(decoy, worker_id=namespace, role=Role.PREFILL)
    copied = msgspec.structs.replace(real, worker_id=f"copied-{namespace}",
                                     control_url=listener.url)
    def seen(fake: WorkerInfo) -> bool:
        return all(f"ignoring the registry entry {fake.worker_id!r}" in log.read_text()
                   for log in logs.values())

    insider = Insider(redis_url, namespace, renewed=[decoy, copied], lapsing=[argv], seen=seen)
    loop.run(insider.start())
    answers = []
    try:
        deadline = time.monotonic() + 6.0  # 30 agent ticks; the old agent acted within 2 s
        with httpx.Client(base_url=url, timeout=30) as client:
            for i in range(NUM_REQUESTS):
                tier = "standard" if i % 2 else "interactive"  # handoffs and local prefills
                response = client.post("/v1/completions", headers={"x-pdserve-tier": tier},
                                       json={"model": "default", "prompt": f"question {i}",
                                             "max_tokens": 4})
                assert response.status_code == 200, response.text
                answers.append(response.json()["choices"][0]["text"])
        time.sleep(max(0.0, deadline - time.monotonic()))
        yield Probe(gateway, agent, url, stubs, listener, insider.fakes, audit_log, logs,
                    answers)
    finally:
        loop.run(insider.stop())
        stop_process(agent)
        stop_process(gateway)
        for stub in stubs:
            loop.run(stub.stop())
        loop.run(listener.stop())
        loop.close()


def test_a_fake_entry_gets_no_connection_so_no_token_and_no_prompt(probe: Probe) -> None:
    assert probe.listener.num_connections == 0, bytes(probe.listener.received[:200])
    assert TOKEN.encode() not in probe.listener.received


def test_every_request_is_served_by_the_real_workers_and_only_they_are_listed(
        probe: Probe) -> None:
    assert probe.answers == [" one two three four"] * NUM_REQUESTS
    served = [r for stub in probe.stubs for r in stub.requests
              if r.startswith(("prefill:", "decode:"))]
    assert len([r for r in served if r.startswith("decode:")]) == NUM_REQUESTS
    listing = httpx.get(probe.url + "/admin/workers",
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()["workers"]
    # The lapsing fake's id may still be listed, as expired, until the gateway purges it
    # (purge_grace_s after it lapsed); no fake is ever listed as anything else.
    ready = [w["id"] for w in listing if w["state"] == "ready"]
    assert sorted(ready) == sorted(s.worker_id for s in probe.stubs), listing
    assert all(w["state"] == "expired" for w in listing if w["id"] not in ready), listing


def test_the_agent_acts_on_no_fake_and_kills_nothing(probe: Probe) -> None:
    assert probe.gateway.poll() is None, "the gateway was killed"
    assert httpx.get(probe.url + "/health").status_code == 200
    assert probe.agent.poll() is None, probe.logs["agent"].read_text()[-2000:]
    decisions = probe.audit_log.read_text() if probe.audit_log.exists() else ""
    for fake in probe.fakes:
        assert fake.worker_id not in decisions, decisions
    # The real workers answered their health reports all along: nothing decided on them.
    assert decisions == "", decisions


def test_each_fake_is_logged_once_by_each_reader(probe: Probe) -> None:
    for name in ("gateway", "agent"):
        text = probe.logs[name].read_text()
        for fake in probe.fakes:
            lines = [line for line in text.splitlines()
                     if "ignoring the registry entry" in line and repr(fake.worker_id) in line]
            assert len(lines) == 1, (name, fake.worker_id, lines)
