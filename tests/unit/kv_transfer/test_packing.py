import asyncio

import pytest
import torch

from engine.kv_storage import KVLayout, KVStorage
from kv_transfer.interface import TransferSpec
from kv_transfer.packing import (PackedPlan, Packing, PackingLimits, block_index, choose_packing,
                                 gather, scatter)
from kv_transfer.staging import StagingPool

LAYOUT = KVLayout(dtype="bfloat16", num_layers=6, num_blocks=32, block_size=4,
                  num_kv_heads=2, head_dim=8)  # block_bytes = 128


def spec(src, dst, begin=0, end=6):
    return TransferSpec(request_id="r", src_block_ids=src, dst_block_ids=dst,
                        layer_begin=begin, layer_end=end)


def choose(s, slot=1 << 20, min_message=0, below=1 << 20):
    return choose_packing(LAYOUT, s, slot_bytes=slot,
                          min_message_bytes=min_message, pack_below_run_bytes=below)


def test_policy_packs_small_runs_and_by_default_always_on_cuda():
    fragmented = spec([1, 5, 9], [2, 6, 10])
    assert choose(fragmented, below=128) is None  # runs of one 128-byte block: not < 128
    # No minimum message size: one layer (K and V of 3 blocks, 768 bytes) per message.
    assert choose(fragmented, below=129) == Packing(layers_per_message=1, blocks_per_message=3)
    one_run = spec(list(range(30)), list(range(30)))  # one run of 3840 bytes
    assert choose(one_run, below=PackingLimits.for_device(True).pack_below_run_bytes) == \
        Packing(layers_per_message=1, blocks_per_message=30)
    assert choose(one_run, below=3840) is None and choose(one_run, below=0) is None


def test_policy_groups_layers_to_the_minimum_and_splits_blocks_over_the_slot():
    s = spec([1, 5, 9], [2, 6, 10])  # one layer: 2 * 3 * 128 = 768 bytes
    assert choose(s, min_message=1500) == Packing(layers_per_message=2, blocks_per_message=3)
    assert choose(s, min_message=10**6, slot=3 * 768) == Packing(layers_per_message=3,
                                                                  blocks_per_message=3)
    assert choose(s, slot=512) == Packing(layers_per_message=1, blocks_per_message=2)


def test_packed_messages_cover_every_layer_and_block_once_in_index_order():
    plan = PackedPlan(LAYOUT, spec([1, 5, 9, 10, 11], [0, 3, 7, 8, 20], 1, 6),
                      Packing(layers_per_message=2, blocks_per_message=2))
    messages = plan.all_messages()
    assert [m.index for m in messages] == list(range(plan.num_messages)) == list(range(9))
    cells = [(l, b) for m in messages for l in range(m.layer_begin, m.layer_end)
             for b in range(m.block_begin, m.block_end)]
    assert sorted(cells) == [(l, b) for l in range(1, 6) for b in range(5)]
    assert sum(m.num_bytes for m in messages) == plan.num_bytes
    assert plan.group_of(5) == 2 and list(plan.group_layers(2)) == [5]
    with pytest.raises(ValueError):
        plan.group_of(0)


def test_gather_then_scatter_moves_exactly_the_spec_blocks():
    src, dst = KVStorage(LAYOUT), KVStorage(LAYOUT)
    src.kv.view(torch.int16).random_()
    dst.kv.fill_(7.0)
    before = dst.kv.clone()
    s = spec([3, 4, 20, 0], [9, 1, 2, 30], 1, 5)
    plan = PackedPlan(LAYOUT, s, Packing(layers_per_message=3, blocks_per_message=3))
    si, di = block_index(s.src_block_ids, "cpu"), block_index(s.dst_block_ids, "cpu")
    slot = torch.empty(plan.max_message_bytes, dtype=torch.uint8)
    for m in plan.all_messages():
        gather(src.kv, m, si, slot)
        scatter(dst.kv, m, di, slot)
    for a, b in zip(s.src_block_ids, s.dst_block_ids):
        assert torch.equal(dst.kv[1:5, :, b].view(torch.int16),
                           src.kv[1:5, :, a].view(torch.int16))
    touched = torch.zeros_like(dst.kv, dtype=torch.bool)
    touched[1:5, :, s.dst_block_ids] = True
    assert torch.equal(dst.kv[~touched], before[~touched])  # poisoned elsewhere: untouched


def test_staging_pool_is_bounded_fifo_and_releases_exactly_once():
    async def main():
        pool = StagingPool("cpu", slot_bytes=64, num_slots=2)
        a, b = pool.try_acquire(), pool.try_acquire()
        assert pool.try_acquire() is None and pool.slot(a).numel() == 64
        waiter = asyncio.ensure_future(pool.acquire())
        cancelled = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        pool.release(a)
        assert await waiter == a
        pool.check_invariants()
        with pytest.raises(KeyError):
            pool.release(12345)
        pool.release(a), pool.release(b)
        assert pool.num_acquired == 0
        pool.check_invariants()
    asyncio.run(main())
