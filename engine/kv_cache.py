"""Per-request block tables over the `BlockPool`, with prefix caching by chained block hashes.

Prefix hashing: a *full* block is named by its chained hash (protocol/block_hashes.py),
which covers the whole prefix up to the end of the block; the gateway and other workers
compute the same names. Partial blocks are never cached.

Two ways to get blocks:

    prefill / local generation          decode worker (disaggregated)
    find_cached_prefix(tokens)          reserve(request_id, prompt) -> Reservation
    allocate_for(request, n, prefix)      ... peer writes KV into the uncached blocks ...
    cache_full_blocks(request)          adopt_reservation(request)   (scheduler joins it)
    free(request)                       release(request_id)          (if it never joins)

Host tier (engine/host_kv_tier.py, optional): the pool offers every block it evicts with a
hash to the tier; a lookup continues past the device-cached blocks into the tier, and the
blocks found there are allocated on the device, filled from the host and published, so they
count as cached:

    prompt blocks  [ device hits | host hits (reloaded) | computed ... ]
                   ^ block_ids     ^ host_block_hashes   ^ num_missed_blocks (full ones)

Where copies are asynchronous (CUDA) a reload is in flight when the admission returns, and
nothing waits for it on the device: the table is *loading* until the copy is done (so is one
that took, as a device hit, a block a reload is still filling), and the scheduler leaves a
loading request out of its steps (`poll_loads`) while the others' go on. A loading table
released (an abort, a preemption) makes the engine's next work wait for its copies on the
device, since its blocks may be reallocated and written.

Lifecycle of a block table (keyed by request id): created by `allocate_for` or `reserve`,
grown by `allocate_for`, its full computed blocks published by `cache_full_blocks`, ended by
`free`/`release` (exactly once; a second call raises KeyError).

Invariants (`check_invariants`):
    for every block, the number of tables holding it == its refcount in the pool
    a table's first `num_published_blocks` blocks were offered to the prefix map (each maps
    to its chained hash, or to nothing when an identical prefix was cached first); the blocks
    after those carry no hash
    a loading table's id is in `loading_ids`, and every id there is a live loading table
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import msgspec

from engine.block_pool import BlockPool, CacheEvent
from engine.host_kv_tier import CopyDone, HostKVTier
from engine.request import Request
from protocol.block_hashes import block_hash


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """Blocks already holding a prefix of some token sequence (no references taken): on the
    device (`block_ids`), then in the host tier (`host_block_hashes`, reloaded when taken).
    num_cached_tokens covers both."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]  # of block_ids
    num_cached_tokens: int
    host_block_hashes: tuple[int, ...] = ()
    num_missed_blocks: int = 0  # full blocks looked for past the device, held nowhere


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks a decode worker set aside for a prompt whose KV a prefill worker will send.

    block_ids covers len(prompt) + 1 positions. Positions [0, num_cached_tokens) already hold
    this prompt's KV (prefix cache hit), so the sender skips block_ids[:num_cached_tokens //
    block_size] and writes the rest.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int


@dataclass(slots=True)
class _BlockTable:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes, a prefix of blocks
    num_published_blocks: int = 0  # leading blocks already offered to the prefix map
    num_prefix_cached_tokens: int = 0
    loads: list[CopyDone] = field(default_factory=list)  # reloads of its blocks in flight


