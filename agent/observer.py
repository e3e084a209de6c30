"""What the agent sees of each worker at one tick: the registry says which workers there
are (and each one's lease), and each worker tells how it is doing, turned into
`WorkerSample`s for the detection rules.

Per tick, for every registered worker: one registry read for all (with each lease's time
left), then one HealthRequest per live worker over its channel (rpc/: the one way the
agent reaches a worker) under `control_timeout_s` (a frozen or hung worker misses it:
`control_ok` False); its HealthReport (protocol/agent_messages.py) is the one source of
the worker's health: its load, steps, requests and failures. For a worker on this host
(its control URL is a loopback address), whether its process still exists (/proc: not a
zombie, and its command line names its worker id, so a reused pid is not mistaken for it).

Step time is the mean over the decode-only steps since the previous report of the same
epoch (a step that also prefilled takes longer for its prompt, not because the worker is
slow), with the mean batch and context of those steps (so the "slow" rule can ask what the
peers' fitted step models predict for the same shape); None when no such step ran since
(an idle worker is compared through its fitted model only). A worker that never decodes
(a prefill worker) has no step time and so is never "slow".
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from agent.expert_watch import ExpertSwitches, expert_switches
from agent.health_rules import WorkerSample
from protocol.agent_messages import HealthReport, HealthRequest
from protocol.messages import WorkerInfo
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.errors import ControlError
from state.redis_state import RedisState, Registry


def is_local(info: WorkerInfo) -> bool:
    """Does the worker run on this host (its control API is on a loopback address)?"""
    host = urlsplit(info.control_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def process_alive(pid: int, worker_id: str, proc: Path = Path("/proc")) -> bool:
    """Is `pid` a live (not zombie) process whose command line names `worker_id`?"""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        cmdline = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rpartition(")")[2].split()[0]
    return state not in ("Z", "X") and worker_id.encode() in cmdline.split(b"\0")


@dataclass(frozen=True, slots=True)
class Lapsed:
    """A registered worker whose lease lapsed (not purged yet): its registry entry, and so
    its role, is gone; what is known of its epoch is that of its last scrape."""

    at_s: float
    worker_id: str
    epoch: int | None  # None: no scrape of it ever answered

    def sample(self, last: WorkerSample | None) -> WorkerSample | None:
        """It as a sample (no lease, not answering), given the newest sample the agent holds
        of it: of its last scrape's epoch, role unknown; without a scrape, of `last`'s epoch
        and role; None when neither is known (no epoch to act on)."""
        if self.epoch is not None:
            epoch, role = self.epoch, None
        elif last is not None:
            epoch, role = last.epoch, last.role
        else:
            return None
        return WorkerSample(at_s=self.at_s, worker_id=self.worker_id, epoch=epoch, role=role,
                            lease_left_s=None, process_alive=None, control_ok=False)


@dataclass(frozen=True, slots=True)
class DecodeSteps:
    """The mean decode-only step since the last scrape: its time (the device's, or the
    wall time per step where that is longer: a host that feeds its GPU late is as slow for
    its requests as a slow GPU) and its shape."""

    step_s: float
    seqs: float
    context_tokens: float


@dataclass(slots=True)
class _StepMemory:
    """The last report of a worker's epoch: what the next one's deltas start from."""

    epoch: int
    report: HealthReport


class Observer:
    def __init__(self, state: RedisState, channels: ChannelPool,
                 control_timeout_s: float = 1.0) -> None:
        self.state = state
        self.channels = channels
        self.control_timeout_s = control_timeout_s
        self.registry = Registry(registered_ids=[], workers={}, loads={})
        self._memory: dict[str, _StepMemory] = {}
        self.reports: dict[str, HealthReport] = {}  # the answers of the last tick
        self.expert_switches: list[ExpertSwitches] = []  # seen in the last tick

    async def observe(self) -> list[WorkerSample | Lapsed]:
        """One sample per registered worker, a `Lapsed` for one whose lease lapsed (raises
        what the registry read raises)."""
        self.registry = registry = await self.state.read_registry(with_leases=True)
        self.expert_switches = []
        now = time.monotonic()
        infos = list(registry.workers.values())
        reports = await asyncio.gather(*(self._ask(info) for info in infos))
        self.reports = {info.worker_id: report for info, report in zip(infos, reports)
                        if report is not None}
        samples: list[WorkerSample | Lapsed] = [
            self._sample(info, report, registry, now) for info, report in zip(infos, reports)]
        gone = set(registry.registered_ids) - set(registry.workers)
        for worker_id in sorted(gone):  # lease lapsed, not purged yet
            memory = self._memory.get(worker_id)
            samples.append(Lapsed(now, worker_id, memory.epoch if memory else None))
        for worker_id in set(self._memory) - set(registry.registered_ids):
            del self._memory[worker_id]
        return samples

    async def _ask(self, info: WorkerInfo) -> HealthReport | None:
        client = ControlClient(info.control_url, self.channels)
        try:
            return await client.call(HealthRequest(), HealthReport, self.control_timeout_s)
        except ControlError:
            return None

    def _sample(self, info: WorkerInfo, report: HealthReport | None, registry: Registry,
                now: float) -> WorkerSample:
        lease_ms = registry.lease_left_ms.get(info.worker_id)
        alive = process_alive(info.pid, info.worker_id) if info.pid and is_local(info) else None
        memory = self._memory.get(info.worker_id)
        # A worker that did not answer is what its last answer of this epoch said.
        known = report or (memory.report if memory and memory.epoch == info.epoch else None)
        load = known.load if known is not None else None
        steps = self._steps(info, report)
        return WorkerSample(
            at_s=now, worker_id=info.worker_id, epoch=info.epoch, role=info.role,
            lease_left_s=None if not lease_ms else lease_ms / 1000, process_alive=alive,
            control_ok=report is not None,
            num_steps=known.num_steps if known else 0,
            num_running=load.num_running if load else 0,
            num_waiting=load.num_waiting if load else 0,
            num_kv_blocks_used=load.num_kv_blocks_used if load else 0,
            step_time_s=steps.step_s if steps else None,
            step_shape=(steps.seqs, steps.context_tokens) if steps else None,
            step_model=load.step_model if load else None,
            num_requests=known.num_requests if known else 0,
            num_failed=known.num_failed if known else 0)

    def _steps(self, info: WorkerInfo, report: HealthReport | None) -> DecodeSteps | None:
        memory = self._memory.get(info.worker_id)
        if memory is not None and memory.epoch != info.epoch:
            memory = None  # a new incarnation starts clean
        if report is None:
            return None
        steps = decode_steps(memory.report, report) if memory is not None else None
        switched = expert_switches(info.worker_id, info.epoch,
                                   memory.report.load if memory is not None else None,
                                   report.load)
        if switched is not None:
            self.expert_switches.append(switched)
        self._memory[info.worker_id] = _StepMemory(info.epoch, report)
        return steps


def decode_steps(then: HealthReport, now: HealthReport) -> DecodeSteps | None:
    """The mean decode-only step between two reports of one epoch (None: no step ran)."""
    num_steps = now.num_decode_steps - then.num_decode_steps
    if num_steps <= 0:
        return None
    step_s = (now.decode_sum_s - then.decode_sum_s) / num_steps
    num_walls = now.num_decode_walls - then.num_decode_walls
    if num_walls > 0:  # what a request waits per token: the slower of the two
        step_s = max(step_s, (now.decode_wall_sum_s - then.decode_wall_sum_s) / num_walls)
    return DecodeSteps(step_s, (now.decode_seqs - then.decode_seqs) / num_steps,
                       (now.decode_context - then.decode_context) / num_steps)
