"""The host KV tier: prefix blocks evicted from the device pool, kept in host memory.

A second-level prefix cache with a size of its own (`num_host_blocks`), an LRU keyed by
chained block hash (protocol/block_hashes.py). The KV cache manager (engine/kv_cache.py)
offers it every block the device pool evicts with a hash, and looks past the device-cached
prefix into it at admission: blocks held here are copied back into fresh device blocks, and
the request counts them as cached (they are not recomputed). The copies and the host
tensors are a `HostCopier`'s (engine/host_copier.py): this module is torch-free,
as the scheduler that drives it.

Lifecycle of one host slot:

    FREE --offer / offer_ahead (copy to host)--> HELD --evict (LRU, idle only)--> FREE
                                                 |  ^
                    pin (admission), reload (copy to device), offer again: most recent

When copies are asynchronous (CUDA) a block is offered twice: when it becomes cached-free on
the device (`offer_ahead`: copied then, nothing waits for it) and when the device evicts it
(`offer`: already held, so no copy; the step that reuses the block waits, on the device,
only for a copy still in flight). Synchronous copies (CPU) happen at eviction only.

Offers ahead are copied in batches: `offer_ahead` takes the slot and queues the block, and
`flush` copies every queued block in one copier call (a request's blocks, freed together,
are one gather on the device and a few copies to the host, not one strided copy per block:
per-block copies cost the engine's thread ~0.1 ms each, a quarter of its time on a small
model at full load). The scheduler flushes once per step (every request released since the
last step in one call: a flush per release cost ~0.4 ms of the thread each, 18% of its time
at 240 req/s); anything that reads or overwrites a queued block (its eviction, a reload, a
peer's write) flushes first.

    queued     taken by an offer ahead, its copy not asked for yet (until the next `flush`)
    in flight  a copy to or from the slot is queued and not done (CUDA only: on the CPU
               copies are done when the call returns, engine/host_copier.py)
    pinned     an admission will reload it (`pin` ... `reload`): the device allocation between
               the two may evict device blocks, whose offers must not take this slot

Invariants (`check_invariants`):
    num_held_blocks + num_free_slots == num_host_blocks (capacity is never exceeded)
    each hash is held at most once, each slot holds at most one hash
    a slot queued, in flight or pinned is held, and is never evicted (a block is never both
    in flight and evictable); a queued slot is not in flight (its copy is not asked for yet)
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import msgspec

from engine.block_pool import CacheEvent, CacheEventKind
from protocol.block_hashes import host_tier_hash


class CopyDone(Protocol):
    """A copy in flight: `torch.cuda.Event` is one."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class HostCopier(Protocol):
    """Moves one block between the device pool and a host slot (engine/host_copier.py).

    `asynchronous`: copies return before they are done (CUDA); the tier then copies blocks
    ahead of their eviction, when they become cached-free, so the step that reuses one
    seldom has a copy to wait for."""

    asynchronous: bool

    def to_host(self, copies: Sequence[tuple[int, int]], before_writes: bool
                ) -> CopyDone | None:
        """Copy each `(block_id, host_slot)` of `copies`, device block into host slot, in one
        call; one CopyDone for them all, None: done already. With `before_writes`, work the
        engine queues next (a step that may overwrite the blocks) runs after the copies."""
        ...

    def to_device(self, copies: Sequence[tuple[int, int]],
                  after: Sequence[CopyDone]) -> CopyDone | None:
        """Copy each `(host_slot, block_id)` of `copies` into its device block, after the
        copies `after` (the slots' own, still in flight) and after the work the engine
        queued so far; one CopyDone for them all, None: done already. The engine's later
        work does not wait for it: the KV cache holds back every request that reads the
        blocks until it is done (engine/kv_cache.py). One call for a whole prefix, so
        that the copies queue back to back."""
        ...

    def order_writes_after(self, done: CopyDone) -> None:
        """Work the engine queues next runs after the copy `done`."""
        ...


