"""Every request ends in exactly one SLO outcome, measured from its arrival at the gateway."""

from __future__ import annotations

import asyncio
import json

import pytest
from gateway_harness import MODEL, ScriptedBackend

from gateway.admission.tiers import TierSpec, load_tier_config
from gateway.api.backend import TokenDelta
from gateway.api.slo_accounting import RequestTiming, SloOutcome, slo_outcome, timed_batches
from protocol.finish_reason import FinishReason

TIER = TierSpec("t", priority=0, ttft_ms=500, tpot_ms=50, max_queued=1, max_running=1,
                tokens_per_min=None)


def timing(ttft_s: float | None, gap_s: float = 0.0, tokens: int = 3,
           finished: bool = True) -> RequestTiming:
    first = None if ttft_s is None else 100.0 + ttft_s
    last = None if first is None else first + gap_s * (tokens - 1)
    return RequestTiming(TIER, 100.0, first, last, tokens if first else 0, finished)


@pytest.mark.parametrize("t, refusal, gone, outcome", [
    (timing(0.5, 0.05), None, False, SloOutcome.MET),  # both exactly at their targets
    (timing(0.501, 0.05), None, False, SloOutcome.MISSED_TTFT),
    (timing(0.2, 0.0501), None, False, SloOutcome.MISSED_TPOT),
    (timing(0.9, 0.2), None, False, SloOutcome.MISSED_BOTH),
    (timing(0.2, 9.0, tokens=1), None, False, SloOutcome.MET),  # one token: no TPOT
    (timing(None, finished=False), (429, "deadline"), False, SloOutcome.REJECTED),
    (timing(None, finished=False), (429, "rate_limit_exceeded"), False, SloOutcome.REJECTED),
    (timing(None, finished=False), (429, "shed"), False, SloOutcome.SHED),
    (timing(None, finished=False), (429, "overload"), False, SloOutcome.SHED),
    (timing(0.1, 0.01, finished=False), (503, "worker_stalled"), False, SloOutcome.FAILED),
    (timing(0.1, 0.01, finished=False), None, False, SloOutcome.FAILED),
    (timing(0.1, 0.01, finished=False), None, True, SloOutcome.ABORTED),
    (timing(0.1, 0.01), None, True, SloOutcome.MET),  # hung up after the end: answered
])
def test_each_request_gets_one_outcome(t, refusal, gone, outcome) -> None:
    assert slo_outcome(t, refusal, gone) is outcome


def test_timed_batches_note_the_first_and_last_token_and_the_finish() -> None:
    now = [10.0]

    async def source():
        yield [TokenDelta(text="a", num_tokens=1)]
        now[0] = 10.5
        yield [TokenDelta(text="b", num_tokens=1), TokenDelta(text="", num_tokens=0)]
        now[0] = 11.5
        yield [TokenDelta(text="c", num_tokens=2, finish_reason=FinishReason.STOP)]

    async def main() -> tuple[RequestTiming, list[str]]:
        t = RequestTiming(TIER, arrived_s=9.0)
        texts = [d.text async for batch in timed_batches(source(), t, lambda: now[0])
                 for d in batch]
        return t, texts

    t, texts = asyncio.run(main())
    assert texts == ["a", "b", "", "c"]
    assert (t.first_token_s, t.last_token_s, t.num_tokens, t.finished) == (10.0, 11.5, 4, True)
    assert t.ttft_s == 1.0 and t.tpot_s == pytest.approx(0.5)


TIERS = """
[tiers.easy]
priority = 0
ttft_ms = 60000
tpot_ms = 60000
max_queued = 8
max_running = 8
[tiers.strict]
priority = 1
ttft_ms = 10
tpot_ms = 1
max_queued = 8
max_running = 8
"""


def test_the_gateway_counts_outcomes_by_tier(harness_factory) -> None:
    """Tokens 60 ms apart: within the easy tier's targets, past both of the strict tier's;
    a request past its key's rate is rejected; a backend that fails is counted failed."""
    tiers = load_tier_config(TIERS, {})
    h = harness_factory(backend=ScriptedBackend(delay_s=0.06), tiers=tiers, count=True)
    for tier in ("easy", "strict"):
        status, _, raw = h.call("POST", "/v1/completions", headers={"x-pdserve-tier": tier},
                                data=json.dumps({"model": MODEL, "prompt": "hi",
                                                 "max_tokens": 3, "stream": True}))
        assert status == 200, raw
    h.backend.fail_before_first = True
    status, _, _ = h.call("POST", "/v1/completions", headers={"x-pdserve-tier": "easy"},
                          data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}))
    assert status == 503
    assert dict(h.metrics.slo) == {("easy", "met"): 1, ("strict", "missed_both"): 1,
                                   ("easy", "failed"): 1}
    assert h.metrics.arrival_ttft["strict"].num == 1
    assert h.metrics.arrival_ttft["strict"].total >= 0.06  # the first token's delay counts
    text = h.metrics.render(lambda: ())
    assert 'pdserve_gateway_slo_requests_total{tier="strict",outcome="missed_both"} 1' in text


def test_a_rate_limited_request_is_counted_rejected(harness_factory) -> None:
    tiers = load_tier_config("[tiers.standard]\ntokens_per_min = 1\n"
                             "[[keys]]\nkey = 'sk-a'\ntier = 'standard'", {})
    h = harness_factory(tiers=tiers, count=True)
    status, _, _ = h.call("POST", "/v1/completions", headers={"Authorization": "Bearer sk-a"},
                          data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}))
    assert status == 429
    assert dict(h.metrics.slo) == {("standard", "rejected"): 1}
    assert dict(h.metrics.refusals) == {(429, "rate_limit_exceeded"): 1}
