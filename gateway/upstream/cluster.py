"""The gateway's view of the cluster: registry + load polling, the prefix-index mirror, purges.

Discovery is only through Redis (state/redis_state.py). One owned task polls the live
workers and their loads every `poll_period_s` and rebuilds the routing snapshot; the
prefix-index mirror (state/prefix_index_mirror.py) follows the index stream in its own
task. Every `purge_period_s` the poller also purges workers whose lease lapsed at least
`purge_grace_s` ago (a crashed worker never deregisters), so their prefix entries stop
attracting routes. Routing stops at the lapse itself (a lapsed worker has no entry to route
by); the grace is for the operations agent, which must still find the lapsed entry to act on
it: a frozen worker's lease lapses, and purged at once it would vanish unrestarted.
(`purgeable`: pure.)

Lifecycle: created (empty, not ready) → start(): first poll + mirror snapshot within a
deadline, or keep trying in the background when Redis is not up yet → polling ... →
stop() cancels and awaits both tasks, each within a deadline.

Every plan sees each worker's queue as of the moment of routing: its last load report, and
the prompts this gateway routed to it and has not yet seen prefilled
(gateway/upstream/routed_prefills.py: a plan made with a `request_id` counts its prompt on
the worker that prefills it until `settle(request_id)`, which the backend calls at the
attempt's first token and at the generation's end).

When Redis is unreachable the last snapshot stays in use; routing decisions made since the
last poll are applied to it (`router.with_assignment`) so a burst between two polls does
not all land on one worker. When Redis comes back empty (restarted without its data) every
worker vanishes from one poll to the next: the last snapshot stays in use for up to
`vanish_grace_s`, while the workers re-register (they republish in full on reconnect).
They come back one by one, so for `vanish_grace_s` after Redis answered again (or was
found empty) a worker known before and not back yet is kept (`keep_vanished`): a request
planned on it goes on, and new ones spread as before, instead of all landing on the first
worker back. A worker kept that is really gone is found by the first call to it
(`mark_unreachable`) and ends with the window.

A worker a request could not reach is marked unreachable (`mark_unreachable`): routed
nothing until it registers with a new epoch or the mark lapses, without waiting for its
lease to expire; a worker that failed one request is excluded from that request's later
plans (`plan(..., exclude=...)`).

The operations agent's ejections (state/agent_state.py) are read with every
poll: an ejected worker (at its live epoch, entry not lapsed) is routed nothing new, and
its streams already running go on. When that read fails the last list stays in use.

Invariants: every worker in `snapshot()` is live (lease held at the last poll, or kept
through a recovery window), not draining, not ejected, and has a `WorkerInfo` in
`workers`; `prefix_index` of a planning snapshot lists only holders at their live epoch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from gateway.routing.plan_model import Targets
from gateway.routing.router import (ClusterSnapshot, NoWorkers, RoutePlan, RouteRequest, WorkerView,
                                    plan_route, with_assignment)
from gateway.upstream.routed_prefills import RoutedPrefills
from protocol.block_hashes import host_tier_hash
from protocol.messages import LoadReport, WorkerInfo
from protocol.worker_load import WorkerLoad
from state.agent_state import AgentState, Ejection, active_ejections, now_unix_ms
from state.prefix_index_mirror import PrefixIndexMirror
from state.redis_state import REDIS_FAILURES, RedisState, raise_if_cancelling, stop_task

log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16  # only used while no worker has told its block size


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One registered worker as /admin/workers shows it."""

    info: WorkerInfo | None  # None: registered, lease lapsed, not yet purged
    worker_id: str
    load: LoadReport | None
    ejection: Ejection | None = None  # set while the agent keeps it out of routing


