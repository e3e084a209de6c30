"""The agent's control loop against a real Redis server and stub workers: real publishers
(leases, epochs, loads), real control servers answering HealthRequest, ReclaimRequest and
RoleChangeRequest over their channels, and a real process per worker, started by a real
supervisor (launcher/supervisor.py) that the local restarter asks, over its restart line,
to kill it. The ticks are driven by the test, so every step of a recovery is checked."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from agent.actuator import Actuator
from agent.audit import Audit
from agent.control_loop import AgentConfig, ControlLoop
from agent.health_rules import Thresholds
from agent.observer import Observer
from agent.rebalance import RebalanceConfig
from agent.restarters import SupervisorRestarter
from launcher.restart_line import RestartLine
from launcher.supervisor import Child, Supervisor
from protocol.agent_messages import HealthReport, HealthRequest, ReclaimRequest, ReclaimResponse
from protocol.messages import Message, Role, RoleChangeRequest, RoleChangeResponse, WorkerInfo
from protocol.worker_load import StepModel, WorkerLoad
from rpc.channel_client import ChannelPool
from rpc.control_server import ControlServer, add_call, make_app
from state.agent_state import AgentState
from state.redis_state import RedisState, connect
from telemetry.metrics import MetricsRegistry
from worker.publisher import WorkerPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

THRESHOLDS = Thresholds(lease_margin_s=0.6, hung_after_s=1.0, leak_after_s=1.0,
                        error_min_requests=4, slow_for_s=1.0, slow_min_steps=5)


@dataclass
class Supervision:
    """A supervisor of the workers' processes and its restart line, answered every 50 ms as
    `pdserve up` answers it every tick."""

    supervisor: Supervisor
    line: RestartLine = field(default_factory=RestartLine)
    workers_by_id: dict[str, Child] = field(default_factory=dict)

    def restarter(self) -> SupervisorRestarter:
        """The agent's end, as `pdserve agent --supervisor-fd` makes it."""
        return SupervisorRestarter(socket.socket(fileno=os.dup(self.line.agent_fd)))

    async def answer_forever(self) -> None:
        while True:
            self.line.answer(self.supervisor, self.workers_by_id, allow=True)
            await asyncio.sleep(0.05)


@dataclass
class StubWorker:
    """One worker as the agent sees it: a registry entry, a control API, a process."""

    worker_id: str
    role: Role
    step_s: float = 0.02  # what its decode steps take, as its health reports tell
    num_errors_per_scrape: int = 0
    answering: bool = True
    stepping: bool = True  # False: gets no traffic (its reports count no new step)
    load: WorkerLoad = field(default_factory=lambda: WorkerLoad(num_kv_blocks_total=64))
    num_reclaims: int = 0
    num_health_asks: int = 0  # HealthRequests received, answered or not
    role_changes: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    supervision: Supervision | None = None
    publisher: WorkerPublisher | None = None
    server: ControlServer | None = None
    _steps: int = 0
    _step_sum: float = 0.0
    _requests: int = 0
    _errors: int = 0

    async def health(self, request: HealthRequest) -> Message:
        self.num_health_asks += 1
        if not self.answering:
            await asyncio.sleep(5)  # frozen: past the agent's deadline
        if self.stepping:
            self._steps += 5
            self._step_sum += 5 * self.step_s
            self._requests += 5
        self._errors += self.num_errors_per_scrape
        assert self.publisher is not None
        return HealthReport(epoch=self.publisher.epoch, load=self.load, num_steps=self._steps,
                            step_sum_s=self._step_sum, num_decode_steps=self._steps,
                            decode_sum_s=self._step_sum, decode_seqs=0, decode_context=0,
                            num_requests=self._requests + self._errors,
                            num_failed=self._errors)

    async def reclaim(self, request: ReclaimRequest) -> Message:
        self.num_reclaims += 1
        self.load = msgspec.structs.replace(self.load, num_kv_blocks_used=0)
        return ReclaimResponse(num_reclaimed=1, request_ids=["leaked"])

    async def change_role(self, request: RoleChangeRequest) -> Message:
        self.role_changes.append(request.role.value)
        assert self.publisher is not None
        return RoleChangeResponse(role=request.role, epoch=self.publisher.epoch + 1)


