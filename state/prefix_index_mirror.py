"""An in-memory mirror of the global prefix-cache index, kept current from the event stream.

Each gateway replica keeps one, so routing reads never touch Redis:

    Redis (state/redis_state.py)            this process
    ─────────────────────────────            ─────────────────────────────────────────
    snapshot_index() ── atomic ───────────▶  PrefixIndex.load(holdings) at stream id S
    prefix_events stream (S, ...] ── XREAD ▶  PrefixIndex.apply(event), last_event_id = id

Lifecycle: created empty (needs a snapshot) → start(): snapshot, then follow the stream →
on a Redis error: keep serving the last view, retry with backoff; on reconnect either
replay from last_event_id (still in the stream, same generation) or take a new snapshot
(the events were trimmed, or Redis restarted and lost its data) → stop().

Invariants (PrefixIndex.check_invariants): `holders[h][w] == e` iff `h in held[w]` and
`epochs[w] == e`; an event older than a worker's known epoch changes nothing; an event with
a newer epoch (or reset) first drops every entry of that worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from protocol.messages import PrefixIndexEvent
from state.redis_state import (REDIS_FAILURES, RedisState, StreamId, raise_if_cancelling, stop_task,
                               stream_id_key)

logger = logging.getLogger(__name__)


class PrefixIndex:
    """Pure state: which worker (at which epoch) holds which chained block hash."""

    def __init__(self) -> None:
        self.holders: dict[int, dict[str, int]] = {}
        self.held: dict[str, set[int]] = {}
        self.epochs: dict[str, int] = {}

    def load(self, holdings: Mapping[str, tuple[int, Sequence[int]]]) -> None:
        self.holders, self.held, self.epochs = {}, {}, {}
        for worker_id, (epoch, hashes) in holdings.items():
            self.apply(PrefixIndexEvent(worker_id=worker_id, epoch=epoch, inserted=list(hashes)))

    def apply(self, event: PrefixIndexEvent) -> bool:
        """Apply one event; False when it came from a superseded epoch and was ignored."""
        wid, epoch = event.worker_id, event.epoch
        known = self.epochs.get(wid)
        if known is not None and epoch < known:
            return False
        if event.reset or known is None or epoch > known:
            self._drop_worker(wid)
            self.epochs[wid] = epoch
        held = self.held.setdefault(wid, set())
        for h in event.evicted:
            if h in held:
                held.discard(h)
                row = self.holders[h]
                del row[wid]
                if not row:
                    del self.holders[h]
        for h in event.inserted:
            held.add(h)
            self.holders.setdefault(h, {})[wid] = epoch
        return True

    def _drop_worker(self, worker_id: str) -> None:
        for h in self.held.pop(worker_id, ()):
            row = self.holders[h]
            del row[worker_id]
            if not row:
                del self.holders[h]
        self.epochs.pop(worker_id, None)

    def overlap(self, hashes: Sequence[int],
                live_epochs: Mapping[str, int] | None = None) -> dict[str, int]:
        """worker id -> how many leading `hashes` it holds (at least one; chained hashes).

        With `live_epochs` (from the registry), workers absent from it or known here only at
        another epoch are left out: their entries are stale.
        """
        if not hashes:
            return {}
        first = self.holders.get(hashes[0], {})
        candidates = {w: e for w, e in first.items()
                      if live_epochs is None or live_epochs.get(w) == e}
        result: dict[str, int] = {}
        for i, h in enumerate(hashes):
            row = self.holders.get(h, {})
            for w in [w for w, e in candidates.items() if row.get(w) != e]:
                result[w] = i
                del candidates[w]
            if not candidates:
                break
        result.update({w: len(hashes) for w in candidates})
        return result

    @property
    def num_entries(self) -> int:
        return sum(len(s) for s in self.held.values())

    def check_invariants(self) -> None:
        for wid, hashes in self.held.items():
            for h in hashes:
                if self.holders.get(h, {}).get(wid) != self.epochs[wid]:
                    raise AssertionError(f"hash {h} of {wid} missing or at a wrong epoch")
        num_pairs = sum(len(row) for row in self.holders.values())
        if num_pairs != self.num_entries:
            raise AssertionError(f"{num_pairs} holder entries but {self.num_entries} held")
        if any(not row for row in self.holders.values()):
            raise AssertionError("empty holder row kept")


class PrefixIndexMirror:
    """Follows the Redis index through `state`; one owned background task."""

    def __init__(self, state: RedisState, block_ms: int = 500, batch_size: int = 1000,
                 backoff_min_s: float = 0.05, backoff_max_s: float = 2.0) -> None:
        self.state = state
        self.block_ms = block_ms
        self.batch_size = batch_size
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.index = PrefixIndex()
        self.generation: str | None = None  # None: no snapshot taken yet
        self.last_event_id: StreamId = "0-0"
        self.num_snapshots = 0
        self.num_replayed_events = 0
        self.num_errors = 0
        self.connected = False
        self._needs_resync = True
        self._task: asyncio.Task[None] | None = None

    def overlap(self, hashes: Sequence[int],
                live_epochs: Mapping[str, int] | None = None) -> dict[str, int]:
        return self.index.overlap(hashes, live_epochs)

    async def start(self, timeout_s: float = 5.0) -> None:
        """Take the first snapshot (within timeout_s), then follow the stream in the background."""
        if self._task is not None:
            raise RuntimeError("mirror already started")
        async with asyncio.timeout(timeout_s):
            await self.resync()
        self._task = asyncio.create_task(self._run(), name="prefix-index-mirror")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not await stop_task(task, self.state.client, timeout_s=2.0):
            logger.error("prefix index mirror task did not stop within its deadline")
        self.connected = False
        self._needs_resync = True  # whatever happened meanwhile is unknown

    async def resync(self) -> None:
        """Catch up after (re)connecting: replay if nothing was lost, else snapshot."""
        generation = await self.state.index_generation()
        first_id = await self.state.first_event_id()
        can_replay = (self.generation is not None and generation == self.generation
                      and (first_id is None or
                           stream_id_key(first_id) <= stream_id_key(self.last_event_id)))
        if not can_replay:
            snapshot = await self.state.snapshot_index()
            self.index.load(snapshot.holdings)
            self.generation = snapshot.generation
            self.last_event_id = snapshot.last_event_id
            self.num_snapshots += 1
        self._needs_resync = False
        self.connected = True
        await self.poll(block_ms=None)

    async def poll(self, block_ms: int | None) -> int:
        """Apply the events after last_event_id (waiting up to block_ms); returns how many."""
        num_applied = 0
        while True:
            events = await self.state.read_index_events(
                self.last_event_id, count=self.batch_size, block_ms=block_ms)
            for event_id, event in events:
                self.index.apply(event)
                self.last_event_id = event_id
            num_applied += len(events)
            if len(events) < self.batch_size:
                self.num_replayed_events += num_applied
                return num_applied
            block_ms = None  # a full batch: more are waiting, read them without blocking

    async def _run(self) -> None:
        backoff_s = self.backoff_min_s
        while True:
            raise_if_cancelling()  # a stop that redis-py swallowed
            try:
                if self._needs_resync:
                    await self.resync()
                else:
                    await self.poll(self.block_ms)
                    # A restart with fresh data shows up as a new generation, not an error.
                    if await self.state.index_generation() not in (self.generation, ""):
                        self._needs_resync = True
                backoff_s = self.backoff_min_s
            except REDIS_FAILURES as exc:
                raise_if_cancelling(exc)
                self.num_errors += 1
                self.connected = False
                self._needs_resync = True
                logger.warning("prefix index mirror: redis unavailable (%s); retrying in %.2f s",
                               exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.backoff_max_s)

    def check_invariants(self) -> None:
        self.index.check_invariants()