class ClusterView:
    def __init__(self, state: RedisState, mirror: PrefixIndexMirror, rng: random.Random,
                 poll_period_s: float = 0.25, purge_period_s: float = 5.0,
                 vanish_grace_s: float = 8.0, agent_state: AgentState | None = None,
                 purge_grace_s: float = 10.0) -> None:
        """`agent_state`: where the operations agent's ejections are read (None: none)."""
        self.state = state
        self.agent_state = agent_state
        self.ejected: dict[str, Ejection] = {}  # as last read; filtered by active_ejections
        self.mirror = mirror
        self.rng = rng
        self.poll_period_s = poll_period_s
        self.purge_period_s = purge_period_s
        self.purge_grace_s = purge_grace_s
        self.vanish_grace_s = vanish_grace_s
        self._lapsed_since: dict[str, float] = {}  # registered, no lease: since (monotonic)
        self.workers: dict[str, WorkerInfo] = {}
        self.loads: dict[str, LoadReport] = {}
        self.routed = RoutedPrefills()  # prompts planned here whose first token is not in yet
        self.registered_ids: list[str] = []
        self.redis_connected = False
        self.num_poll_errors = 0
        self.last_poll_monotonic: float | None = None
        self._snapshot = ClusterSnapshot(workers=(), prefix_index={}, block_size=DEFAULT_BLOCK_SIZE)
        self._live_epochs: dict[str, int] = {}
        # Workers a request could not reach: (epoch, until monotonic); out of routing until
        # they register with another epoch or the mark lapses (a worker that was only cut off).
        self._unreachable: dict[str, tuple[int, float]] = {}
        self._last_seen_workers_at = 0.0  # monotonic time of the last poll that found workers
        # Until then (monotonic), workers not back in the registry are kept (keep_vanished).
        self._recovery_until = 0.0
        self._last_purge = 0.0
        self._task: asyncio.Task[None] | None = None
        self._mirror_started = False

    # ---------------------------------------------------------------- queries

    @property
    def block_size(self) -> int:
        return self._snapshot.block_size

    def num_registered(self) -> int:
        """Workers registered and not draining (each registers once its model is loaded)."""
        return sum(1 for info in self.workers.values() if not info.draining)

    def num_decode_workers(self) -> int:
        return sum(1 for w in self._routable({}) if w.role.decodes)

    def max_kv_tokens(self) -> int | None:
        """Tokens the largest KV pool among the routable decoding workers holds (what one
        request can grow to there); None while no such worker is known."""
        sizes = [self.workers[w.worker_id].num_kv_blocks * self.workers[w.worker_id].block_size
                 for w in self._routable({})
                 if w.role.decodes and w.worker_id in self.workers]
        return max(sizes, default=None)

    def mark_unreachable(self, worker_id: str, for_s: float = 5.0) -> bool:
        """A request could not reach `worker_id`: route nothing there for `for_s` seconds or
        until it registers again with a new epoch. True when it was not marked already."""
        info = self.workers.get(worker_id)
        if info is None:
            return False
        fresh = worker_id not in self._unreachable
        self._unreachable[worker_id] = (info.epoch, time.monotonic() + for_s)
        return fresh

    def _routable(self, exclude: Mapping[str, int]) -> tuple[WorkerView, ...]:
        workers = self._snapshot.workers
        if not exclude and not self._unreachable:
            return workers
        now = time.monotonic()
        return tuple(w for w in workers
                     if not self._excluded(w.worker_id, exclude)
                     and not self._is_unreachable(w.worker_id, now))

    def can_route(self, plan: RoutePlan) -> bool:
        """Whether `plan`'s workers are all still routable (registered, not marked
        unreachable): a plan made for another request, reused (gateway/api/shared_prefill.py)."""
        ids = {w.worker_id for w in self._routable({})}
        return plan.decode_worker_id in ids and plan.prefill_worker_id in (None, *ids)

    def _excluded(self, worker_id: str, exclude: Mapping[str, int]) -> bool:
        return worker_id in exclude and self._live_epochs.get(worker_id) == exclude[worker_id]

    def load_of(self, worker_id: str) -> WorkerLoad | None:
        """The worker's last published load (None: none seen)."""
        report = self.loads.get(worker_id)
        return None if report is None else report.load

    def epoch_of(self, worker_id: str) -> int | None:
        info = self.workers.get(worker_id)
        return None if info is None else info.epoch

    def _is_unreachable(self, worker_id: str, now: float) -> bool:
        mark = self._unreachable.get(worker_id)
        if mark is None:
            return False
        epoch, until = mark
        if now >= until or self._live_epochs.get(worker_id) != epoch:
            del self._unreachable[worker_id]  # lapsed, or restarted with a new epoch
            return False
        return True

    def entries(self) -> list[WorkerEntry]:
        ids = sorted(set(self.registered_ids) | set(self.workers))
        out = active_ejections(self.ejected, self._live_epochs, now_unix_ms())
        return [WorkerEntry(self.workers.get(w), w, self.loads.get(w),
                            self.ejected[w] if w in out else None) for w in ids]

    def plan(self, prompt_len: int, block_hashes: Sequence[int], local_prefill: bool | None,
             exclude: Mapping[str, int] | None = None, targets: Targets | None = None,
             request_id: str | None = None) -> RoutePlan | NoWorkers:
        """Plan one request on the current snapshot and count it there until the next poll;
        with a `request_id`, count its prompt on the worker that prefills it until
        `settle(request_id)` (a later plan of the same request replaces it).

        Workers in `exclude` (id -> the epoch in which they failed this request) and workers
        marked unreachable are left out; a worker restarted since it failed (a new epoch) is
        routable again. `targets`: the request's SLO, for a predicted plan."""
        holders = self.mirror.index.holders
        live = self._live_epochs
        # Only the request's own hashes are looked up: a snapshot of the whole index per
        # request would cost O(index) instead of O(prompt blocks). A block may be held in a
        # worker's KV cache or in its host KV tier (under its host-tier name).
        prefix_index, host_index = {}, {}
        for h in block_hashes:
            row, host_row = holders.get(h), holders.get(host_tier_hash(h))
            if not row and not host_row:
                break  # chained hashes: nothing after a miss can be a usable prefix
            if row:
                prefix_index[h] = frozenset(w for w, e in row.items() if live.get(w) == e)
            if host_row:
                host_index[h] = frozenset(w for w, e in host_row.items() if live.get(w) == e)
        snapshot = self._snapshot
        request = RouteRequest(prompt_len=prompt_len, block_hashes=block_hashes,
                               local_prefill=local_prefill, targets=targets)
        workers = self._routable(exclude or {})
        if len(self.routed):
            workers = tuple(map(self._with_routed, workers))
        plan = plan_route(request, ClusterSnapshot(workers, prefix_index, snapshot.block_size,
                                                   host_index), self.rng)
        if isinstance(plan, RoutePlan):
            self._snapshot = with_assignment(snapshot, plan, prompt_len)
            if request_id is not None:
                self.routed.add(request_id, plan.prefill_worker_id or plan.decode_worker_id,
                                max(0, prompt_len - plan.cached_tokens))
        return plan

    def settle(self, request_id: str) -> None:
        """The request's prompt is prefilled, or will not be (its generation ended): its
        worker's load reports count it from now on, if at all."""
        self.routed.settle(request_id)

    def _with_routed(self, view: WorkerView) -> WorkerView:
        num_prompts, num_tokens = self.routed.totals(view.worker_id)
        if not num_prompts:
            return view
        return dataclasses.replace(view, num_routed_prefills=num_prompts,
                                   num_routed_prefill_tokens=num_tokens)

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
        try:
            if self.agent_state is not None:
                self.ejected = await self.agent_state.read_ejected()
        except REDIS_FAILURES as exc:
            raise_if_cancelling(exc)  # the registry answered: route on, with the last list
        now = time.monotonic()
        if not self.redis_connected and self.workers:  # Redis answers again
            self._recovery_until = now + self.vanish_grace_s
        if workers:
            self._last_seen_workers_at = now
            if now < self._recovery_until:
                workers, loads = keep_vanished(self.workers, self.loads, workers, loads)
                if workers.keys() == registry.workers.keys():
                    self._recovery_until = 0.0  # every worker is back
        elif self.workers and now - self._last_seen_workers_at < self.vanish_grace_s:
            # Every worker vanished at once: Redis restarted empty. Keep routing on what was
            # known until they re-register (within a lease or two), rather than answer 503.
            if self.redis_connected:
                log.warning("the registry is empty (Redis restarted?): keeping the last "
                            "%d worker(s) for up to %.0f s", len(self.workers),
                            self.vanish_grace_s)
            self._recovery_until = self._last_seen_workers_at + self.vanish_grace_s
            self.redis_connected = True
            self.last_poll_monotonic = now
            return
        self.workers, self.loads, self.registered_ids = workers, loads, registry.registered_ids
        self._live_epochs = {w.worker_id: w.epoch for w in workers.values()}
        out = active_ejections(self.ejected, self._live_epochs, now_unix_ms())
        self._snapshot = build_snapshot(workers, loads, out)
        self.redis_connected = True
        self.last_poll_monotonic = time.monotonic()

    async def purge_expired(self, now: float | None = None) -> list[str]:
        """Purge every registered worker whose lease lapsed `purge_grace_s` ago or more;
        returns the ids purged."""
        now = time.monotonic() if now is None else now
        self._lapsed_since = lapsed_since(self._lapsed_since, self.registered_ids,
                                          self.workers, now)
        purged = []
        for worker_id in purgeable(self._lapsed_since, now, self.purge_grace_s):
            if await self.state.purge_expired_worker(worker_id):
                log.info("purged worker %s: its lease expired", worker_id)
                purged.append(worker_id)
                self._lapsed_since.pop(worker_id, None)
        return purged

    async def _run(self) -> None:
        while True:
            raise_if_cancelling()  # a stop that redis-py swallowed
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
        self.routed.check_invariants()
        for view in self._snapshot.workers:
            info = self.workers.get(view.worker_id)
            if info is None or info.draining:
                raise AssertionError(f"{view.worker_id} routable but not live or draining")
            if view.worker_id in active_ejections(self.ejected, self._live_epochs,
                                                  now_unix_ms() - 1000):
                raise AssertionError(f"{view.worker_id} routable but ejected")


