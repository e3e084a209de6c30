import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_storage import KVLayout
from kv_transfer.errors import LayoutMismatch
from kv_transfer.interface import TransferSpec
from kv_transfer.layout import (MESSAGE_INDEX_BITS, BlockRun, TransferPlan, check_layouts,
                                plan_runs, split_tag, tag_for)

LAYOUT = KVLayout(dtype="bfloat16", num_layers=4, num_blocks=64, block_size=16,
                  num_kv_heads=2, head_dim=8)


def spec(src, dst, begin=0, end=4):
    return TransferSpec(request_id="r", src_block_ids=src, dst_block_ids=dst,
                        layer_begin=begin, layer_end=end)


def test_runs_coalesce_only_where_both_sides_are_consecutive():
    assert plan_runs([4, 5, 6, 9, 10, 11], [0, 1, 2, 7, 3, 4]) == [
        BlockRun(4, 0, 3), BlockRun(9, 7, 1), BlockRun(10, 3, 2)]
    assert plan_runs([7], [3]) == [BlockRun(7, 3, 1)]


def test_messages_cover_exactly_the_blocks_of_each_layer_once():
    plan = TransferPlan(LAYOUT, spec([4, 5, 6, 9], [10, 11, 12, 0], 1, 3))
    messages = plan.all_messages()
    assert [m.index for m in messages] == list(range(plan.num_messages))
    covered = set()
    for m in messages:
        for k in range(m.num_bytes // LAYOUT.block_bytes):
            covered.add(m.dst_offset_bytes + k * LAYOUT.block_bytes)
    expected = {LAYOUT.offset_bytes(layer, kv, b) for layer in (1, 2) for kv in (0, 1)
                for b in (10, 11, 12, 0)}
    assert covered == expected
    assert plan.num_bytes == 2 * 2 * 4 * LAYOUT.block_bytes


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), min_size=1, max_size=20,
                      unique_by=(lambda p: p[0], lambda p: p[1])),
       begin=st.integers(0, 3), width=st.integers(1, 4))
def test_each_message_is_its_run_at_the_layouts_offsets(pairs, begin, width):
    end = min(begin + width, LAYOUT.num_layers)
    plan = TransferPlan(LAYOUT, spec([s for s, _ in pairs], [d for _, d in pairs], begin, end))
    expected = [(LAYOUT.offset_bytes(layer, kv, run.src_start),
                 LAYOUT.offset_bytes(layer, kv, run.dst_start),
                 run.num_blocks * LAYOUT.block_bytes)
                for layer in range(begin, end) for kv in (0, 1) for run in plan.runs]
    assert [(m.src_offset_bytes, m.dst_offset_bytes, m.num_bytes)
            for m in plan.all_messages()] == expected
    assert [m.index for m in plan.all_messages()] == list(range(plan.num_messages))


def test_tags_of_different_transfers_never_collide():
    tags = {tag_for(seq, i) for seq in (1, 2, 3) for i in (0, 1, (1 << MESSAGE_INDEX_BITS) - 1)}
    assert len(tags) == 9
    assert split_tag(tag_for(7, 5)) == (7, 5)
    with pytest.raises(ValueError):
        tag_for(0, 1)


@pytest.mark.parametrize("bad", [dict(src=[1, 2], dst=[1]), dict(src=[1, 2], dst=[3, 3]),
                                 dict(src=[1], dst=[1], end=5)])
def test_invalid_specs_are_refused(bad):
    with pytest.raises(ValueError):
        TransferPlan(LAYOUT, spec(bad["src"], bad["dst"], 0, bad.get("end", 4)))


def test_layout_mismatch_names_the_differing_fields():
    other = KVLayout(dtype="float16", num_layers=4, num_blocks=8, block_size=16,
                     num_kv_heads=2, head_dim=16)
    check_layouts(LAYOUT, KVLayout(**{**{f: getattr(LAYOUT, f) for f in LAYOUT.__struct_fields__},
                                      "num_blocks": 8}), "peer")  # pool size may differ
    with pytest.raises(LayoutMismatch, match="dtype.*head_dim"):
        check_layouts(LAYOUT, other, "peer")
