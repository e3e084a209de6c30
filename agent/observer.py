"""What the agent sees of each worker at one tick: the registry (lease, load) and the
worker's own /metrics, turned into `WorkerSample`s for the detection rules.

Per tick, for every registered worker: one registry read for all (with each lease's time
left), then one GET /metrics per live worker under `control_timeout_s` (a frozen or hung
worker misses it: `control_ok` False), and, for a worker on this host (its control URL is
a loopback address), whether its process still exists (/proc: not a zombie, and its
command line names its worker id, so a reused pid is not mistaken for it).

Step time is the mean over the decode-only steps since the previous scrape of the same
epoch (the `pdserve_decode_step_seconds` histogram's sum and count: a step that also
prefilled takes longer for its prompt, not because the worker is slow), with the mean
batch and context of those steps (so the "slow" rule can ask what the peers' fitted step
models predict for the same shape); None when no such step ran since (an idle worker is
compared through its fitted model only). A worker that never decodes (a prefill worker)
has no step time and so is never "slow".
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from agent.health_rules import WorkerSample
from protocol.messages import WorkerInfo
from state.redis_state import RedisState, Registry
from telemetry.metrics import parse_samples

MAX_METRICS_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Scrape:
    """The few series of a worker's /metrics the rules read."""

    step_sum_s: float
    num_steps: int
    decode_sum_s: float  # steps that only decoded (the "slow" rule compares these)
    num_decode_steps: int
    decode_seqs: float  # their sequences and context tokens, summed
    decode_context: float
    num_requests: int
    num_failed: int


def parse_scrape(text: str) -> Scrape:
    """Pure: the series out of a Prometheus exposition (absent ones read as 0)."""
    samples = parse_samples(text)
    num_requests = num_failed = 0
    for name, value in samples.items():
        if name.startswith("pdserve_requests_total{"):
            num_requests += int(value)
            if 'outcome="error"' in name:
                num_failed += int(value)
    return Scrape(step_sum_s=samples.get("pdserve_step_seconds_sum", 0.0),
                  num_steps=int(samples.get("pdserve_step_seconds_count", 0)),
                  decode_sum_s=samples.get("pdserve_decode_step_seconds_sum", 0.0),
                  num_decode_steps=int(samples.get("pdserve_decode_step_seconds_count", 0)),
                  decode_seqs=samples.get("pdserve_decode_step_seqs_total", 0.0),
                  decode_context=samples.get("pdserve_decode_step_context_tokens_total", 0.0),
                  num_requests=num_requests, num_failed=num_failed)


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
class DecodeSteps:
    """The mean decode-only step since the last scrape: its time and its shape."""

    step_s: float
    seqs: float
    context_tokens: float


@dataclass(slots=True)
class _StepMemory:
    """The last scrape of a worker's epoch: what the next one's deltas start from."""

    epoch: int
    scrape: Scrape


class Observer:
    def __init__(self, state: RedisState, session: aiohttp.ClientSession, token: str | None,
                 control_timeout_s: float = 1.0) -> None:
        self.state = state
        self.session = session
        self.token = token
        self.control_timeout_s = control_timeout_s
        self.registry = Registry(registered_ids=[], workers={}, loads={})
        self._memory: dict[str, _StepMemory] = {}

    async def observe(self) -> list[WorkerSample]:
        """One sample per registered worker (raises what the registry read raises)."""
        self.registry = registry = await self.state.read_registry(with_leases=True)
        now = time.monotonic()
        infos = list(registry.workers.values())
        scrapes = await asyncio.gather(*(self._scrape(info) for info in infos))
        samples = [self._sample(info, scrape, registry, now) for info, scrape in zip(infos, scrapes)]
        gone = set(registry.registered_ids) - set(registry.workers)
        for worker_id in sorted(gone):  # lease lapsed, not purged yet
            memory = self._memory.get(worker_id)
            samples.append(WorkerSample(at_s=now, worker_id=worker_id,
                                        epoch=memory.epoch if memory else 0, role="",
                                        lease_left_s=None, process_alive=None,
                                        control_ok=False))
        for worker_id in set(self._memory) - set(registry.registered_ids):
            del self._memory[worker_id]
        return samples

    async def _scrape(self, info: WorkerInfo) -> Scrape | None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            async with asyncio.timeout(self.control_timeout_s):
                async with self.session.get(info.control_url + "/metrics",
                                            headers=headers) as response:
                    if response.status != 200:
                        return None
                    body = await response.content.read(MAX_METRICS_BYTES)
            return parse_scrape(body.decode(errors="replace"))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None

    def _sample(self, info: WorkerInfo, scrape: Scrape | None, registry: Registry,
                now: float) -> WorkerSample:
        report = registry.loads.get(info.worker_id)
        load = report.load if report is not None else None
        lease_ms = registry.lease_left_ms.get(info.worker_id)
        alive = process_alive(info.pid, info.worker_id) if info.pid and is_local(info) else None
        memory = self._memory.get(info.worker_id)
        known = scrape or (memory.scrape if memory and memory.epoch == info.epoch else None)
        steps = self._steps(info, scrape)
        return WorkerSample(
            at_s=now, worker_id=info.worker_id, epoch=info.epoch, role=info.role.value,
            lease_left_s=None if not lease_ms else lease_ms / 1000, process_alive=alive,
            control_ok=scrape is not None,
            num_steps=known.num_steps if known else (load.num_steps if load else 0),
            num_running=load.num_running if load else 0,
            num_waiting=load.num_waiting if load else 0,
            num_kv_blocks_used=load.num_kv_blocks_used if load else 0,
            step_time_s=steps.step_s if steps else None,
            step_shape=(steps.seqs, steps.context_tokens) if steps else None,
            step_model=load.step_model if load else None,
            num_requests=known.num_requests if known else 0,
            num_failed=known.num_failed if known else 0)

    def _steps(self, info: WorkerInfo, scrape: Scrape | None) -> DecodeSteps | None:
        memory = self._memory.get(info.worker_id)
        if memory is not None and memory.epoch != info.epoch:
            memory = None  # a new incarnation starts clean
        if scrape is None:
            return None
        steps = None
        if memory is not None:
            then = memory.scrape
            num_steps = scrape.num_decode_steps - then.num_decode_steps
            if num_steps > 0:
                steps = DecodeSteps((scrape.decode_sum_s - then.decode_sum_s) / num_steps,
                                    (scrape.decode_seqs - then.decode_seqs) / num_steps,
                                    (scrape.decode_context - then.decode_context) / num_steps)
        self._memory[info.worker_id] = _StepMemory(info.epoch, scrape)
        return steps
