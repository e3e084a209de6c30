"""The cluster page's memory of finished requests: buckets per tier, the recent misses."""

from __future__ import annotations

import pytest

from gateway.api.request_trace import RequestRecord
from gateway.ops.request_history import RequestHistory


def record(tier: str, outcome: str, request_id: str = "r") -> RequestRecord:
    return RequestRecord(request_id=request_id, tier=tier, outcome=outcome, arrived_unix_ms=0,
                         ttft_ms=None, tpot_ms=None, num_tokens=0, route=None, workers=[],
                         stages=[], error=None, trace_id=None)


def test_outcomes_are_counted_per_tier_in_their_time_bucket() -> None:
    history = RequestHistory(bucket_s=10, num_buckets=3)
    history.observe(record("a", "met"), 1000.0)
    history.observe(record("a", "missed_ttft"), 1005.0)
    history.observe(record("b", "rejected"), 1009.9)
    history.observe(record("a", "failed"), 1010.0)
    buckets = history.attainment(1012.0)
    assert [b.start_unix_s for b in buckets] == [990, 1000, 1010]
    assert buckets[0].tiers == {}
    first = buckets[1].tiers
    assert (first["a"].met, first["a"].missed, first["b"].refused) == (1, 1, 1)
    assert buckets[2].tiers["a"].failed == 1
    history.check_invariants()


def test_old_buckets_leave_the_window_and_empty_ones_are_shown() -> None:
    history = RequestHistory(bucket_s=10, num_buckets=3)
    history.observe(record("a", "met"), 1000.0)
    assert [b.tiers for b in history.attainment(1100.0)] == [{}, {}, {}]
    history.observe(record("a", "met"), 1100.0)
    history.check_invariants()
    assert len(history._buckets) == 1


def test_only_requests_that_missed_are_kept_newest_first_and_bounded() -> None:
    history = RequestHistory(max_recent=2)
    for i, outcome in enumerate(["missed_tpot", "met", "shed", "aborted"]):
        history.observe(record("a", outcome, f"r{i}"), 1000.0 + i)
    assert [r.request_id for r in history.recent()] == ["r3", "r2"]


def test_a_clock_stepping_back_lands_in_the_newest_bucket() -> None:
    history = RequestHistory(bucket_s=10, num_buckets=3)
    history.observe(record("a", "met"), 1015.0)
    history.observe(record("a", "met"), 1002.0)
    history.check_invariants()
    assert history.attainment(1015.0)[-1].tiers["a"].met == 2


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        RequestHistory(bucket_s=0)


def test_the_window_is_the_uptime_until_the_buckets_cover_more() -> None:
    history = RequestHistory(bucket_s=10, num_buckets=3, started_unix_s=1000.0)
    assert history.window_s(1012.5) == 12.5
    assert history.window_s(2000.0) == 30
    assert history.window_s(990.0) == 0.0  # a clock that stepped back
