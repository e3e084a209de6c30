"""The gateway's per-tier tally of finished requests, which the operations agent's
root-cause reports read (gateway/ops/tier_tally_book.py, protocol/tier_tally.py)."""

from __future__ import annotations

import msgspec

from gateway.api.request_trace import RequestRecord, Stage
from gateway.ops.tier_tally_book import TierTallyBook
from protocol.tier_tally import GatewayTally, merged


def record(outcome: str, workers: list[str], stages: list[Stage], tpot_ms: float | None = 20.0,
           tier: str = "standard", num_prompt_tokens: int = 100) -> RequestRecord:
    return RequestRecord(request_id="r", tier=tier, outcome=outcome, arrived_unix_ms=0,
                         ttft_ms=None, tpot_ms=tpot_ms, num_tokens=8, route="split",
                         workers=workers, stages=stages, error=None, trace_id=None,
                         num_prompt_tokens=num_prompt_tokens)


SPLIT = [Stage("queued", 0.0, 4.0), Stage("route", 4.0, 4.0),
         Stage("prefill", 4.0, 104.0), Stage("decode", 104.0, 300.0)]
RETRIED = [Stage("queued", 0.0, 2.0), Stage("retry", 50.0, 50.0, "transfer on p0: worker_error"),
           Stage("prefill", 2.0, 302.0)]


def test_stages_are_summed_per_tier_and_per_worker_and_taken_once() -> None:
    book = TierTallyBook(stream=None)
    book.observe(record("met", ["p0", "d0"], SPLIT))
    book.observe(record("missed_tpot", ["p0", "d1"], SPLIT, tpot_ms=80.0, num_prompt_tokens=300))
    book.observe(record("missed_ttft", ["p0", "d0"], RETRIED, tpot_ms=None))
    book.observe(record("rejected", [], [], tpot_ms=None, tier="batch"))
    taken = book.take(now_unix_ms=5000)
    assert taken is not None and book.take(now_unix_ms=6000) is None  # each request once
    standard, batch = taken.tiers["standard"], taken.tiers["batch"]
    assert (standard.num_met, standard.num_missed, standard.num_requests) == (1, 2, 3)
    assert (batch.num_refused, batch.num_prompts, batch.prefill.count) == (1, 0, 0)
    assert standard.admission_queue.mean_ms == 10 / 3
    assert standard.prefill.mean_ms == (100 + 100 + 300) / 3
    assert standard.decode.mean_ms == 50.0 and standard.decode.count == 2
    assert standard.decode_by_worker["d1"].mean_ms == 80.0
    assert standard.prefill_by_worker["p0"].count == 3
    assert standard.num_transfer_retries == 1
    assert standard.num_prompt_tokens / standard.num_prompts == 500 / 3
    # The wire form decodes to the same figures, and tallies of replicas add up.
    again = msgspec.json.decode(msgspec.json.encode(taken), type=GatewayTally)
    total = merged([again.tiers["standard"], standard])
    assert total.num_requests == 6 and total.decode_by_worker["d0"].count == 2


def test_the_prefill_workers_queue_is_its_own_stage_for_split_prompts_only() -> None:
    book = TierTallyBook(stream=None)
    queued = [*SPLIT, Stage("prefill_queue", 4.0, 34.0, "on p0")]
    book.observe(record("met", ["p0", "d0"], queued))
    book.observe(record("met", ["p0", "d0"], SPLIT))  # a worker that did not say
    local = RequestRecord(request_id="l", tier="standard", outcome="met", arrived_unix_ms=0,
                          ttft_ms=None, tpot_ms=20.0, num_tokens=8, route="local",
                          workers=["d0"], stages=queued, error=None, trace_id=None)
    book.observe(local)  # the last attempt prefilled locally: an earlier queue is not its
    taken = book.take(now_unix_ms=1000)
    assert taken is not None
    standard = taken.tiers["standard"]
    assert (standard.prefill_queue.count, standard.prefill_queue.mean_ms) == (1, 30.0)
    assert standard.prefill.count == 3


def test_the_relay_stage_is_the_loop_lag_while_each_request_streamed() -> None:
    from gateway.ops.loop_lag import LoopLag

    lag = LoopLag(period_s=0.05)
    for i in range(40):  # one sample every 50 ms from t = 0: 1 ms late, then 30 ms from 1 s
        lag.record(i * 0.05, 1.0 if i < 20 else 30.0)
    book = TierTallyBook(stream=None, lag=lag)
    # SPLIT streams from 104 ms to 300 ms after its arrival: samples 3..6, all 1 ms late.
    book.observe(record("met", ["p0", "d0"], SPLIT))
    late = [Stage("queued", 0.0, 4.0), Stage("prefill", 4.0, 1200.0),
            Stage("decode", 1200.0, 1500.0)]
    book.observe(record("met", ["p0", "d0"], late))
    book.observe(record("met", ["p0", "d0"], SPLIT, tpot_ms=None))  # one token: no gap
    taken = book.take(now_unix_ms=2000)
    assert taken is not None
    relay = taken.tiers["standard"].relay
    assert relay.count == 2 and relay.mean_ms == (1.0 + 30.0) / 2


def test_the_loop_lag_mean_is_over_the_window_or_the_next_sample() -> None:
    from gateway.ops.loop_lag import LoopLag, mean_in_window

    times, total = [1.0, 2.0, 3.0, 4.0], [2.0, 6.0, 12.0, 20.0]  # lags 2, 4, 6, 8
    assert mean_in_window(times, total, 2.0, 3.0) == 5.0
    assert mean_in_window(times, total, 2.2, 2.5) == 6.0  # none inside: the next one's
    assert mean_in_window(times, total, 0.0, 9.0) == 5.0
    assert mean_in_window(times, total, 4.5, 9.0) is None
    small = LoopLag(period_s=1.0, keep_s=2.0)
    for i in range(20):  # older samples are dropped; the means stay right
        small.record(float(i), float(i))
    assert small.mean_ms(17.0, 19.0) == 18.0 and small.mean_ms(-1.0, 0.5) is not None
