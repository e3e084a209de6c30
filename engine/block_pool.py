"""The paged KV pool's bookkeeping: which block ids are free, shared, or kept for reuse.

Knows nothing about tensors (see `kv_storage`) or requests (see `kv_cache`): it hands out
block ids, counts references to them, and remembers which freed blocks still hold a known
prefix so a later request can take them back instead of recomputing.

Lifecycle of one block:

    FREE --allocate--> REFERENCED --free (last ref)--> FREE          (never hashed)
                       |   ^   |
           cache_block |   |   +--free (last ref)--> CACHED_FREE --acquire--> REFERENCED
                       v   |                            |
                  (hash kept) acquire                   +--allocate (evict)--> REFERENCED

    FREE         refcount 0, no hash; handed out first by `allocate`.
    REFERENCED   refcount >= 1; may carry a hash once its KV is computed (`cache_block`).
    CACHED_FREE  refcount 0 with a hash; found by `lookup`, revived by `acquire`. `allocate`
                 takes these only when no FREE block is left, least recently freed first,
                 and the eviction drops the hash (an EVICTED event) after handing the block
                 to `on_evict(hash, block_id)` when set (the host KV tier keeps a copy: the
                 block's KV is intact until the caller of `allocate` writes it). A block
                 joining CACHED_FREE is handed to `on_cached_free(hash, block_id)` when set
                 (a tier that copies ahead of eviction, off the step's path).

Invariants (`check_invariants`):
    num_free_blocks + num_referenced_blocks + num_cached_free_blocks == num_blocks
    refcounts are never negative; freeing a block whose refcount is 0 raises (a block is
    freed exactly once per reference taken)
    every hash in the prefix map names a block whose stored hash is that hash, and every
    block with a stored hash is in the map; only referenced or cached-free blocks have one
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

import msgspec

DEFAULT_BLOCK_SIZE = 16


class CacheEventKind(enum.Enum):
    INSERTED = "inserted"
    EVICTED = "evicted"


class CacheEvent(msgspec.Struct, frozen=True):
    """One change to the set of prefix hashes this pool can serve, in the order it happened."""

    kind: CacheEventKind
    block_hash: int


class BlockPool:
    """Block ids 0..num_blocks-1 with reference counts and a prefix-hash map."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Insertion order is the LRU order: the first key was freed longest ago.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._block_by_hash: dict[int, int] = {}
        self._num_referenced = 0
        self._events: list[CacheEvent] = []
        # Told of each eviction, before the block is handed out again, and of each block
        # that becomes cached-free (engine/kv_cache.py sets them to the host KV tier's).
        self.on_evict: Callable[[int, int], object] | None = None
        self.on_cached_free: Callable[[int, int], object] | None = None

    # ---- queries (side-effect free) -------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference and no cached prefix."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Blocks with no reference that still hold a cached prefix (evictable)."""
        return len(self._cached_free)

    @property
    def num_referenced_blocks(self) -> int:
        return self._num_referenced

    @property
    def num_available_blocks(self) -> int:
        """Blocks `allocate` can hand out now (free first, then evicting cached-free)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is in the prefix map, referenced or not."""
        return len(self._block_by_hash)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_available_blocks

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the prefix `block_hash`, or None. Takes no reference."""
        return self._block_by_hash.get(block_hash)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hashes[block_id]

    # ---- commands ---------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks, each with refcount 1 and no hash.

        Raises ValueError when `can_allocate(num_blocks)` is False; nothing changes then.
        """
        if not self.can_allocate(num_blocks):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: {self.num_available_blocks} available")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                self._evict(block_id)
            self._refcounts[block_id] = 1
            block_ids.append(block_id)
        self._num_referenced += num_blocks
        return block_ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block (blocks found by `lookup`, or shared ones).

        A block with refcount 0 must be cached-free: a plain free block holds nothing anyone
        could want, so acquiring it is a caller bug and raises.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self._refcounts[block_id] == 0 and block_id not in self._cached_free:
                raise ValueError(f"block {block_id} is free and holds no cached prefix")
        for block_id in block_ids:
            if self._refcounts[block_id] == 0:
                del self._cached_free[block_id]
                self._num_referenced += 1
            self._refcounts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given.

        A block whose last reference goes keeps its hash and joins the LRU tail (so blocks
        freed later are evicted later: free a sequence's blocks last-first to evict its tail
        before its head, which keeps the cached prefixes contiguous). Raises ValueError on a
        block whose refcount is already 0 (double free); blocks before it stay freed.
        """
        for block_id in block_ids:
            if self._refcounts[block_id] == 0:
                raise ValueError(f"double free of block {block_id}")
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] == 0:
                self._num_referenced -= 1
                block_hash = self._hashes[block_id]
                if block_hash is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = None
                    if self.on_cached_free is not None:
                        self.on_cached_free(block_hash, block_id)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Publish a referenced block, whose KV is computed, under `block_hash`.

        Returns False, changing nothing, when another block already serves that hash (the
        same prefix was computed twice; the first copy stays canonical). Raises when the block
        is unreferenced or already published under a different hash.
        """
        if self._refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is not referenced; only live blocks are cached")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._block_by_hash:
            return False
        self._hashes[block_id] = block_hash
        self._block_by_hash[block_hash] = block_id
        self._events.append(CacheEvent(CacheEventKind.INSERTED, block_hash))
        return True

    def drain_events(self) -> list[CacheEvent]:
        """Cache events since the last call, oldest first; the pool forgets them."""
        events, self._events = self._events, []
        return events

    def _evict(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        assert block_hash is not None  # cached-free blocks always carry a hash
        if self.on_evict is not None:
            self.on_evict(block_hash, block_id)
        del self._block_by_hash[block_hash]
        self._hashes[block_id] = None
        self._events.append(CacheEvent(CacheEventKind.EVICTED, block_hash))

    # ---- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent. O(num_blocks)."""
        free = set(self._free)
        cached_free = set(self._cached_free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached_free, "a block is both free and cached-free"
        referenced = {b for b in range(self.num_blocks) if self._refcounts[b] > 0}
        assert all(rc >= 0 for rc in self._refcounts), "negative refcount"
        assert len(referenced) == self._num_referenced, "referenced-block counter drifted"
        assert not referenced & (free | cached_free), "a referenced block is on a free list"
        assert len(free) + len(cached_free) + len(referenced) == self.num_blocks, \
            "num_free + num_referenced + num_cached_free != num_blocks"
        for block_id in free:
            assert self._hashes[block_id] is None, f"free block {block_id} keeps a hash"
        for block_id in cached_free:
            assert self._hashes[block_id] is not None, f"cached-free block {block_id} lost its hash"
        for block_hash, block_id in self._block_by_hash.items():
            assert self._hashes[block_id] == block_hash, \
                f"hash map names block {block_id}, which stores another hash"
        num_hashed = sum(h is not None for h in self._hashes)
        assert num_hashed == len(self._block_by_hash), "a hashed block is missing from the map"
