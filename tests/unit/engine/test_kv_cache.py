"""KVCacheManager: prefix hashing, cached-prefix reuse, allocation, reservations."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import engine.kv_cache
from engine.block_pool import BlockPool, CacheEventKind
from engine.kv_cache import KVCacheManager, Reservation
from engine.request import Request
from protocol.block_hashes import block_hash, block_hashes
from protocol.sampling_params import SamplingParams

BS = 4
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(engine.kv_cache.__file__)))


def make_manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks=num_blocks, block_size=BS))


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tuple(prompt),
                   sampling_params=SamplingParams(max_tokens=4))


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does for one chunk: allocate, compute, publish."""
    assert kv.allocate_for(request, num_tokens)
    request.num_computed_tokens += num_tokens
    kv.cache_full_blocks(request)


def test_block_hash_is_pinned_and_chained() -> None:
    # Other processes (the gateway's prefix index, peer workers) compute these numbers too:
    # changing the function is a protocol change.
    first = block_hash(None, [1, 2, 3, 4])
    assert first == 9463880076314899466
    assert block_hash(first, [5, 6, 7, 8]) == 6195324147856144366
    assert block_hash(None, [5, 6, 7, 8]) != block_hash(first, [5, 6, 7, 8])
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS) == [first, block_hash(first, [5, 6, 7, 8])]
    assert 0 <= first < 2**64


def _recipe(parent: int | None, tokens: list[int]) -> int:
    """The documented recipe, written out by hand: blake2b with an 8-byte digest, read
    big-endian, over the msgpack bytes of the 2-array [parent, tokens] (nil or uint64;
    each token a msgpack uint in its shortest form, at most 15 tokens here)."""
    def uint(t: int) -> bytes:
        for limit, tag, size in ((0x80, b"", 1), (0x100, b"\xcc", 1), (0x10000, b"\xcd", 2),
                                 (0x100000000, b"\xce", 4)):
            if t < limit:
                return tag + t.to_bytes(size, "big")
        raise ValueError(t)

    head = b"\xc0" if parent is None else b"\xcf" + parent.to_bytes(8, "big")
    body = bytes([0x90 | len(tokens)]) + b"".join(uint(t) for t in tokens)
    return int.from_bytes(hashlib.blake2b(b"\x92" + head + body, digest_size=8).digest(), "big")


def test_block_hash_follows_the_documented_recipe() -> None:
    first = block_hash(None, [1, 2, 3, 4])
    assert first == _recipe(None, [1, 2, 3, 4])
    assert block_hash(first, [5, 6, 7, 8]) == _recipe(first, [5, 6, 7, 8])
    tokens = [300, 40_000, 7, 128, 0, 127, 255, 65_535, 65_536, 128_255]
    assert block_hash(first, tokens) == _recipe(first, tokens)


@pytest.mark.timeout(60)
def test_block_hash_does_not_depend_on_the_interpreter_hash_seed() -> None:
    code = "from engine.kv_cache import block_hash; print(block_hash(None, [1, 2, 3, 4]))"
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True, timeout=60, cwd=REPO_ROOT)
        outputs.add(result.stdout.strip())
    assert outputs == {"9463880076314899466"}


def test_second_request_with_same_prefix_reuses_blocks_and_skips_compute() -> None:
    kv = make_manager()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    first = make_request("a", prompt)
    compute(kv, first, len(prompt))
    events = kv.drain_events()
    assert [e.kind for e in events] == [CacheEventKind.INSERTED] * 2
    assert [e.block_hash for e in events] == block_hashes(prompt, BS)

    second = make_request("b", prompt[:8] + [99, 98, 97])
    prefix = kv.find_cached_prefix(second.all_token_ids)
    assert prefix.num_cached_tokens == 8
    assert prefix.block_ids == tuple(first.block_ids[:2])
    used_before = kv.num_used_blocks
    assert kv.allocate_for(second, 3, prefix)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert kv.num_used_blocks == used_before + 1  # only the last, partial block is new
    kv.check_invariants()


def test_cached_prefix_never_covers_the_whole_prompt() -> None:
    kv = make_manager()
    prompt = list(range(8))  # exactly two full blocks
    first = make_request("a", prompt)
    compute(kv, first, 8)
    prefix = kv.find_cached_prefix(prompt)
    # One token must remain to compute, so only the first block is reused.
    assert prefix.num_cached_tokens == 4
    assert kv.find_cached_prefix(prompt + [8]).num_cached_tokens == 8