@pytest.fixture
async def cluster(redis_url: str, tmp_path: Path
                  ) -> AsyncIterator[tuple[RedisState, list[StubWorker], SupervisorRestarter]]:
    state = RedisState(connect(redis_url), namespace=f"t{uuid.uuid4().hex[:8]}")
    supervision = Supervision(Supervisor(tmp_path))
    workers = [StubWorker("prefill-0", Role.PREFILL), StubWorker("decode-0", Role.DECODE),
               StubWorker("decode-1", Role.DECODE), StubWorker("decode-2", Role.DECODE)]
    for worker in workers:
        worker.supervision = supervision
        await start(state, worker)
    answering = asyncio.create_task(supervision.answer_forever())
    restarter = supervision.restarter()
    yield state, workers, restarter
    answering.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await answering
    for worker in workers:
        await stop(worker)
    supervision.supervisor.stop_all(5.0)
    restarter.line.close()
    supervision.line.close()
    await state.aclose()


async def start(state: RedisState, worker: StubWorker) -> None:
    """Start (or restart) the worker: a new process (by its supervisor) and a new epoch."""
    assert worker.supervision is not None
    supervision = worker.supervision
    child = supervision.workers_by_id.get(worker.worker_id)
    if child is None:
        child = supervision.workers_by_id[worker.worker_id] = supervision.supervisor.start(
            worker.worker_id, [sys.executable, "-c", "import time; time.sleep(120)",
                               "--worker-id", worker.worker_id])
    else:
        supervision.supervisor.restart(child)
    worker.process = child.process
    if worker.server is None:
        app = make_app(None)
        add_call(app, HealthRequest, worker.health)
        add_call(app, ReclaimRequest, worker.reclaim)
        add_call(app, RoleChangeRequest, worker.change_role)
        worker.server = ControlServer(app)
        url = await worker.server.start()
    else:
        url = worker.publisher.info.control_url  # type: ignore[union-attr]
    info = WorkerInfo(worker_id=worker.worker_id, role=worker.role, model="tiny",
                      control_url=url, num_kv_blocks=64, block_size=16, pid=worker.process.pid)
    worker.publisher = WorkerPublisher(state, info, lambda: worker.load, period_s=0.1,
                                       lease_ttl_s=1.0)
    await worker.publisher.start()


async def stop(worker: StubWorker) -> None:
    if worker.publisher is not None:
        await worker.publisher.stop()
    if worker.process is not None and worker.process.poll() is None:
        worker.process.kill()
        worker.process.wait()
    if worker.server is not None:
        await worker.server.stop()


@pytest.fixture
async def channels() -> AsyncIterator[ChannelPool]:
    """How the agent reaches the workers: one channel each."""
    pool = ChannelPool(None)
    yield pool
    await pool.aclose()


def make_loop(state: RedisState, restarter: SupervisorRestarter, channels: ChannelPool,
              **config) -> ControlLoop:
    agent_state = AgentState(state)
    metrics = MetricsRegistry()
    defaults = dict(period_s=0.2, window_s=5.0, thresholds=THRESHOLDS, cooldown_s=1.0,
                    probation_s=1.0, rebalance=None)
    return ControlLoop(Observer(state, channels, control_timeout_s=0.3),
                       Actuator(agent_state, restarter, channels),
                       Audit(agent_state, metrics), AgentConfig(**{**defaults, **config}),
                       metrics)


# run_until's deadlines are how long a rule may take on an idle machine; a loaded CI host
# (the stub workers answer within the agent's 0.3 s control timeout or count as silent)
# gets this many times as long. Waiting longer cannot make a test pass that should fail:
# each one waits for an action to happen, never for one not to.
DEADLINE_SLACK = 3