def lapsed_since(since: Mapping[str, float], registered_ids: Sequence[str],
                 live: Mapping[str, WorkerInfo], now: float) -> dict[str, float]:
    """When each registered worker without a live lease was first seen so (pure)."""
    return {w: since.get(w, now) for w in registered_ids if w not in live}


def purgeable(since: Mapping[str, float], now: float, grace_s: float) -> list[str]:
    """The lapsed workers whose lapse is at least `grace_s` old (pure)."""
    return sorted(w for w, at in since.items() if now - at >= grace_s)


def keep_vanished(known: Mapping[str, WorkerInfo], known_loads: Mapping[str, LoadReport],
                  workers: dict[str, WorkerInfo], loads: dict[str, LoadReport]
                  ) -> tuple[dict[str, WorkerInfo], dict[str, LoadReport]]:
    """The registry's workers and loads, plus every `known` worker it lacks (with its last
    load): what routing uses while workers re-register after Redis lost them. Pure."""
    missing = {w: info for w, info in known.items() if w not in workers}
    if not missing:
        return workers, loads
    kept_loads = {w: known_loads[w] for w in missing if w in known_loads}
    return {**missing, **workers}, {**kept_loads, **loads}


def build_snapshot(workers: dict[str, WorkerInfo], loads: dict[str, LoadReport],
                   ejected: frozenset[str] = frozenset()) -> ClusterSnapshot:
    """The routable workers (live, not draining, not in `ejected`) with their last load;
    pure."""
    views = []
    block_sizes = set()
    for worker_id in sorted(workers):
        info = workers[worker_id]
        if info.draining or worker_id in ejected:
            continue
        report = loads.get(worker_id)
        load = report.load if report is not None else WorkerLoad()
        if load.num_kv_blocks_total == 0:  # not reported yet: the pool it registered
            load = msgspec.structs.replace(load, num_kv_blocks_total=info.num_kv_blocks)
        views.append(WorkerView(worker_id=worker_id, role=info.role, load=load,
                                max_batched_tokens=info.max_num_batched_tokens or 2048,
                                kv_bytes_per_token=info.kv_bytes_per_token,
                                kv_dtype=info.kv_dtype))
        block_sizes.add(info.block_size)
    if len(block_sizes) > 1:
        log.warning("workers disagree on block size %s: prefix routing uses the smallest",
                    sorted(block_sizes))
    return ClusterSnapshot(workers=tuple(views), prefix_index={},
                           block_size=min(block_sizes, default=DEFAULT_BLOCK_SIZE))

