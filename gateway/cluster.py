"""The gateway's view of the cluster: registry + load polling, the prefix-index mirror, purges.

Discovery is only through Redis (common/contract/redis_state.py). One owned task polls the live
workers and their loads every `poll_period_s` and rebuilds the routing snapshot; the
prefix-index mirror (common/contract/prefix_index_mirror.py) follows the index stream in its own
task. Every `purge_period_s` the poller also purges workers whose lease lapsed (a crashed
worker never deregisters), so their prefix entries stop attracting routes.

Lifecycle: created (empty, not ready) → start(): first poll + mirror snapshot within a
deadline, or keep trying in the background when Redis is not up yet → polling ... →
stop() cancels and awaits both tasks, each within a deadline.

When Redis is unreachable the last snapshot stays in use; routing decisions made since the
last poll are applied to it (`router.with_assignment`) so a burst between two polls does
not all land on one worker.

Invariants: every worker in `snapshot()` is live (lease held at the last poll), not
draining, and has a `WorkerInfo` in `workers`; `prefix_index` of a planning snapshot
lists only holders at their live epoch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from common.contract.prefix_index_mirror import PrefixIndexMirror
from common.contract.protocol import LoadReport, WorkerInfo, WorkerLoad
from common.contract.redis_state import REDIS_FAILURES, RedisState, raise_if_cancelling, stop_task
from gateway.router import (ClusterSnapshot, NoWorkers, RoutePlan, RouteRequest, WorkerView,
                            plan_route, with_assignment)

log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16  # only used while no worker has told its block size


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One registered worker as /admin/workers shows it."""

    info: WorkerInfo | None  # None: registered, lease lapsed, not yet purged
    worker_id: str
    load: LoadReport | None


class ClusterView:
    def __init__(self, state: RedisState, mirror: PrefixIndexMirror, rng: random.Random,
                 poll_period_s: float = 0.25, purge_period_s: float = 5.0) -> None:
        self.state = state
        self.mirror = mirror
        self.rng = rng
        self.poll_period_s = poll_period_s
        self.purge_period_s = purge_period_s
        self.workers: dict[str, WorkerInfo] = {}
        self.loads: dict[str, LoadReport] = {}
        self.registered_ids: list[str] = []
        self.redis_connected = False
        self.num_poll_errors = 0
        self.last_poll_monotonic: float | None = None
        self._snapshot = ClusterSnapshot(workers=(), prefix_index={}, block_size=DEFAULT_BLOCK_SIZE)
        self._live_epochs: dict[str, int] = {}
        self._last_purge = 0.0
        self._task: asyncio.Task[None] | None = None
        self._mirror_started = False

    # ---------------------------------------------------------------- queries

    @property
    def block_size(self) -> int:
        return self._snapshot.block_size

    def num_decode_workers(self) -> int:
        return sum(1 for w in self._snapshot.workers if w.role.decodes)

    def entries(self) -> list[WorkerEntry]:
        ids = sorted(set(self.registered_ids) | set(self.workers))
        return [WorkerEntry(self.workers.get(w), w, self.loads.get(w)) for w in ids]

    def plan(self, prompt_len: int, block_hashes: Sequence[int],
             local_prefill: bool) -> RoutePlan | NoWorkers:
        """Plan one request on the current snapshot and count it there until the next poll."""
        holders = self.mirror.index.holders
        live = self._live_epochs
        # Only the request's own hashes are looked up: a snapshot of the whole index per
        # request would cost O(index) instead of O(prompt blocks).
        prefix_index = {}
        for h in block_hashes:
            row = holders.get(h)
            if not row:
                break  # chained hashes: nothing after a miss can be a usable prefix
            prefix_index[h] = frozenset(w for w, e in row.items() if live.get(w) == e)
        snapshot = self._snapshot
        request = RouteRequest(prompt_len=prompt_len, block_hashes=block_hashes,
                               local_prefill=local_prefill)
        plan = plan_route(request, ClusterSnapshot(snapshot.workers, prefix_index,
                                                   snapshot.block_size), self.rng)
        if isinstance(plan, RoutePlan):
            self._snapshot = with_assignment(snapshot, plan)
        return plan

    # ---------------------------------------------------------------- lifecycle

    async def start(self, timeout_s: float = 5.0) -> None:
        if self._task is not None:
            raise RuntimeError("cluster view already started")
        try:
            async with asyncio.timeout(timeout_s):
                await self.poll()
                await self.mirror.start(timeout_s)
                self._mirror_started = True
        except (*REDIS_FAILURES,) as exc:
            raise_if_cancelling(exc)
            log.warning("redis not reachable at start (%s); retrying in the background", exc)
        self._task = asyncio.create_task(self._run(), name="cluster-view")

    async def stop(self) -> None:
        task, self._task = self._task, None
        # Bounded: a cancel swallowed inside a redis-py read must not hang the shutdown.
        if task is not None and not await stop_task(task, self.state.client, timeout_s=2.0):
            log.error("cluster view task did not stop within its deadline")
        if self._mirror_started:
            await self.mirror.stop()
            self._mirror_started = False

    async def poll(self) -> None:
        """Read the registry and loads once and rebuild the snapshot."""
        registry = await self.state.read_registry()
        workers, loads = registry.workers, registry.loads
        self.workers, self.loads, self.registered_ids = workers, loads, registry.registered_ids
        self._live_epochs = {w.worker_id: w.epoch for w in workers.values()}
        self._snapshot = build_snapshot(workers, loads)
        self.redis_connected = True
        self.last_poll_monotonic = time.monotonic()

    async def purge_expired(self) -> list[str]:
        """Purge every registered worker without a live lease; returns the ids purged."""
        purged = []
        for worker_id in set(self.registered_ids) - set(self.workers):
            if await self.state.purge_expired_worker(worker_id):
                log.info("purged worker %s: its lease expired", worker_id)
                purged.append(worker_id)
        return purged

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_period_s)
            try:
                if not self._mirror_started:
                    await self.mirror.start()
                    self._mirror_started = True
                await self.poll()
                now = time.monotonic()
                if now - self._last_purge >= self.purge_period_s:
                    self._last_purge = now
                    await self.purge_expired()
            except REDIS_FAILURES as exc:
                raise_if_cancelling(exc)
                if self.redis_connected:
                    log.warning("redis unreachable (%s): routing on the last snapshot", exc)
                self.redis_connected = False
                self.num_poll_errors += 1

    def check_invariants(self) -> None:
        for view in self._snapshot.workers:
            info = self.workers.get(view.worker_id)
            if info is None or info.draining:
                raise AssertionError(f"{view.worker_id} routable but not live or draining")


def build_snapshot(workers: dict[str, WorkerInfo],
                   loads: dict[str, LoadReport]) -> ClusterSnapshot:
    """The routable workers (live, not draining) with their last load; pure."""
    views = []
    block_sizes = set()
    for worker_id in sorted(workers):
        info = workers[worker_id]
        if info.draining:
            continue
        report = loads.get(worker_id)
        load = report.load if report is not None else WorkerLoad()
        if load.num_kv_blocks_total == 0:  # not reported yet: the pool it registered
            load = msgspec.structs.replace(load, num_kv_blocks_total=info.num_kv_blocks)
        views.append(WorkerView(worker_id=worker_id, role=info.role, load=load))
        block_sizes.add(info.block_size)
    if len(block_sizes) > 1:
        log.warning("workers disagree on block size %s: prefix routing uses the smallest",
                    sorted(block_sizes))
    return ClusterSnapshot(workers=tuple(views), prefix_index={},
                           block_size=min(block_sizes, default=DEFAULT_BLOCK_SIZE))