async def run_until(loop: ControlLoop, predicate, timeout_s: float) -> list:
    """Tick every 0.2 s until predicate(events so far) holds; returns the events."""
    seen: list = []
    async with asyncio.timeout(timeout_s * DEADLINE_SLACK):
        while True:
            await loop.tick()
            loop.check_invariants()
            seen = await loop.actuator.agent_state.recent_events(1000)
            if predicate(list(reversed(seen))):
                return list(reversed(seen))
            await asyncio.sleep(0.2)


def acted(events: list, worker_id: str, action: str) -> list:
    return [e for e in events if e.worker_id == worker_id and e.action == action]


async def test_a_frozen_worker_is_ejected_killed_and_its_new_epoch_readmitted(
        cluster, channels) -> None:
    state, workers, restarter = cluster
    frozen = workers[1]
    loop = make_loop(state, restarter, channels)
    await loop.tick()
    assert await loop.actuator.agent_state.read_ejected() == {}
    old_epoch = frozen.publisher.epoch
    frozen.answering = False
    await frozen.publisher.stop(deregister=False)  # heartbeats stop; the lease runs down
    events = await run_until(loop, lambda ev: acted(ev, frozen.worker_id, "eject+restart"), 5)
    found = acted(events, frozen.worker_id, "eject+restart")[0]
    assert found.epoch == old_epoch and found.rule in ("dead", "hung")
    assert "killed pid" in found.outcome
    assert frozen.process.wait(5) is not None  # the local restarter's SIGKILL
    ejected = await loop.actuator.agent_state.read_ejected()
    assert ejected[frozen.worker_id].epoch == old_epoch
    for _ in range(8):  # its lease lapses meanwhile (it stays registered, unpurged)
        await loop.tick()
        await asyncio.sleep(0.2)
    assert frozen.worker_id not in loop.observer.registry.workers
    assert frozen.worker_id in loop.observer.registry.registered_ids
    # Its supervisor starts it again: a new process, a new epoch, on probation first.
    frozen.answering = True
    await start(state, frozen)
    events = await run_until(loop, lambda ev: acted(ev, frozen.worker_id, "recovered"), 5)
    assert acted(events, frozen.worker_id, "recovered")[0].epoch == frozen.publisher.epoch
    assert (await loop.actuator.agent_state.read_ejected())[frozen.worker_id].rule == \
        "probation"
    events = await run_until(loop, lambda ev: acted(ev, frozen.worker_id, "readmit"), 8)
    assert await loop.actuator.agent_state.read_ejected() == {}
    # Nobody else was touched.
    assert {e.worker_id for e in events} == {frozen.worker_id}


async def test_a_slow_worker_is_ejected_readmitted_then_restarted(cluster, channels) -> None:
    state, workers, restarter = cluster
    slow = workers[2]
    slow.step_s = 0.3  # 15x its peers' decode steps
    loop = make_loop(state, restarter, channels)
    events = await run_until(loop, lambda ev: acted(ev, slow.worker_id, "eject"), 5)
    assert acted(events, slow.worker_id, "eject")[0].rule == "slow"
    # On probation for 1 s, then back in; still slow: the second strike drains it (it runs
    # nothing here, so at once) and restarts it.
    events = await run_until(loop, lambda ev: acted(ev, slow.worker_id, "restart"), 10)
    assert acted(events, slow.worker_id, "readmit")
    assert "draining before its restart" in acted(events, slow.worker_id,
                                                  "eject+restart")[0].outcome
    assert acted(events, slow.worker_id, "restart")[0].evidence.startswith("drained; ")
    assert slow.process.wait(5) is not None
    assert {e.worker_id for e in events if e.action.startswith("eject")} == {slow.worker_id}
    assert loop.audit.decisions.value(rule="slow", action="eject", outcome="done") == 1


