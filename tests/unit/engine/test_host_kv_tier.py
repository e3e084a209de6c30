"""HostKVTier: its LRU, capacity, in-flight and pinned slots; the CPU copier on real tensors;
and the KV cache manager looking past the device pool into it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from engine.block_pool import BlockPool, CacheEventKind
from engine.host_copier import STAGED_BLOCKS, SyncHostCopier, copy_blocks_to_host, slot_runs
from engine.host_kv_tier import HostKVTier
from engine.kv_cache import KVCacheManager
from engine.kv_storage import KVLayout, KVStorage
from engine.request import Request
from protocol.block_hashes import block_hashes, host_tier_hash
from protocol.sampling_params import SamplingParams

BS = 4


class Done:
    """A copy in flight that the test completes by hand (as a CUDA event would)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class ManualCopier:
    """Records which device block each host slot holds; copies stay in flight until done."""

    def __init__(self, in_flight: bool = False) -> None:
        self.in_flight = in_flight
        self.asynchronous = in_flight
        self.host: dict[int, int] = {}  # host slot -> device block it was copied from
        self.reloads: list[tuple[int, int]] = []
        self.pending: list[Done] = []
        self.waited: list[Done] = []  # copies the engine's next writes were ordered after

    def _done(self) -> Done | None:
        if not self.in_flight:
            return None
        done = Done()
        self.pending.append(done)
        return done

    def to_host(self, copies: Sequence[tuple[int, int]], before_writes: bool) -> Done | None:
        for block_id, host_slot in copies:
            self.host[host_slot] = block_id
        return self._done()

    def to_device(self, copies: Sequence[tuple[int, int]],
                  after: Sequence[Done]) -> Done | None:
        self.reloads.extend(copies)
        return self._done()

    def order_writes_after(self, done: Done) -> None:
        self.waited.append(done)


def test_lru_keeps_the_most_recent_within_capacity() -> None:
    tier = HostKVTier(2, ManualCopier(), block_bytes=10)
    assert tier.offer(101, 0) and tier.offer(102, 1)
    assert tier.offer(101, 5)  # already held: no copy, but it becomes the most recent
    assert tier.offer(103, 2)  # evicts 102, the least recently used
    assert [tier.holds(h) for h in (101, 102, 103)] == [True, False, True]
    assert tier.num_held_blocks == 2
    tier.check_invariants()
    assert tier.stats().offloaded_bytes == 30  # three copies, not four


def test_lookup_is_the_leading_run_held() -> None:
    tier = HostKVTier(4, ManualCopier(), block_bytes=1)
    for block_id, h in enumerate((1, 2, 4)):
        tier.offer(h, block_id)
    assert tier.num_leading_held([1, 2, 3, 4]) == 2
    assert tier.num_leading_held([3, 1]) == 0
    assert tier.num_leading_held([]) == 0


def test_a_slot_in_flight_is_not_evicted() -> None:
    copier = ManualCopier(in_flight=True)
    tier = HostKVTier(1, copier, block_bytes=1)
    assert tier.offer(1, 0)
    assert not tier.offer(2, 1)  # the only slot's copy is in flight: 2 is dropped
    assert tier.holds(1) and not tier.holds(2)
    assert tier.stats().num_dropped_blocks == 1
    copier.pending[0].done = True
    assert tier.offer(2, 1)  # now idle: evicted for 2
    assert tier.holds(2) and not tier.holds(1)
    tier.check_invariants()


def test_a_pinned_slot_is_not_evicted_until_reloaded() -> None:
    copier = ManualCopier()
    tier = HostKVTier(1, copier, block_bytes=1)
    tier.offer(1, 0)
    tier.pin([1])
    assert not tier.offer(2, 1)
    tier.reload([1], [7])
    assert copier.reloads == [(0, 7)]
    with pytest.raises(ValueError, match="without a pin"):
        tier.reload([1], [8])
    assert tier.offer(2, 1)
    tier.check_invariants()


def test_a_prefix_reloads_in_one_copier_call_or_not_at_all() -> None:
    copier = ManualCopier()
    tier = HostKVTier(3, copier, block_bytes=1)
    for block_hash, block_id in ((1, 0), (2, 1), (3, 2)):
        tier.offer(block_hash, block_id)
    tier.pin([1, 2])
    with pytest.raises(ValueError, match="without a pin"):
        tier.reload([1, 2, 3], [7, 8, 9])  # 3 is not pinned: nothing is copied or unpinned
    assert copier.reloads == []
    tier.reload([1, 2], [7, 8])
    assert copier.reloads == [(0, 7), (1, 8)]  # the slots the offers took, in one call
    assert tier.stats().reloaded_bytes == 2
    tier.check_invariants()


