"""The early-prefill policy: prefill beside the reservation only where D has room."""

from __future__ import annotations

from gateway.upstream.handoff import EARLY_PREFILL_ROOM, should_prefill_early
from protocol.worker_load import WorkerLoad


def load(used: int, total: int) -> WorkerLoad:
    return WorkerLoad(num_kv_blocks_used=used, num_kv_blocks_total=total)


def test_early_where_the_decode_worker_has_room_for_the_prompt_twice_over() -> None:
    # 100 tokens + 1 position, block 16: 7 blocks; room for 2 x 7 = 14 is needed.
    assert EARLY_PREFILL_ROOM == 2
    assert should_prefill_early(100, 16, load(used=86, total=100))  # 14 free
    assert not should_prefill_early(100, 16, load(used=87, total=100))  # 13 free
    assert should_prefill_early(100, 16, load(used=0, total=1000))


def test_not_early_without_a_load_report_or_with_an_unknown_pool() -> None:
    assert not should_prefill_early(100, 16, None)
    assert not should_prefill_early(100, 16, load(used=0, total=0))


def test_a_prompt_of_exactly_whole_blocks_counts_its_first_decode_position() -> None:
    # 32 tokens + 1 = 33 positions: 3 blocks of 16, so 6 must be free.
    assert should_prefill_early(32, 16, load(used=94, total=100))
    assert not should_prefill_early(32, 16, load(used=95, total=100))