async def test_a_slow_worker_its_own_model_still_calls_slow_is_restarted_not_readmitted(
        cluster, channels) -> None:
    # The router sends nothing to a worker whose fitted model predicts slow steps, so once
    # ejected it runs no step that could clear it: its model decides at the probation's end.
    state, workers, restarter = cluster
    slow = workers[2]
    for worker in workers[1:]:
        worker.step_s = 0.3 if worker is slow else 0.02
        worker.load = WorkerLoad(num_kv_blocks_total=64, step_model=StepModel(
            base_s=worker.step_s, prefill_token_s=0.0, decode_seq_s=0.0, context_token_s=0.0,
            num_samples=64, num_decode_samples=64))
    loop = make_loop(state, restarter, channels)
    events = await run_until(loop, lambda ev: acted(ev, slow.worker_id, "eject"), 5)
    slow.stepping = False
    events = await run_until(loop, lambda ev: acted(ev, slow.worker_id, "restart"), 10)
    assert not acted(events, slow.worker_id, "readmit")
    restarted = acted(events, slow.worker_id, "eject+restart")[0]
    assert restarted.evidence.startswith("still slow by its own step model: 300.0 ms vs 20.0")
    assert slow.process.wait(5) is not None


async def test_never_more_than_the_fraction_of_a_pool_at_once(cluster, channels) -> None:
    state, workers, restarter = cluster
    for worker in workers[1:]:  # every decode worker fails every request
        worker.num_errors_per_scrape = 5
    loop = make_loop(state, restarter, channels, max_eject_fraction=0.5)
    events = await run_until(loop, lambda ev: any(e.action == "hold" for e in ev), 5)
    ejected = {e.worker_id for e in events if e.action == "eject"}
    assert len(ejected) == 1  # of 3 decode workers, at most int(3 * 0.5) = 1 out
    held = [e for e in events if e.action == "hold"]
    assert held and all("out already" in e.outcome for e in held)
    assert len(await loop.actuator.agent_state.read_ejected()) == 1


async def test_a_leak_is_reclaimed_without_ejecting(cluster, channels) -> None:
    state, workers, restarter = cluster
    leaky = workers[3]
    leaky.load = WorkerLoad(num_kv_blocks_used=7, num_kv_blocks_total=64)
    loop = make_loop(state, restarter, channels)
    events = await run_until(loop, lambda ev: acted(ev, leaky.worker_id, "reclaim"), 5)
    assert acted(events, leaky.worker_id, "reclaim")[0].outcome == \
        "done: 1 reservation(s) freed"
    assert leaky.num_reclaims == 1
    assert await loop.actuator.agent_state.read_ejected() == {}


async def test_a_dry_run_decides_but_touches_nothing(cluster, channels) -> None:
    state, workers, restarter = cluster
    workers[1].answering = False
    await workers[1].publisher.stop(deregister=False)
    loop = make_loop(state, restarter, channels, dry_run=True)
    events = await run_until(loop, lambda ev: acted(ev, workers[1].worker_id,
                                                    "eject+restart"), 5)
    assert acted(events, workers[1].worker_id, "eject+restart")[0].outcome == "dry_run"
    assert workers[1].process.poll() is None  # not killed
    assert await loop.actuator.agent_state.read_ejected() == {}


async def test_only_the_leader_acts(cluster, channels) -> None:
    state, workers, restarter = cluster
    first, second = make_loop(state, restarter, channels), make_loop(state, restarter, channels)
    await first.tick()
    await second.tick()
    assert first.is_leader and not second.is_leader
    workers[3].load = WorkerLoad(num_kv_blocks_used=7, num_kv_blocks_total=64)
    for _ in range(10):
        await second.tick()
        await asyncio.sleep(0.2)
    assert workers[3].num_reclaims == 0  # the standby saw the leak and did nothing
    await run_until(first, lambda ev: acted(ev, workers[3].worker_id, "reclaim"), 5)
    assert workers[3].num_reclaims == 1