def test_reload_latencies_are_drained_once_each_copy_is_done() -> None:
    copier = ManualCopier(in_flight=True)
    tier = HostKVTier(2, copier, block_bytes=1)
    tier.offer(1, 0)
    tier.offer(2, 1)
    tier.pin([1, 2])
    tier.reload([1], [5])
    tier.reload([2], [6])
    assert tier.drain_reload_seconds() == ()  # both copies still in flight
    reload_1, reload_2 = copier.pending[-2:]
    reload_2.synchronize()
    assert tier.drain_reload_seconds() == ()  # in queue order: the first is not done yet
    reload_1.synchronize()
    assert len(seconds := tier.drain_reload_seconds()) == 2 and min(seconds) >= 0
    assert tier.drain_reload_seconds() == ()  # each once
    done_at_once = HostKVTier(1, ManualCopier(), block_bytes=1)  # copies done in the call
    done_at_once.offer(1, 0)
    done_at_once.pin([1])
    done_at_once.reload([1], [3])
    assert len(done_at_once.drain_reload_seconds()) == 1


def test_wait_for_copies_completes_every_copy() -> None:
    copier = ManualCopier(in_flight=True)
    tier = HostKVTier(2, copier, block_bytes=1)
    tier.offer(1, 0)
    tier.offer(2, 1)
    tier.wait_for_copies()
    assert all(d.done for d in copier.pending)
    assert tier.offer(3, 2)  # every slot idle again: the LRU one goes


def test_cpu_copier_round_trips_a_block_of_every_layer() -> None:
    layout = KVLayout(dtype="float32", num_layers=3, num_blocks=4, block_size=BS,
                      num_kv_heads=2, head_dim=8)
    storage = KVStorage(layout)
    storage.kv.copy_(torch.randn(storage.kv.shape))
    tier = storage.host_tier(num_bytes=2 * 3 * 2 * BS * 2 * 8 * 4)
    assert tier is not None and tier.num_host_blocks == 2
    original = storage.kv[:, :, 1].clone()
    tier.offer(42, 1)
    storage.kv[:, :, 1] = 0.0  # the device block is reused
    tier.pin([42])
    tier.reload([42], [3])
    assert torch.equal(storage.kv[:, :, 3], original)
    assert storage.host_tier(num_bytes=100) is None  # under one block: off


def test_cpu_copier_round_trips_an_fp8_pools_block_with_its_scales() -> None:
    layout = KVLayout(dtype="fp8_e4m3", num_layers=2, num_blocks=4, block_size=BS,
                      num_kv_heads=2, head_dim=8)
    storage = KVStorage(layout)
    storage.kv.copy_(torch.randint(0, 256, storage.kv.shape, dtype=torch.uint8))
    tier = storage.host_tier(num_bytes=2 * storage.kv[:, :, 0].numel())
    assert tier is not None and tier.num_host_blocks == 2
    original = storage.kv[:, :, 1].clone()  # values and scales: bytes of one block
    tier.offer(42, 1)
    storage.kv[:, :, 1] = 0
    tier.pin([42])
    tier.reload([42], [3])
    assert torch.equal(storage.kv[:, :, 3], original)


def test_sync_copier_is_done_on_return() -> None:
    kv = torch.zeros(1, 2, 2, BS, 1, 2)
    assert SyncHostCopier(kv, 1).to_host([(0, 0)], before_writes=True) is None


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tuple(prompt),
                   sampling_params=SamplingParams(max_tokens=4))


def _compute(kv: KVCacheManager, request: Request) -> None:
    prefix = kv.find_cached_prefix(request.prompt_token_ids)
    assert kv.allocate_for(request, request.num_prompt_tokens - prefix.num_cached_tokens,
                           prefix)
    request.num_computed_tokens = request.num_prompt_tokens
    kv.cache_full_blocks(request)


