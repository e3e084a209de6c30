"""The token relay across attempts: exactly-once ids, the splice check, aborts, finish."""

from __future__ import annotations

import pytest

from gateway.api.metrics import GatewayMetrics
from gateway.upstream.relay import StreamEnd, TokenRelay
from protocol.finish_reason import FinishReason
from protocol.messages import PrefillResult, TokenFrame, TransferStatus, Usage
from protocol.sampling_params import SamplingParams


class Tokenizer:
    """Token id n reads "<n>"."""

    max_token_chars = 8

    def first_token_text(self, prompt, token_id, params, finished) -> str:
        return f"<{token_id}>"

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"


def frame(*ids: int, finish: FinishReason | None = None, total: int | None = None) -> TokenFrame:
    return TokenFrame(request_id="r", token_ids=list(ids), text="".join(f"<{i}>" for i in ids),
                      finish_reason=finish,
                      usage=Usage(num_prompt_tokens=3, num_completion_tokens=total)
                      if total is not None else None)


def relay(max_tokens: int = 10) -> tuple[TokenRelay, GatewayMetrics]:
    metrics = GatewayMetrics()
    return TokenRelay("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens), Tokenizer(),
                      metrics), metrics


def test_tokens_across_a_migration_reach_the_client_once_and_the_count_checks() -> None:
    r, metrics = relay()
    first = r.first_token(PrefillResult(request_id="r", first_token_id=7, num_prompt_tokens=3,
                                        num_cached_tokens=0,
                                        transfer_status=TransferStatus.PENDING))
    assert first.text == "<7>" and r.token_ids == [7]
    deltas, end = r.frames([frame(8), frame(9)], "d0")
    assert [d.text for d in deltas] == ["<8>", "<9>"] and end is StreamEnd.OPEN
    # d0 dies here; d1 resumes after [7, 8, 9] and counts them in its usage.
    deltas, end = r.frames([frame(10), frame(11, finish=FinishReason.STOP, total=5)], "d1")
    assert [d.text for d in deltas] == ["<10>", "<11>"]
    assert deltas[-1].finish_reason is FinishReason.STOP and end is StreamEnd.FINISHED
    assert r.token_ids == [7, 8, 9, 10, 11] and r.finished
    assert metrics.num_splice_mismatches == 0
    r.check_invariants()


def test_a_usage_that_disagrees_is_counted() -> None:
    r, metrics = relay()
    r.frames([frame(1), frame(2, finish=FinishReason.LENGTH, total=3)], "d0")
    assert metrics.num_splice_mismatches == 1


def test_an_abort_frame_keeps_the_tokens_before_it_and_ends_open() -> None:
    r, _ = relay()
    deltas, end = r.frames([frame(4), TokenFrame(request_id="r", token_ids=[],
                                                 finish_reason=FinishReason.ABORT), frame(5)],
                           "d0")
    assert [d.text for d in deltas] == ["<4>"] and end is StreamEnd.ABORTED
    assert r.token_ids == [4] and not r.finished


def test_a_first_token_that_finishes_ends_the_relay() -> None:
    r, _ = relay(max_tokens=1)
    delta = r.first_token(PrefillResult(
        request_id="r", first_token_id=3, num_prompt_tokens=3, num_cached_tokens=0,
        transfer_status=TransferStatus.SKIPPED, finish_reason=FinishReason.LENGTH))
    assert delta.finish_reason is FinishReason.LENGTH and r.finished


def test_more_tokens_than_max_tokens_break_the_invariant() -> None:
    r, _ = relay(max_tokens=2)
    r.frames([frame(1, 2, 3)], "d0")
    with pytest.raises(AssertionError, match="max_tokens"):
        r.check_invariants()


def test_a_frame_with_per_token_texts_becomes_one_delta_per_token() -> None:
    r, metrics = relay()
    merged = TokenFrame(request_id="r", token_ids=[4, 5, 6], texts=["a", "", "bc"])
    deltas, end = r.frames([merged], "d0")
    assert [(d.text, d.num_tokens) for d in deltas] == [("a", 1), ("", 1), ("bc", 1)]
    last = TokenFrame(request_id="r", token_ids=[7, 8], texts=["d", "e"],
                      finish_reason=FinishReason.LENGTH,
                      usage=Usage(num_prompt_tokens=3, num_completion_tokens=5))
    deltas, end = r.frames([last], "d0")
    assert [d.finish_reason for d in deltas] == [None, FinishReason.LENGTH]
    assert end is StreamEnd.FINISHED and r.token_ids == [4, 5, 6, 7, 8]
    assert metrics.num_splice_mismatches == 0


def test_per_token_texts_that_do_not_match_the_ids_become_one_delta() -> None:
    r, _ = relay()
    odd = TokenFrame(request_id="r", token_ids=[4, 5], texts=["a", "b", "c"])
    deltas, _ = r.frames([odd], "d0")
    assert [(d.text, d.num_tokens) for d in deltas] == [("abc", 2)]


def test_the_finish_carries_the_prefilling_workers_cache_hits() -> None:
    # Handed off: the prefill worker's count, whatever the decode worker reports.
    r, _ = relay()
    first = r.first_token(PrefillResult(request_id="r", first_token_id=7, num_prompt_tokens=3,
                                        num_cached_tokens=2,
                                        transfer_status=TransferStatus.PENDING))
    assert first.num_cached_tokens is None  # only the last delta carries it
    last = TokenFrame(request_id="r", token_ids=[8], text="<8>", finish_reason=FinishReason.STOP,
                      usage=Usage(num_prompt_tokens=3, num_completion_tokens=3,
                                  num_cached_tokens=0))
    deltas, _ = r.frames([frame(9), last], "d0")
    assert [d.num_cached_tokens for d in deltas] == [None, 2]
    # Prefilled by the decode worker: its usage says.
    local, _ = relay()
    last = TokenFrame(request_id="r", token_ids=[8], text="<8>", finish_reason=FinishReason.STOP,
                      usage=Usage(num_prompt_tokens=3, num_completion_tokens=1,
                                  num_cached_tokens=1))
    deltas, _ = local.frames([last], "d0")
    assert deltas[-1].num_cached_tokens == 1
