"""Keeps one worker's registry entry, load and prefix-cache index current in Redis.

Every worker process owns exactly one. The engine reports cache changes through the
synchronous `record_inserted` / `record_evicted` (cheap, never blocks, safe to call from the
step loop); one background task batches them into pipelined index events and renews the
lease with the latest load every `period_s`.

Lifecycle:

    start() ── next_epoch (INCR), reset event, first heartbeat ──▶ PUBLISHING
    PUBLISHING ── Redis error ──▶ DISCONNECTED (keep the local state, back off 50 ms → 2 s)
    DISCONNECTED ── a heartbeat succeeds ──▶ republish in full (reset + every held hash) ──▶ PUBLISHING
    PUBLISHING ── heartbeat finds the lease gone (expired, or Redis restarted) ──▶ republish in full
    any ── StaleEpochError (a newer start of this id registered) ──▶ FENCED (stops writing)
    change_role() ── task paused, next_epoch, new info, republish in full ──▶ PUBLISHING
    set_draining() marks the registry entry; stop() flushes, deregisters, cancels the task.

The entry is bound to the cluster's secret (protocol/cluster_secret.py) with the state's
registry key: every change of `info` goes through `_set_info`, which binds it again, so no
entry leaves here whose binding does not cover what it says (the gateway and the agent
ignore one that does not verify).

Invariants: `held` is exactly the set of hashes the engine has reported inserted and not
evicted; pending_inserted and pending_evicted are disjoint subsets of (held, not held);
`info` is bound with the state's registry key (when it has one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import msgspec

from protocol.cluster_secret import bind_entry, entry_is_bound
from protocol.messages import MAX_HASHES_PER_EVENT, LoadReport, PrefixIndexEvent, Role, WorkerInfo
from protocol.worker_load import WorkerLoad
from state.redis_state import (REDIS_FAILURES, RedisState, StaleEpochError, raise_if_cancelling,
                               stop_task)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerPublisher:
    def __init__(self, state: RedisState, info: WorkerInfo, load_fn: Callable[[], WorkerLoad],
                 period_s: float = 0.5, lease_ttl_s: float = 3.0,
                 backoff_min_s: float = 0.05, backoff_max_s: float = 2.0) -> None:
        if lease_ttl_s < 2 * period_s:
            raise ValueError(f"lease_ttl_s ({lease_ttl_s}) must cover two periods ({period_s} s)")
        self.state = state
        self.info = bind_entry(info, state.entry_key)
        self.load_fn = load_fn
        self.period_s = period_s
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.held: set[int] = set()
        self.pending_inserted: set[int] = set()
        self.pending_evicted: set[int] = set()
        self.connected = False
        self.fenced = False
        self.num_errors = 0
        self.num_republishes = 0
        self.num_heartbeats = 0
        self._needs_republish = True
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def epoch(self) -> int:
        return self.info.epoch

    # ---------------------------------------------------------------- engine-facing

    def record_inserted(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.held.add(h)
            self.pending_evicted.discard(h)
            self.pending_inserted.add(h)
        self._wake.set()

    def record_evicted(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.held.discard(h)
            self.pending_inserted.discard(h)
            self.pending_evicted.add(h)
        self._wake.set()

    # ---------------------------------------------------------------- lifecycle

    async def start(self, timeout_s: float = 10.0) -> int:
        """Register (retrying Redis errors until timeout_s); returns this start's epoch."""
        if self._task is not None:
            raise RuntimeError("publisher already started")
        async with asyncio.timeout(timeout_s):
            epoch = await self._retrying(lambda: self.state.next_epoch(self.info.worker_id))
            self._set_info(msgspec.structs.replace(
                self.info, epoch=epoch, started_unix_ms=int(time.time() * 1000)))
            self._needs_republish = True
            await self._retrying(lambda: self._tick(heartbeat=True))
        self._task = asyncio.create_task(self._run(), name=f"publisher-{self.info.worker_id}")
        return epoch

    def _set_info(self, info: WorkerInfo) -> None:
        """The entry from now on, bound again."""
        self.info = bind_entry(info, self.state.entry_key)

    async def _retrying(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Retry Redis failures with backoff; the caller's deadline bounds the whole."""
        backoff_s = self.backoff_min_s
        while True:
            try:
                return await operation()
            except REDIS_FAILURES as exc:
                raise_if_cancelling(exc)
                self.num_errors += 1
                logger.warning("starting %s: redis unavailable (%s)", self.info.worker_id, exc)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.backoff_max_s)

    async def change_role(self, role: Role, kv_address: str | None,
                          timeout_s: float = 10.0) -> int:
        """Register a new role under a new epoch and republish in full; returns the epoch.

        The background task is stopped meanwhile: a write under the old epoch after the
        INCR would be refused as stale and fence this publisher."""
        task, self._task = self._task, None
        if task is not None and not await stop_task(task, self.state.client, timeout_s):
            logger.error("publisher task of %s did not stop for a role change",
                         self.info.worker_id)
        try:
            async with asyncio.timeout(timeout_s):
                epoch = await self._retrying(lambda: self.state.next_epoch(self.info.worker_id))
                self._set_info(msgspec.structs.replace(self.info, role=role,
                                                       kv_address=kv_address, epoch=epoch))
                self._needs_republish = True
                await self._retrying(lambda: self._tick(heartbeat=True))
        finally:
            self._task = asyncio.create_task(self._run(),
                                             name=f"publisher-{self.info.worker_id}")
        return epoch

    async def set_draining(self, timeout_s: float = 2.0) -> None:
        """Route nothing new here; best effort right now, and kept by every later heartbeat."""
        self._set_info(msgspec.structs.replace(self.info, draining=True))
        try:
            await self.state.heartbeat(self.info, None, self.lease_ttl_ms, timeout_s=timeout_s)
        except REDIS_FAILURES as exc:
            logger.warning("marking %s draining: redis unavailable (%s)", self.info.worker_id, exc)

    async def stop(self, deregister: bool = True, timeout_s: float = 2.0) -> None:
        """Cancel the task; then deregister (best effort: the lease expires anyway)."""
        task, self._task = self._task, None
        if task is not None and not await stop_task(task, self.state.client, timeout_s):
            logger.error("publisher task of %s did not stop within its deadline",
                         self.info.worker_id)
        if deregister and not self.fenced:
            try:
                await self.state.deregister(self.info.worker_id, self.epoch, timeout_s=timeout_s)
            except REDIS_FAILURES as exc:
                logger.warning("deregistering %s: redis unavailable (%s); the lease will expire",
                               self.info.worker_id, exc)
        self.connected = False

    # ---------------------------------------------------------------- background task

    async def _run(self) -> None:
        backoff_s = self.backoff_min_s
        next_heartbeat = time.monotonic() + self.period_s
        while True:
            raise_if_cancelling()  # a stop that redis-py swallowed
            now = time.monotonic()
            try:
                due = now >= next_heartbeat or not self.connected
                await self._tick(heartbeat=due)
                if due:
                    next_heartbeat = now + self.period_s
                backoff_s = self.backoff_min_s
                self._wake.clear()
                if not (self.pending_inserted or self.pending_evicted):
                    try:
                        async with asyncio.timeout(max(0.0, next_heartbeat - time.monotonic())):
                            await self._wake.wait()
                    except TimeoutError as exc:
                        raise_if_cancelling(exc)
            except StaleEpochError:
                self.fenced = True
                self.connected = False
                logger.error("worker %s epoch %d was superseded by a newer start; "
                             "no longer publishing", self.info.worker_id, self.epoch)
                return
            except REDIS_FAILURES as exc:
                raise_if_cancelling(exc)
                self.num_errors += 1
                self.connected = False
                self._needs_republish = True
                logger.warning("publishing %s: redis unavailable (%s); retrying in %.2f s",
                               self.info.worker_id, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.backoff_max_s)

    async def _tick(self, heartbeat: bool) -> None:
        if heartbeat:
            load = LoadReport(worker_id=self.info.worker_id, epoch=self.epoch,
                              load=self.load_fn(), updated_unix_ms=int(time.time() * 1000))
            lease_was_live = await self.state.heartbeat(self.info, load, self.lease_ttl_ms)
            self.num_heartbeats += 1
            self.connected = True
            if not lease_was_live:
                self._needs_republish = True
        if self._needs_republish:
            await self._republish()
        elif self.pending_inserted or self.pending_evicted:
            await self._flush()

    async def _republish(self) -> None:
        # Snapshot and clear the pending sets first: changes recorded while awaiting are
        # kept for the next flush instead of being lost.
        hashes = sorted(self.held)
        self.pending_inserted.clear()
        self.pending_evicted.clear()
        chunks = [hashes[i:i + MAX_HASHES_PER_EVENT]
                  for i in range(0, len(hashes), MAX_HASHES_PER_EVENT)] or [[]]
        for i, chunk in enumerate(chunks):
            await self.state.apply_index_event(PrefixIndexEvent(
                worker_id=self.info.worker_id, epoch=self.epoch, inserted=chunk, reset=i == 0))
        self._needs_republish = False
        self.num_republishes += 1

    async def _flush(self) -> None:
        inserted, evicted = sorted(self.pending_inserted), sorted(self.pending_evicted)
        self.pending_inserted.clear()
        self.pending_evicted.clear()
        try:
            for i in range(0, max(len(inserted), len(evicted)), MAX_HASHES_PER_EVENT):
                await self.state.apply_index_event(PrefixIndexEvent(
                    worker_id=self.info.worker_id, epoch=self.epoch,
                    inserted=inserted[i:i + MAX_HASHES_PER_EVENT],
                    evicted=evicted[i:i + MAX_HASHES_PER_EVENT]))
        except BaseException:
            self._needs_republish = True  # a batch may be half-sent: the next tick resends all
            raise

    def check_invariants(self) -> None:
        if not entry_is_bound(self.info, self.state.entry_key):
            raise AssertionError("the registry entry is not bound to what it says")
        if self.pending_inserted & self.pending_evicted:
            raise AssertionError("a hash is pending both insert and evict")
        if not self.pending_inserted <= self.held:
            raise AssertionError("pending insert of a hash no longer held")
        if self.pending_evicted & self.held:
            raise AssertionError("pending evict of a hash still held")