def test_evicted_prefix_is_found_in_the_host_tier_and_reloaded() -> None:
    copier = ManualCopier()
    kv = KVCacheManager(BlockPool(num_blocks=4, block_size=BS), HostKVTier(8, copier, 1))
    a = _request("a", list(range(13)))  # 3 full blocks + 1 token
    _compute(kv, a)
    a_blocks = a.block_ids
    kv.free(a)
    _compute(kv, b := _request("b", list(range(100, 113))))  # evicts a's three blocks
    assert kv.host_tier is not None and kv.host_tier.num_held_blocks == 3
    assert set(copier.host.values()) == set(a_blocks[:3])
    kv.free(b)
    c = _request("c", list(range(12)) + [99, 98])
    prefix = kv.find_cached_prefix(c.prompt_token_ids)
    assert prefix.block_ids == () and prefix.num_cached_tokens == 12
    assert prefix.host_block_hashes == tuple(block_hashes(list(range(12)), BS))
    assert kv.allocate_for(c, 2, prefix)
    assert [block for _, block in copier.reloads] == list(c.block_ids[:3])
    # Reloaded blocks are published: a later request finds them on the device.
    assert kv.find_cached_prefix(list(range(13))).block_ids == c.block_ids[:3]
    stats = kv.host_tier.stats()
    # a's and b's three blocks each were computed (missed), c's three came from the host.
    assert (stats.num_hit_blocks, stats.num_missed_blocks) == (3, 6)
    kv.check_invariants()
    kv.free(c)
    assert kv.num_used_blocks == 0


def test_a_reservation_takes_host_blocks_and_waits_for_the_copies_out() -> None:
    copier = ManualCopier(in_flight=True)
    kv = KVCacheManager(BlockPool(num_blocks=4, block_size=BS), HostKVTier(8, copier, 1))
    _compute(kv, a := _request("a", list(range(9))))
    kv.free(a)
    reservation = kv.reserve("d", list(range(50, 62)))  # evicts a's two blocks
    assert reservation.num_cached_tokens == 0
    assert all(d.done for d in copier.pending)  # done before a peer writes the blocks
    kv.release("d")
    reservation = kv.reserve("e", list(range(8)) + [5])
    assert reservation.num_cached_tokens == 8  # both from the host tier
    kv.check_invariants()
    kv.release("e")


def test_a_reservation_waits_only_for_the_copies_of_the_blocks_it_evicts() -> None:
    copier = ManualCopier(in_flight=True)
    kv = KVCacheManager(BlockPool(num_blocks=8, block_size=BS), HostKVTier(8, copier, 1))
    for name, start in (("a", 0), ("b", 100)):  # a's two full blocks, then b's, each copied
        _compute(kv, request := _request(name, list(range(start, start + 9))))
        kv.free(request)
        kv.flush_offloads()  # (a step between the two)
    a_copy, b_copy = copier.pending
    kv.reserve("e", list(range(200, 220)))  # 6 blocks: the 4 free, then a's 2 (the LRU's)
    assert a_copy.done and not b_copy.done, "waited for a's copies only"
    assert kv.find_cached_prefix(list(range(100, 109))).num_cached_tokens == 8  # b's stay
    kv.check_invariants()
    kv.release("e")


def test_asynchronous_copies_go_ahead_of_eviction_and_the_reuse_waits_only_if_in_flight():
    copier = ManualCopier(in_flight=True)
    kv = KVCacheManager(BlockPool(num_blocks=4, block_size=BS), HostKVTier(8, copier, 1))
    assert kv.host_tier is not None and kv.host_tier.copies_ahead
    _compute(kv, a := _request("a", list(range(9))))
    full_blocks = sorted(a.block_ids[:2])
    kv.free(a)  # two full blocks become cached-free: queued, copied at the step's flush
    assert kv.host_tier.num_held_blocks == 2 and copier.pending == []
    kv.flush_offloads()  # in one call, nobody waits
    assert len(copier.pending) == 1
    assert sorted(copier.host.values()) == full_blocks
    assert copier.waited == []
    _compute(kv, _request("b", list(range(50, 63))))  # evicts both: no second copy
    assert len(copier.pending) == 1
    assert copier.waited and all(w is copier.pending[0] for w in copier.waited), \
        "the reuse waits for the copy in flight"
    kv.check_invariants()
    # Done before the reuse: nothing waits.
    copier = ManualCopier(in_flight=True)
    kv = KVCacheManager(BlockPool(num_blocks=4, block_size=BS), HostKVTier(8, copier, 1))
    _compute(kv, a := _request("a", list(range(9))))
    kv.free(a)
    kv.flush_offloads()
    copier.pending[0].done = True
    _compute(kv, _request("b", list(range(50, 63))))
    assert len(copier.pending) == 1 and copier.waited == []
    kv.check_invariants()