class HostTierStats(msgspec.Struct, frozen=True, kw_only=True):
    """The tier's counters since start (blocks and bytes), for a worker's /metrics."""

    num_host_blocks: int
    num_held_blocks: int
    num_hit_blocks: int  # prompt blocks past the device-cached prefix served from here
    num_missed_blocks: int  # prompt blocks past the device-cached prefix not held here
    num_dropped_blocks: int  # evicted device blocks not kept (every idle slot was busy)
    offloaded_bytes: int
    reloaded_bytes: int


class HostKVTier:
    """An LRU of host copies of evicted prefix blocks (one engine thread uses it)."""

    def __init__(self, num_host_blocks: int, copier: HostCopier, block_bytes: int,
                 copies_ahead: bool | None = None, reload_bytes_per_s: float = 0.0) -> None:
        """`block_bytes`: one block's K and V over all layers (what one copy moves);
        `copies_ahead`: take `offer_ahead`s (default: when the copier is asynchronous);
        `reload_bytes_per_s`: the host-to-device copy rate measured at start (0: unknown),
        which the router prices a host hit with."""
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be at least 1, got {num_host_blocks}")
        self.num_host_blocks = num_host_blocks
        self.block_bytes = block_bytes
        self.copies_ahead = copier.asynchronous if copies_ahead is None else copies_ahead
        self.reload_bytes_per_s = reload_bytes_per_s
        self._events: list[CacheEvent] = []  # under host_tier_hash names
        self._copier = copier
        # Insertion order is the LRU order: the first key was used longest ago.
        self._slot_by_hash: OrderedDict[int, int] = OrderedDict()
        self._hash_by_slot: dict[int, int] = {}
        self._free_slots = list(range(num_host_blocks - 1, -1, -1))
        self._in_flight: dict[int, CopyDone] = {}
        self._queued: dict[int, int] = {}  # slot -> device block: offers ahead to copy
        self._pins: Counter[int] = Counter()
        self._num_hit = self._num_missed = self._num_dropped = 0
        self._num_offloaded = self._num_reloaded = 0
        # Reloads queued and not yet seen done (oldest first, with when each was queued), and
        # the latencies of those seen done since the last drain_reload_seconds().
        self._reloads: deque[tuple[float, CopyDone]] = deque()
        self._reload_seconds: list[float] = []
        # Inside `waiting_for_evictions`: the copies out of the blocks evicted so far.
        self._watched: list[CopyDone] | None = None

    # ---- queries (side-effect free) -------------------------------------------------------

    @property
    def num_held_blocks(self) -> int:
        return len(self._slot_by_hash)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._slot_by_hash

    def num_leading_held(self, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes`, from the first, are held here."""
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self._slot_by_hash:
                return i
        return len(block_hashes)

    def stats(self) -> HostTierStats:
        return HostTierStats(
            num_host_blocks=self.num_host_blocks, num_held_blocks=self.num_held_blocks,
            num_hit_blocks=self._num_hit, num_missed_blocks=self._num_missed,
            num_dropped_blocks=self._num_dropped,
            offloaded_bytes=self._num_offloaded * self.block_bytes,
            reloaded_bytes=self._num_reloaded * self.block_bytes)

    # ---- commands ---------------------------------------------------------------------------

    def offer(self, block_hash: int, block_id: int) -> bool:
        """Keep a copy of device block `block_id`, which holds prefix `block_hash` and is about
        to be handed out again (the copy is ordered before any later write to it). False: not
        kept, every slot being in flight or pinned. Called by the device pool's eviction."""
        self.flush()  # a copy of this block may be queued: it goes before the block's reuse
        slot = self._slot_by_hash.get(block_hash)
        if slot is not None:  # the same prefix: the same KV (copied ahead, or earlier)
            self._slot_by_hash.move_to_end(block_hash)
            done = self._in_flight.get(slot)
            if done is not None and not done.query():
                self._copier.order_writes_after(done)
                if self._watched is not None:
                    self._watched.append(done)
            return True
        if self._keep(block_hash, block_id, before_writes=True):
            return True
        self._num_dropped += 1
        return False

    def offer_ahead(self, block_hash: int, block_id: int) -> bool:
        """Queue a copy of a block that just became cached-free on the device (still
        findable there; evicted later, if ever), with nothing waiting for it; the next
        `flush` asks for it. False: not kept now (the eviction offers it again)."""
        if block_hash in self._slot_by_hash:
            self._slot_by_hash.move_to_end(block_hash)
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self._hold(block_hash, slot)
        self._queued[slot] = block_id
        return True

    def flush(self) -> None:
        """Ask for the copies of every queued offer ahead, in one copier call."""
        if not self._queued:
            return
        queued, self._queued = self._queued, {}
        done = self._copier.to_host([(block_id, slot) for slot, block_id in queued.items()],
                                    before_writes=False)
        for slot in queued:
            self._track(slot, done)
        self._num_offloaded += len(queued)

    def pin(self, block_hashes: Sequence[int]) -> None:
        """Keep these held blocks from eviction until each is `reload`ed (once per pin)."""
        for block_hash in block_hashes:
            self._pins[self._slot_by_hash[block_hash]] += 1  # KeyError: not held

    def reload(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> CopyDone | None:
        """Copy pinned blocks into device blocks `block_ids` (freshly allocated, referenced
        by the request that will read them), in one copier call, and drop one pin of each;
        they become the most recent. The copy in flight (None: done already), which no
        step may read the blocks before."""
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} blocks reloaded into {len(block_ids)}")
        slots = [self._slot_by_hash[block_hash] for block_hash in block_hashes]
        for block_hash, slot in zip(block_hashes, slots):
            if self._pins[slot] < 1:
                raise ValueError(f"block {block_hash:#x} is reloaded without a pin")
        for block_hash, slot in zip(block_hashes, slots):
            self._pins[slot] -= 1
            if not self._pins[slot]:
                del self._pins[slot]
            self._slot_by_hash.move_to_end(block_hash)
        if not slots:
            return None
        self.flush()  # a queued slot's copy goes first (the reload reads what it writes)
        after = [done for slot in slots if (done := self._in_flight.get(slot)) is not None]
        start = time.perf_counter()
        done = self._copier.to_device(list(zip(slots, block_ids)), after)
        if done is None:
            self._reload_seconds.append(time.perf_counter() - start)
        else:
            self._reloads.append((start, done))
        # The reload ends after each slot's copy in flight, so it stands for both.
        for slot in slots:
            self._track(slot, done)
        self._num_reloaded += len(slots)
        return done

    def order_writes_after(self, done: CopyDone) -> None:
        """The engine's next work runs after `done`: a reload whose blocks, let go by a
        request that never read them, may be reallocated and written."""
        self._copier.order_writes_after(done)

    def record_lookup(self, num_hit_blocks: int, num_missed_blocks: int) -> None:
        """An admission's outcome past the device-cached prefix (the hit/miss counters)."""
        self._num_hit += num_hit_blocks
        self._num_missed += num_missed_blocks

    def drain_reload_seconds(self) -> tuple[float, ...]:
        """The latencies of the reloads (one per admission) done since the last call: from the
        copy being queued to it being done where copies are synchronous (CPU), else to the
        first call that finds it done (the engine calls once a step: an upper bound by up to
        one step, which is also when the step reading the blocks can start)."""
        now = time.perf_counter()
        while self._reloads and self._reloads[0][1].query():
            start, _ = self._reloads.popleft()
            self._reload_seconds.append(now - start)
        seconds, self._reload_seconds = tuple(self._reload_seconds), []
        return seconds

    def drain_events(self) -> list[CacheEvent]:
        """Hashes the tier took and dropped since the last call, oldest first, each under its
        host-tier name (protocol/block_hashes.py): what the worker publishes to the global
        prefix index beside its KV cache's own events."""
        events, self._events = self._events, []
        return events

    @contextmanager
    def waiting_for_evictions(self) -> Iterator[None]:
        """Around a device allocation whose blocks something outside the engine's stream
        writes next (a KV peer filling a reservation): on leaving, the calling thread waits
        until the copies out of the blocks the allocation evicted are done (only those:
        other copies in flight go on)."""
        self._watched = []
        try:
            yield
        finally:
            watched, self._watched = self._watched, None
        for done in watched:
            done.synchronize()

    def wait_for_copies(self) -> None:
        """Block the calling thread until every copy asked for or queued is done: a barrier
        over the whole tier (before reading the host buffer). A reservation waits only for
        its own evictions' copies (`waiting_for_evictions`)."""
        self.flush()
        for done in self._in_flight.values():
            done.synchronize()
        self._in_flight.clear()

    # ---- internals -------------------------------------------------------------------------

    def _keep(self, block_hash: int, block_id: int, before_writes: bool) -> bool:
        """Copy a block not held into a slot; False when every slot is busy."""
        slot = self._take_slot()
        if slot is None:
            return False
        self._hold(block_hash, slot)
        done = self._copier.to_host([(block_id, slot)], before_writes)
        self._track(slot, done)
        if done is not None and self._watched is not None:
            self._watched.append(done)
        self._num_offloaded += 1
        return True

    def _hold(self, block_hash: int, slot: int) -> None:
        self._slot_by_hash[block_hash] = slot
        self._hash_by_slot[slot] = block_hash
        self._events.append(CacheEvent(CacheEventKind.INSERTED, host_tier_hash(block_hash)))

    def _track(self, slot: int, done: CopyDone | None) -> None:
        self._in_flight.pop(slot, None)  # a later copy of a slot ends after an earlier one
        if done is None:
            return
        self._in_flight[slot] = done  # the newest last: the dict is in the order asked
        # Forget copies done, oldest first, two per call: the map shrinks to the copies
        # actually in flight (copies ahead of eviction make one per freed block).
        for _ in range(2):
            oldest = next(iter(self._in_flight), None)
            if oldest is None or not self._in_flight[oldest].query():
                return
            del self._in_flight[oldest]

    def _is_busy(self, slot: int) -> bool:
        if slot in self._pins or slot in self._queued:
            return True
        done = self._in_flight.get(slot)
        if done is None:
            return False
        if done.query():
            del self._in_flight[slot]
            return False
        return True

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slot_by_hash.items():  # least recently used first
            if not self._is_busy(slot):
                del self._slot_by_hash[block_hash]
                del self._hash_by_slot[slot]
                self._events.append(CacheEvent(CacheEventKind.EVICTED,
                                               host_tier_hash(block_hash)))
                return slot
        return None

    # ---- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        held = set(self._hash_by_slot)
        assert len(self._slot_by_hash) == len(self._hash_by_slot) == len(held), \
            "a hash or a slot is held twice"
        assert all(self._hash_by_slot[s] == h for h, s in self._slot_by_hash.items()), \
            "the hash and slot maps disagree"
        free = set(self._free_slots)
        assert len(free) == len(self._free_slots), "a slot is on the free list twice"
        assert not held & free, "a slot is both held and free"
        assert len(held) + len(free) == self.num_host_blocks, \
            "num_held_blocks + num_free_slots != num_host_blocks"
        assert set(self._in_flight) <= held, "a copy is in flight for a slot not held"
        assert set(self._pins) <= held and all(n > 0 for n in self._pins.values()), \
            "a pin on a slot not held"
        assert set(self._queued) <= held, "a copy is queued for a slot not held"
        assert not set(self._queued) & set(self._in_flight), "a queued slot is in flight"
