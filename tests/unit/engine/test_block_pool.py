"""BlockPool: allocation order, reference counts, prefix map, LRU eviction, cache events."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool, CacheEvent, CacheEventKind


def test_allocate_and_free_return_blocks_to_the_pool() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert (pool.num_referenced_blocks, pool.num_free_blocks) == (3, 1)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(ValueError):
        pool.allocate(2)
    pool.check_invariants()  # the failed allocate changed nothing
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.num_referenced_blocks == 0
    pool.check_invariants()


def test_double_free_raises() -> None:
    pool = BlockPool(num_blocks=2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free([block])
    pool.check_invariants()


def test_shared_block_is_freed_once_per_reference() -> None:
    pool = BlockPool(num_blocks=2)
    [block] = pool.allocate(1)
    pool.cache_block(block, 111)
    pool.acquire([block])
    assert pool.refcount(block) == 2
    pool.free([block])
    assert pool.num_referenced_blocks == 1  # still held by the other owner
    pool.free([block])
    assert pool.num_cached_free_blocks == 1
    with pytest.raises(ValueError):
        pool.free([block])
    pool.check_invariants()


def test_cached_free_blocks_are_reused_only_when_no_plain_block_is_left() -> None:
    pool = BlockPool(num_blocks=3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([a, b, c])  # c has no hash: plain free
    assert (pool.num_free_blocks, pool.num_cached_free_blocks) == (1, 2)
    assert pool.allocate(1) == [c]
    assert pool.lookup(1) == a and pool.lookup(2) == b  # nothing evicted yet
    assert pool.drain_events() == [CacheEvent(CacheEventKind.INSERTED, 1),
                                   CacheEvent(CacheEventKind.INSERTED, 2)]
    # The oldest cached-free block goes first, and its hash leaves the map.
    assert pool.allocate(1) == [a]
    assert pool.lookup(1) is None and pool.lookup(2) == b
    assert pool.drain_events() == [CacheEvent(CacheEventKind.EVICTED, 1)]
    assert pool.drain_events() == []
    pool.check_invariants()


def test_acquire_revives_a_cached_free_block_and_keeps_it_from_eviction() -> None:
    pool = BlockPool(num_blocks=2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 10)
    pool.cache_block(b, 20)
    pool.free([a, b])
    pool.acquire([pool.lookup(10)])
    assert pool.num_available_blocks == 1
    assert pool.allocate(1) == [b]  # a is referenced again, so b is the only candidate
    assert pool.lookup(10) == a and pool.lookup(20) is None
    pool.check_invariants()


def test_acquire_of_a_plain_free_block_raises() -> None:
    pool = BlockPool(num_blocks=2)
    with pytest.raises(ValueError):
        pool.acquire([0])
    pool.check_invariants()


def test_duplicate_prefix_keeps_the_first_copy() -> None:
    pool = BlockPool(num_blocks=2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    assert pool.cache_block(a, 7)  # idempotent
    with pytest.raises(ValueError):
        pool.cache_block(a, 8)
    pool.free([a, b])
    assert (pool.num_cached_free_blocks, pool.num_free_blocks) == (1, 1)
    pool.check_invariants()


def test_cache_events_encode_for_publishing() -> None:
    event = CacheEvent(CacheEventKind.EVICTED, 2**64 - 1)
    data = msgspec.msgpack.encode(event)
    assert msgspec.msgpack.decode(data, type=CacheEvent) == event


def test_an_unreferenced_block_cannot_be_cached() -> None:
    pool = BlockPool(num_blocks=1)
    with pytest.raises(ValueError):
        pool.cache_block(0, 5)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "acquire"]),
                          st.integers(0, 5), st.integers(0, 6)), max_size=60))
def test_random_operations_keep_invariants_and_match_a_model(ops) -> None:
    """Against a plain model of who holds what: counts and prefix hits always agree."""
    pool = BlockPool(num_blocks=6, block_size=4)
    held: list[int] = []  # one entry per reference taken
    for op, n, key in ops:
        if op == "alloc":
            if pool.can_allocate(n):
                got = pool.allocate(n)
                assert not set(got) & set(held), "allocate returned a referenced block"
                held.extend(got)
            else:
                with pytest.raises(ValueError):
                    pool.allocate(n)
        elif op == "free" and held:
            pool.free([held.pop(n % len(held))])
        elif op == "cache" and held:
            block = held[n % len(held)]
            if pool.block_hash(block) is None:
                pool.cache_block(block, key)
        elif op == "acquire":
            block = pool.lookup(key)
            if block is not None:
                pool.acquire([block])
                held.append(block)
        pool.check_invariants()
        assert pool.num_referenced_blocks == len(set(held))
        assert all(pool.refcount(b) == held.count(b) for b in set(held))
    pool.free(held)
    assert pool.num_available_blocks == pool.num_blocks
    pool.check_invariants()