def test_offers_ahead_are_queued_until_a_flush_or_anything_that_reads_them():
    copier = ManualCopier(in_flight=True)
    tier = HostKVTier(8, copier, block_bytes=1)
    assert tier.offer_ahead(11, 3) and tier.offer_ahead(12, 4)
    assert copier.host == {} and tier.holds(11) and tier.holds(12)
    tier.check_invariants()
    tier.flush()
    assert sorted(copier.host.values()) == [3, 4] and len(copier.pending) == 1
    tier.flush()  # nothing queued: no call
    assert len(copier.pending) == 1
    # An eviction of a queued block asks for its copy first, and its reuse waits for it.
    assert tier.offer_ahead(13, 5) and 5 not in copier.host.values()
    assert tier.offer(13, 5)
    assert 5 in copier.host.values() and copier.waited == [copier.pending[-1]]
    # A reload of a queued slot: the copy first, and the reload after it.
    assert tier.offer_ahead(14, 6)
    tier.pin([14])
    tier.reload([14], [7])
    assert 6 in copier.host.values() and copier.reloads[-1][1] == 7
    tier.check_invariants()
    # A queued slot is busy: with every slot queued, nothing can be evicted for a new one.
    full = HostKVTier(2, ManualCopier(in_flight=True), block_bytes=1)
    assert full.offer_ahead(1, 1) and full.offer_ahead(2, 2)
    assert not full.offer_ahead(3, 3)
    full.check_invariants()


def test_copies_done_are_forgotten_as_new_ones_start():
    copier = ManualCopier(in_flight=True)
    tier = HostKVTier(64, copier, block_bytes=1)
    for h in range(10):
        tier.offer_ahead(h, h)
        tier.flush()  # one copy each
    for done in copier.pending:
        done.done = True
    for h in range(10, 16):
        tier.offer_ahead(h, h)
        tier.flush()
    # 16 asked, 10 done: each new copy forgets up to two done ones, oldest first.
    assert len(tier._in_flight) == 16 - 10
    tier.check_invariants()


def test_the_tier_reports_what_it_takes_and_drops_under_host_tier_names():
    assert host_tier_hash(host_tier_hash(12345)) == 12345 != host_tier_hash(12345)
    kv = KVCacheManager(BlockPool(num_blocks=4, block_size=BS), HostKVTier(2, ManualCopier(), 1))
    _compute(kv, a := _request("a", list(range(13))))  # 3 full blocks
    kv.free(a)
    [h0, h1, h2] = block_hashes(list(range(13)), BS)
    kv.drain_events()
    _compute(kv, _request("b", list(range(50, 63))))  # evicts a's 3: the tier keeps 2
    events = [(e.kind, e.block_hash) for e in kv.drain_events()]
    host_events = [e for e in events if e[1] in {host_tier_hash(h) for h in (h0, h1, h2)}]
    # Evicted tail first (h2, h1, h0): the tier takes h2 and h1, then drops h2 for h0.
    assert host_events == [(CacheEventKind.INSERTED, host_tier_hash(h2)),
                           (CacheEventKind.INSERTED, host_tier_hash(h1)),
                           (CacheEventKind.EVICTED, host_tier_hash(h2)),
                           (CacheEventKind.INSERTED, host_tier_hash(h0))]
    assert (CacheEventKind.EVICTED, h0) in events  # the KV cache's own, under its own name


def _evicted_a(num_blocks: int, b_tokens: int):
    """A scheduler over a pool of `num_blocks` whose host tier holds a's three blocks (range
    13), evicted by b (`b_tokens` from 100), every copy so far done."""
    from engine.scheduler import Scheduler
    from engine.scheduler_config import SchedulerConfig

    copier = ManualCopier(in_flight=True)
    kv = KVCacheManager(BlockPool(num_blocks=num_blocks, block_size=BS), HostKVTier(8, copier, 1))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), kv)
    _compute(kv, a := _request("a", list(range(13))))
    kv.free(a)
    _compute(kv, b := _request("b", list(range(100, 100 + b_tokens))))  # evicts a's blocks
    kv.free(b)
    kv.flush_offloads()  # the next step's
    for done in copier.pending:
        done.done = True
    copier.waited.clear()  # (b's allocation waited for a's copies out)
    return copier, kv, scheduler


