"""The goodput search policy (pure) and its driver, against a synthetic server curve."""

import asyncio
from types import SimpleNamespace

import pytest

from bench.goodput import SearchParams, format_curve, goodput_of, next_rate, search_goodput


def _search(threshold_rps: float, params: SearchParams) -> list[tuple[float, bool]]:
    points: list[tuple[float, bool]] = []
    while (rate := next_rate(points, params)) is not None:
        points.append((rate, rate <= threshold_rps))
    return points


@pytest.mark.parametrize("threshold", [0.3, 1.0, 7.3, 55.0, 400.0])
def test_search_converges_within_tolerance_and_run_budget(threshold):
    params = SearchParams(start_rate_rps=1.0, max_runs=14, rel_tolerance=0.05)
    points = _search(threshold, params)
    assert len(points) <= params.max_runs
    found = goodput_of(points)
    assert found <= threshold
    assert found >= threshold * (1 - 0.05) / 1.0001


def test_search_stops_at_the_run_limit():
    params = SearchParams(start_rate_rps=1.0, max_runs=3, rel_tolerance=0.01)
    points = _search(100.0, params)
    assert [r for r, _ in points] == [1.0, 2.0, 4.0]
    assert goodput_of(points) == 4.0


def test_search_limits_at_max_and_min_rate():
    params = SearchParams(start_rate_rps=1.0, min_rate_rps=0.25, max_rate_rps=3.0,
                          max_runs=20)
    points = _search(1000.0, params)
    assert [r for r, _ in points] == [1.0, 2.0, 3.0]
    points = _search(0.01, params)
    assert [r for r, _ in points] == [1.0, 0.5, 0.25]
    assert goodput_of(points) is None


def test_a_pass_above_a_fail_is_never_reported():
    # Noise: 4 failed but 6 passed. Goodput must stay below the lowest failure.
    points = [(1.0, True), (2.0, True), (4.0, False), (6.0, True)]
    assert goodput_of(points) == 2.0
    assert next_rate(points, SearchParams(max_runs=10)) == 3.0


def test_driver_records_the_curve():
    calls = []

    async def run_at(rate):
        calls.append(rate)
        attainment = 1.0 if rate <= 5.0 else 0.5
        return SimpleNamespace(meets_target=attainment >= 0.9,
                               tiers={"interactive": SimpleNamespace(slo_attainment=attainment)})

    params = SearchParams(start_rate_rps=1.0, max_runs=8, rel_tolerance=0.1)
    report = asyncio.run(search_goodput(run_at, params, 0.9))
    assert report.num_runs == len(calls) <= 8
    assert 4.5 <= report.goodput_rps <= 5.0
    assert report.bound == "bracketed"
    assert [p.rate_rps for p in report.points] == sorted(calls)
    curve = format_curve(report)
    assert "FAIL" in curve and "pass" in curve and "goodput at 90%" in curve