def test_freed_blocks_stay_findable_until_evicted_tail_first() -> None:
    kv = make_manager(num_blocks=3)
    prompt = list(range(12))
    request = make_request("a", prompt)
    compute(kv, request, 12)
    kv.free(request)
    assert request.block_ids == ()
    assert kv.num_free_blocks == 3 and kv.num_used_blocks == 0
    assert kv.find_cached_prefix(prompt + [0]).num_cached_tokens == 12
    kv.drain_events()
    # Taking one block evicts the tail of the freed sequence, so the head stays a hit.
    other = make_request("b", [50, 51])
    assert kv.allocate_for(other, 2)
    assert kv.find_cached_prefix(prompt + [0]).num_cached_tokens == 8
    [event] = kv.drain_events()
    assert event.kind is CacheEventKind.EVICTED
    assert event.block_hash == block_hashes(prompt, BS)[2]
    kv.check_invariants()


def test_allocate_for_fails_without_side_effects() -> None:
    kv = make_manager(num_blocks=2)
    request = make_request("a", list(range(12)))
    assert not kv.can_allocate_for(request, 12)
    assert not kv.allocate_for(request, 12)
    assert not kv.holds_blocks("a") and kv.num_free_blocks == 2
    assert kv.allocate_for(request, 8)
    assert len(request.block_ids) == 2
    assert kv.allocate_for(request, 0)  # nothing new needed
    kv.check_invariants()


def test_growth_allocates_one_block_per_block_size_tokens() -> None:
    kv = make_manager()
    request = make_request("a", [1, 2, 3])
    compute(kv, request, 3)
    assert len(request.block_ids) == 1
    compute(kv, request, 1)  # position 3: still the first block
    assert len(request.block_ids) == 1
    request.output_token_ids.append(7)
    compute(kv, request, 1)  # position 4 opens the second block
    assert len(request.block_ids) == 2
    assert kv.usage == pytest.approx(2 / 8)
    kv.check_invariants()


def test_free_twice_raises() -> None:
    kv = make_manager()
    request = make_request("a", [1, 2, 3])
    compute(kv, request, 3)
    kv.free(request)
    with pytest.raises(KeyError):
        kv.free(request)
    kv.check_invariants()


def test_reservation_covers_prompt_plus_one_and_reuses_cached_blocks() -> None:
    kv = make_manager(num_blocks=8)
    prompt = list(range(8))
    donor = make_request("donor", prompt)
    compute(kv, donor, 8)
    kv.free(donor)
    # The whole prompt may be a hit here: the decode side needs KV, not logits.
    assert kv.can_reserve(prompt)
    reservation = kv.reserve("r1", prompt)
    assert isinstance(reservation, Reservation)
    assert reservation.num_cached_tokens == 8
    assert len(reservation.block_ids) == 3  # 9 positions
    assert reservation.block_ids[:2] == tuple(kv.find_cached_prefix(prompt + [0]).block_ids)
    kv.check_invariants()
    with pytest.raises(ValueError):
        kv.reserve("r1", prompt)
    kv.release("r1")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_reservation_refused_when_pool_is_short() -> None:
    kv = make_manager(num_blocks=2)
    prompt = list(range(8))  # needs 3 blocks with the extra position
    assert not kv.can_reserve(prompt)
    with pytest.raises(ValueError):
        kv.reserve("r", prompt)
    assert kv.num_free_blocks == 2
    kv.check_invariants()


def test_adopted_reservation_becomes_the_request_table() -> None:
    kv = make_manager()
    prompt = list(range(6))
    reservation = kv.reserve("d", prompt)
    request = make_request("d", prompt)
    kv.adopt_reservation(request)
    assert tuple(request.block_ids) == reservation.block_ids
    request.num_computed_tokens = 6
    kv.cache_full_blocks(request)
    assert kv.find_cached_prefix(prompt + [1]).num_cached_tokens == 4
    kv.free(request)
    assert not kv.holds_blocks("d")
    kv.check_invariants()


def test_the_table_count_is_the_number_of_live_tables() -> None:
    kv = KVCacheManager(BlockPool(num_blocks=16, block_size=4))
    request = Request("a", (1, 2, 3, 4, 5), SamplingParams())
    assert kv.allocate_for(request, 5)
    kv.reserve("b", [9, 9, 9])
    assert kv.num_tables == len(kv.request_ids()) == 2
    kv.free(request)
    kv.release("b")
    assert kv.num_tables == 0