def test_a_reload_in_flight_holds_back_only_the_requests_that_read_its_blocks() -> None:
    copier, kv, scheduler = _evicted_a(8, 29)
    scheduler.add_request(_request("other", list(range(200, 203))))
    scheduler.add_request(_request("c", list(range(12)) + [99]))
    out = scheduler.schedule()
    # c is admitted, its three blocks reloading: it sits out; "other" computes.
    assert [chunk.request_id for chunk in out.chunks] == ["other"]
    assert kv.loading_ids == {"c"} and copier.reloads
    assert copier.waited == []  # nothing on the device waits for the reload
    scheduler.update_from_output(out, {"other": 1})
    # d shares c's reloaded (published) blocks while the copy is in flight: held back too.
    scheduler.add_request(_request("d", list(range(12)) + [77]))
    out = scheduler.schedule()
    assert {chunk.request_id for chunk in out.chunks} == {"other"}
    assert kv.loading_ids == {"c", "d"}
    scheduler.update_from_output(out, {"other": 2})
    copier.pending[-1].done = True
    out = scheduler.schedule()
    assert {chunk.request_id for chunk in out.chunks} == {"other", "c", "d"}
    # Each starts past the 12 cached tokens: they were reloaded, not recomputed.
    assert {c.request_id: c.start_pos for c in out.chunks if c.request_id != "other"} == \
        {"c": 12, "d": 12}
    assert not kv.loading_ids
    scheduler.check_invariants()


def test_a_loading_request_aborted_orders_the_next_writes_after_its_reload() -> None:
    copier, kv, scheduler = _evicted_a(4, 13)
    scheduler.add_request(_request("c", list(range(12)) + [99]))
    assert scheduler.schedule().is_empty and kv.loading_ids == {"c"}
    reload = copier.pending[-1]
    assert kv.wait_for_a_load() and reload.done  # an engine with nothing else to run waits
    scheduler.abort_request("c")
    assert copier.waited == []  # done already: nothing to order
    scheduler.add_request(_request("e", list(range(12)) + [55]))
    out = scheduler.schedule()
    assert kv.loading_ids == set()  # c's blocks are on the device now: a plain hit
    assert [(c.request_id, c.start_pos) for c in out.chunks] == [("e", 12)]
    scheduler.abort_request("e")
    scheduler.update_from_output(out, {})
    # A reload still in flight when its request ends: the next writes wait for it.
    _compute(kv, f := _request("f", list(range(300, 313))))
    kv.free(f)
    kv.flush_offloads()
    for done in copier.pending:
        done.done = True
    copier.waited.clear()
    scheduler.add_request(_request("g", list(range(100, 112)) + [1]))
    scheduler.schedule()
    assert kv.loading_ids == {"g"}
    scheduler.abort_request("g")
    reload = copier.pending[-1]
    assert copier.waited == [reload] and not kv.loading_ids
    # A request that takes g's blocks as a device hit before that copy is done waits for
    # it too (a prefill lane's steps run on a stream the wait above did not order).
    cached = kv.find_cached_prefix(list(range(100, 112)) + [2])
    assert cached.block_ids and not cached.host_block_hashes  # device hits only
    scheduler.add_request(_request("h", list(range(100, 112)) + [2]))
    assert scheduler.schedule().is_empty and kv.loading_ids == {"h"}
    reload.done = True
    out = scheduler.schedule()
    assert [(c.request_id, c.start_pos) for c in out.chunks] == [("h", cached.num_cached_tokens)]
    kv.check_invariants()


def test_slot_runs_split_a_batch_where_slots_stop_being_consecutive():
    assert slot_runs([]) == []
    assert slot_runs([4]) == [(0, 1)]
    assert slot_runs([0, 1, 2, 7, 8, 3, 2]) == [(0, 3), (3, 5), (5, 6), (6, 7)]


def test_blocks_reach_their_host_slots_in_runs_and_out_of_order():
    """More blocks than one staging buffer, slots in runs, gaps and backwards: each host
    slot holds exactly its block, in the host layout; untouched slots stay as they were."""
    kv = torch.randn(3, 2, 40, BS, 2, 4)
    host = torch.full((30, 3, 2, BS, 2, 4), -7.0)
    blocks = [37, 3, 4, 5, 20, 1, 0, 39, 8, 9, 10, 11, 12, 13, 14, 15, 16, 30, 31, 2]
    slots = [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 29, 28, 2]
    assert len(blocks) > STAGED_BLOCKS
    copy_blocks_to_host(kv, host, list(zip(blocks, slots)))
    for block_id, slot in zip(blocks, slots):
        assert torch.equal(host[slot], kv[:, :, block_id])
    untouched = sorted(set(range(30)) - set(slots))
    assert (host[untouched] == -7.0).all()
