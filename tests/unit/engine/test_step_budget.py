"""A step that decodes takes the prompt tokens its decodes' tightest TPOT target leaves, by
the worker's step model (engine/step_budget.py), and the scheduler applies it."""

from __future__ import annotations

import pytest

from engine.request import Request
from engine.step_budget import MIN_PREFILL_TOKENS, holds_tpot, prefill_token_budget
from protocol.sampling_params import SamplingParams
from protocol.worker_load import StepModel
from tests.unit.engine.test_scheduler import BS, make, step

# 5 ms + 1 ms per decoding row + 20 us per prompt token: a 256-token chunk is 5.1 ms.
MODEL = StepModel(base_s=0.005, prefill_token_s=2e-5, decode_seq_s=0.001, context_token_s=0.0,
                  num_samples=64, num_prefill_samples=32, num_decode_samples=32)


def test_the_budget_is_what_the_target_leaves_after_the_decode_rows() -> None:
    # 4 rows: 9 ms of the 0.9 x 20 ms = 18 ms: 9 ms left, 450 prompt tokens.
    assert prefill_token_budget(MODEL, 4, 400, 0.020, 2048) == 450
    assert prefill_token_budget(MODEL, 4, 400, 0.020, 300) == 300  # never above the fixed one
    # A tighter target leaves less; never below the floor, so a prompt always progresses.
    assert prefill_token_budget(MODEL, 4, 400, 0.0105, 2048) == MIN_PREFILL_TOKENS
    assert prefill_token_budget(MODEL, 4, 400, 0.010, 8) == 8


def test_a_target_the_decodes_miss_anyway_or_nothing_to_judge_by_keeps_the_fixed_budget() -> None:
    assert prefill_token_budget(MODEL, 40, 4000, 0.020, 2048) == 2048  # 45 ms of decodes alone
    assert prefill_token_budget(None, 4, 400, 0.020, 2048) == 2048
    assert prefill_token_budget(MODEL, 0, 0, 0.020, 2048) == 2048  # nothing decodes
    assert prefill_token_budget(MODEL, 4, 400, None, 2048) == 2048  # no row has a target
    unfitted = StepModel(base_s=0.005, prefill_token_s=0.0, decode_seq_s=0.001,
                         context_token_s=0.0, num_samples=32, num_decode_samples=32)
    assert prefill_token_budget(unfitted, 4, 400, 0.020, 2048) == 2048
    assert prefill_token_budget(MODEL, 4, 400, 0.020, 0) == 0


def test_only_tpot_holds_tpot_until_it_is_measured_on_a_gpu() -> None:
    assert not holds_tpot("auto", "cuda:0") and not holds_tpot("auto", "cpu")
    assert holds_tpot("tpot", "cpu") and not holds_tpot("fixed", "cuda")
    with pytest.raises(ValueError):
        holds_tpot("sometimes", "cuda")


def _decoding_and_a_long_prompt(hold_tpot: bool, tpot_s: float | None) -> list[int]:
    """Two requests decoding, then a 400-token prompt arrives: the prompt tokens of each
    step until it is computed."""
    scheduler, checker = make(num_blocks=256, max_num_batched_tokens=256, hold_tpot=hold_tpot)
    scheduler.step_model = MODEL
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, tuple(range(1, 2 * BS)), SamplingParams(max_tokens=200),
                                      tpot_s=tpot_s))
    for _ in range(3):
        step(scheduler, checker)  # both prefilled and decoding
    scheduler.add_request(Request("long", tuple(range(400)), SamplingParams(max_tokens=2)))
    chunks = []
    while scheduler.get_request("long").num_computed_tokens < 400:
        out = step(scheduler, checker)
        chunks.append(sum(len(c.token_ids) for c in out.chunks if c.request_id == "long"))
    return chunks


def test_the_scheduler_holds_its_decodes_target_and_prefills_with_what_is_left() -> None:
    # 2 rows: 7 ms; a 10 ms target x 0.9 leaves 2 ms: 100 prompt tokens a step.
    assert _decoding_and_a_long_prompt(True, 0.010) == [100, 100, 100, 100]
    # The fixed budget (256, less the two decode tokens) where off, or without targets.
    assert _decoding_and_a_long_prompt(False, 0.010) == [254, 146]
    assert _decoding_and_a_long_prompt(True, None) == [254, 146]
