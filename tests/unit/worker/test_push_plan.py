"""Which blocks a prefill worker pushes: only the prompt's, minus what the decode side holds."""

from __future__ import annotations

import pytest

from worker.handoff import plan_push


def test_sends_every_prompt_block_when_nothing_is_held() -> None:
    # 40 tokens, block 16: 3 blocks (the last partial); the reservation has a 4th? no: 41 pos.
    spec = plan_push("r", [10, 11, 12], [5, 6, 7], 0, 40, 16, num_layers=30)
    assert spec.src_block_ids == [10, 11, 12] and spec.dst_block_ids == [5, 6, 7]
    assert spec.layers == range(0, 30)


def test_skips_blocks_the_destination_holds_and_the_extra_decode_position() -> None:
    # 48 tokens = exactly 3 blocks; the reservation holds 4 (position 48 for token 1).
    spec = plan_push("r", [1, 2, 3], [20, 21, 22, 23], 2, 48, 16, num_layers=2)
    assert spec.src_block_ids == [3] and spec.dst_block_ids == [22]


def test_nothing_to_send_when_the_whole_prompt_is_held() -> None:
    assert plan_push("r", [1, 2], [7, 8, 9], 2, 32, 16, num_layers=2) is None


def test_too_few_blocks_on_either_side_is_an_error() -> None:
    with pytest.raises(ValueError, match="prefill side"):
        plan_push("r", [1], [7, 8], 0, 20, 16, num_layers=2)
    with pytest.raises(ValueError, match="destination"):
        plan_push("r", [1, 2], [7], 0, 20, 16, num_layers=2)