class KVCacheManager:
    """Block tables for requests and reservations on one pool (one engine, one thread)."""

    def __init__(self, pool: BlockPool, host_tier: HostKVTier | None = None) -> None:
        """With `host_tier`, the pool's evictions go to it (this wires `pool.on_evict`, and
        `pool.on_cached_free` where the tier copies ahead of eviction: `flush_offloads`)."""
        self.pool = pool
        self.block_size = pool.block_size
        self.host_tier = host_tier
        if host_tier is not None:
            pool.on_evict = host_tier.offer
            pool.on_cached_free = host_tier.offer_ahead if host_tier.copies_ahead else None
        self._tables: dict[str, _BlockTable] = {}
        # Reloaded blocks whose copy was not yet seen done, and the tables loading.
        self._loading_blocks: dict[int, CopyDone] = {}
        self.loading_ids: set[str] = set()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, counting unreferenced cached blocks (evictable)."""
        return self.pool.num_available_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_referenced_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request or reservation, in [0, 1]."""
        return self.pool.num_referenced_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def request_ids(self) -> frozenset[str]:
        """Ids of every live table (requests and reservations)."""
        return frozenset(self._tables)

    @property
    def num_tables(self) -> int:
        """How many live tables (requests and reservations): `len(request_ids())`, no copy."""
        return len(self._tables)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables[request_id].block_ids)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of leading full blocks of `token_ids` found in the prefix cache.

        Never covers the whole sequence: at least one token is left to compute, because a
        prefill must run the model on some token to get the logits that sample the next one.
        Side-effect free; pass the result to `allocate_for` before anything else changes.
        """
        return self._match(token_ids, (len(token_ids) - 1) // self.block_size)

    def can_allocate_for(self, request: Request, num_new_tokens: int,
                         prefix: CachedPrefix | None = None) -> bool:
        return self._plan(request, num_new_tokens, prefix) is not None

    def can_reserve(self, prompt_token_ids: Sequence[int]) -> bool:
        prefix = self._match(prompt_token_ids, len(prompt_token_ids) // self.block_size)
        return self._blocks_to_take(prefix, self.blocks_needed(len(prompt_token_ids) + 1)) \
            <= self.pool.num_available_blocks

    # ---- commands --------------------------------------------------------------------------

    def allocate_for(self, request: Request, num_new_tokens: int,
                     prefix: CachedPrefix | None = None) -> bool:
        """Grow `request`'s table to cover its next `num_new_tokens` positions.

        Covered afterwards: positions [0, start + num_new_tokens), where start is
        num_computed_tokens, plus prefix.num_cached_tokens when `prefix` is given (first
        allocation of an admission only: the request holds no blocks and has computed nothing;
        the caller then sets num_computed_tokens to prefix.num_cached_tokens). Returns False,
        changing nothing, when the pool has too few blocks. `request.block_ids` is the table,
        as a tuple replaced at each change (the same object while the table stays the same).
        """
        table = self._tables.get(request.request_id)
        if (prefix is None and table is not None and num_new_tokens >= 0
                and request.num_computed_tokens + num_new_tokens
                <= len(table.block_ids) * self.block_size):
            return True  # the common decode step: the last block still has room
        num_new_blocks = self._plan(request, num_new_tokens, prefix)
        if num_new_blocks is None:
            return False
        if table is None:
            table = self._tables[request.request_id] = _BlockTable()
        if prefix is not None:
            self._take_prefix(request.request_id, table, prefix, num_new_blocks)
        else:
            table.block_ids.extend(self.pool.allocate(num_new_blocks))
        request.block_ids = tuple(table.block_ids)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is computed (idempotent, cheap)."""
        table = self._tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(table.block_ids))
        if num_full <= table.num_published_blocks:
            return
        if len(table.block_hashes) < num_full:
            # Only the blocks not yet hashed are read, so a decode step costs O(1) here
            # except once per block_size tokens.
            parent = table.block_hashes[-1] if table.block_hashes else None
            bs = self.block_size
            for i in range(len(table.block_hashes), num_full):
                parent = block_hash(parent, request.token_ids_between(i * bs, (i + 1) * bs))
                table.block_hashes.append(parent)
        for i in range(table.num_published_blocks, num_full):
            self.pool.cache_block(table.block_ids[i], table.block_hashes[i])
        table.num_published_blocks = num_full

    def poll_loads(self) -> set[str]:
        """`loading_ids` after forgetting the copies done (once per step)."""
        for request_id in list(self.loading_ids):
            table = self._tables[request_id]
            table.loads = [done for done in table.loads if not done.query()]
            if not table.loads:
                self.loading_ids.discard(request_id)
                if not self.loading_ids:  # (a let-go table's copies may still be in flight)
                    self._loading_blocks = {b: d for b, d in self._loading_blocks.items()
                                            if not d.query()}
        return self.loading_ids

    def wait_for_a_load(self) -> bool:
        """Block until a loading table's copies are done (an engine with nothing else to
        run); False when none is loading."""
        for request_id in self.poll_loads():
            for done in self._tables[request_id].loads:
                done.synchronize()
            return True
        return False

    def free(self, request: Request) -> None:
        """Return the request's blocks; published ones stay findable until evicted."""
        self.release(request.request_id)
        request.block_ids = ()

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int]) -> Reservation:
        """Set aside blocks for a whole prompt plus one position, reusing cached prefix blocks.

        Room policy (+1): the first decode step writes the KV of the token the prefill side
        sampled, at position len(prompt); reserving it now means a request that has received
        its KV can always take its first step without allocating. Unlike
        `find_cached_prefix`, the whole prompt may be a hit: the prefill side computes the
        logits, this side only needs the KV. Raises ValueError when `can_reserve` is False
        or the id already holds blocks.
        """
        if request_id in self._tables:
            raise ValueError(f"{request_id} already holds blocks")
        prefix = self._match(prompt_token_ids, len(prompt_token_ids) // self.block_size)
        num_total = self.blocks_needed(len(prompt_token_ids) + 1)
        if self._blocks_to_take(prefix, num_total) > self.pool.num_available_blocks:
            raise ValueError(f"not enough free blocks to reserve {num_total} for {request_id}")
        table = self._tables[request_id] = _BlockTable()
        # A peer writes these blocks off the engine's stream: copies out of evicted ones first.
        tier = self.host_tier
        with tier.waiting_for_evictions() if tier is not None else nullcontext():
            self._take_prefix(request_id, table, prefix, num_total - len(prefix.block_ids))
        return Reservation(request_id=request_id, block_ids=tuple(table.block_ids),
                           num_cached_tokens=prefix.num_cached_tokens)

    def adopt_reservation(self, request: Request) -> None:
        """Make a reservation the table of `request` (same id) once its KV has arrived."""
        table = self._tables[request.request_id]
        if len(table.block_ids) * self.block_size < request.num_prompt_tokens + 1:
            raise ValueError(f"reservation of {request.request_id} is too small for its prompt")
        request.block_ids = tuple(table.block_ids)
        request.num_cached_tokens = table.num_prefix_cached_tokens

    def release(self, request_id: str) -> None:
        """End a table by id (a reservation that never joined, or a request): exactly once."""
        table = self._tables.pop(request_id)
        if request_id in self.loading_ids and (tier := self.host_tier) is not None:
            self.loading_ids.discard(request_id)
            # Its blocks may be written next; one taken as a device hit keeps its taker loading
            # until done (`_loading_blocks`): a prefill lane steps on streams not ordered here.
            for done in table.loads:
                if not done.query():
                    tier.order_writes_after(done)
        # Last block first: the LRU evicts a tail before its head (what stays is a prefix).
        self.pool.free(reversed(table.block_ids))

    def flush_offloads(self) -> None:
        """The tier's copies of the blocks released since the last step, in one batch."""
        if self.host_tier is not None:
            self.host_tier.flush()

    def drain_events(self) -> list[CacheEvent]:
        """The pool's cache events, then the host tier's (under their host-tier names)."""
        events, tier = self.pool.drain_events(), self.host_tier
        return events if tier is None else events + tier.drain_events()

    # ---- internals -----------------------------------------------------------------------

    def _match(self, token_ids: Sequence[int], max_blocks: int) -> CachedPrefix:
        block_ids: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        bs, tier = self.block_size, self.host_tier
        on_device = True  # still in the device-cached run
        for i in range(max(0, max_blocks)):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            if on_device:
                block_id = self.pool.lookup(parent)
                if block_id is not None:
                    block_ids.append(block_id)
                    hashes.append(parent)
                    continue
                on_device = False
            if tier is None or not tier.holds(parent):
                break
            hashes.append(parent)
        num_device = len(block_ids)
        return CachedPrefix(
            tuple(block_ids), tuple(hashes[:num_device]), len(hashes) * bs,
            host_block_hashes=tuple(hashes[num_device:]),
            num_missed_blocks=max(0, max_blocks - len(hashes)) if tier is not None else 0)

    def _blocks_to_take(self, prefix: CachedPrefix, num_total_blocks: int) -> int:
        """Available blocks consumed: new ones plus unreferenced cached ones revived."""
        num_revived = sum(1 for b in prefix.block_ids if self.pool.refcount(b) == 0)
        return max(0, num_total_blocks - len(prefix.block_ids)) + num_revived

    def _plan(self, request: Request, num_new_tokens: int,
              prefix: CachedPrefix | None) -> int | None:
        """New blocks `allocate_for` would take, or None when they are not available."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self._tables.get(request.request_id)
        num_held = len(table.block_ids) if table is not None else 0
        num_tokens = request.num_computed_tokens + num_new_tokens
        if prefix is not None:
            if num_held or request.num_computed_tokens:
                raise ValueError(f"{request.request_id}: a prefix is only taken at admission")
            num_tokens += prefix.num_cached_tokens
            num_taken = self._blocks_to_take(prefix, self.blocks_needed(num_tokens))
            num_new = self.blocks_needed(num_tokens) - len(prefix.block_ids)
        else:
            num_new = num_taken = max(0, self.blocks_needed(num_tokens) - num_held)
        return num_new if num_taken <= self.pool.num_available_blocks else None

    def _take_prefix(self, request_id: str, table: _BlockTable, prefix: CachedPrefix,
                     num_new_blocks: int) -> None:
        """Take the prefix's device blocks and `num_new_blocks` new ones, the first of which
        are filled from the host tier with the prefix's host blocks and published."""
        # Acquire (and pin) before any allocate: allocating first could evict these very
        # blocks, and the evictions' offers could take the host slots about to be reloaded.
        self.pool.acquire(prefix.block_ids)
        host_hashes, tier = prefix.host_block_hashes, self.host_tier
        if host_hashes:
            assert tier is not None  # only a tier's lookup finds host blocks
            tier.pin(host_hashes)
        new_block_ids = self.pool.allocate(num_new_blocks)
        loading = self._loading_blocks
        loads = list({id(d): d for b in prefix.block_ids if (d := loading.get(b)) is not None
                      and not d.query()}.values()) if loading else []
        if tier is not None:
            assert len(new_block_ids) >= len(host_hashes)  # they cover the cached tokens
            reloaded = new_block_ids[:len(host_hashes)]
            done = tier.reload(host_hashes, reloaded)
            for host_hash, block_id in zip(host_hashes, reloaded):
                self.pool.cache_block(block_id, host_hash)
                if done is not None:
                    loading[block_id] = done
            if done is not None:
                loads.append(done)
            tier.record_lookup(len(host_hashes), prefix.num_missed_blocks)
        if loads:
            table.loads = loads
            self.loading_ids.add(request_id)
        table.block_ids.extend(prefix.block_ids + tuple(new_block_ids))
        table.block_hashes.extend(prefix.block_hashes + host_hashes)
        table.num_published_blocks = len(prefix.block_ids) + len(host_hashes)
        table.num_prefix_cached_tokens = prefix.num_cached_tokens

    # ---- invariants ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.host_tier is not None:
            self.host_tier.check_invariants()
        assert self.loading_ids <= self._tables.keys(), "a loading id without a table"
        assert all(self._tables[i].loads for i in self.loading_ids)
        held = Counter(b for t in self._tables.values() for b in t.block_ids)
        for block_id in range(self.pool.num_blocks):
            assert held[block_id] == self.pool.refcount(block_id), \
                f"block {block_id}: {held[block_id]} tables hold it, refcount " \
                f"{self.pool.refcount(block_id)}"
        for request_id, table in self._tables.items():
            assert len(set(table.block_ids)) == len(table.block_ids), \
                f"{request_id} holds a block twice"
            assert table.num_published_blocks <= len(table.block_hashes) <= len(table.block_ids)
            for i, block_id in enumerate(table.block_ids):
                stored = self.pool.block_hash(block_id)
                if i < table.num_published_blocks:
                    assert stored in (None, table.block_hashes[i]), \
                        f"{request_id} block {i} is cached under a foreign hash"
                else:
                    assert stored is None, f"{request_id} block {i} is cached before computed"