async def test_once_prints_what_it_would_do_and_does_nothing(cluster, channels,
                                                             redis_url: str) -> None:
    state, workers, restarter = cluster
    workers[3].load = WorkerLoad(num_kv_blocks_used=7, num_kv_blocks_total=64)
    workers[1].answering = False
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "launcher.cli", "agent", "--once",
        "--namespace", state.ns, "--period-s", "0.5", "--hung-after-s", "2",
        "--leak-after-s", "1", "--control-timeout-s", "0.3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PDSERVE_REDIS_URL": redis_url})  # it holds the password
    # It dies once the agent has seen it registered (an agent acts only on workers it saw
    # under a bound entry), however long the agent took to start.
    async with asyncio.timeout(30):
        while workers[1].num_health_asks == 0:
            await asyncio.sleep(0.05)
    await workers[1].publisher.stop(deregister=False)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    decided = [msgspec.json.decode(line) for line in out.splitlines()]
    assert {(d["worker_id"], d["action"], d["outcome"]) for d in decided} >= {
        ("decode-0", "eject+restart", "dry_run"), ("decode-2", "reclaim", "dry_run")}
    assert "nothing was done (--once)" in err.decode()
    assert workers[3].num_reclaims == 0 and workers[1].process.poll() is None
    assert await AgentState(state).read_ejected() == {}


async def test_a_prefill_queue_moves_the_least_loaded_decode_worker(cluster, channels) -> None:
    state, workers, restarter = cluster
    # 10 s of prompt tokens queued on the prefill worker; the decode pool idle.
    workers[0].load = WorkerLoad(num_queued_prefill_tokens=10_000, prefill_tokens_per_s=1000,
                                 num_kv_blocks_total=64)
    workers[1].load = WorkerLoad(num_running=2, num_kv_blocks_total=64)
    loop = make_loop(state, restarter, channels, rebalance=RebalanceConfig(sustain_s=0.6, cooldown_s=30),
                     rebalance_period_s=0.2)
    events = await run_until(loop, lambda ev: any(e.rule == "rebalance" and
                                                  e.outcome.startswith("done") for e in ev), 5)
    moves = [e for e in events if e.rule == "rebalance"]
    assert [(e.worker_id, e.action) for e in moves] == [("decode-1", "decode->prefill")] * 2
    assert moves[0].outcome == "started" and "prefill queue delay 10.0 s" in moves[0].evidence
    assert workers[2].role_changes == ["prefill"] and workers[1].role_changes == []
    for _ in range(5):  # the cooldown: one move, however long the queue stays
        await loop.tick()
        await asyncio.sleep(0.2)
    assert sum(len(w.role_changes) for w in workers) == 1
    await loop.stop()


async def test_a_busy_slow_worker_is_restarted_when_its_drain_time_is_up(cluster,
                                                                         channels) -> None:
    state, workers, restarter = cluster
    slow = workers[2]
    slow.step_s = 0.3
    slow.load = WorkerLoad(num_running=1, num_kv_blocks_total=64)  # never finishes
    loop = make_loop(state, restarter, channels, role_drain_timeout_s=1.5)
    events = await run_until(loop, lambda ev: acted(ev, slow.worker_id, "eject+restart"), 10)
    drain_started = acted(events, slow.worker_id, "eject+restart")[0].at_unix_ms
    assert slow.process.poll() is None  # still running what it has
    events = await run_until(loop, lambda ev: acted(ev, slow.worker_id, "restart"), 5)
    restarted = acted(events, slow.worker_id, "restart")[0]
    assert restarted.evidence.startswith("drain cut after")
    # The drain starts at its tick's clock; the eject event is stamped after the eject's
    # Redis and HTTP calls, which a loaded host can stretch to tens of milliseconds.
    assert restarted.at_unix_ms - drain_started >= 1500 - 100
    assert slow.process.wait(5) is not None
