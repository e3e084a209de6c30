"""Goodput search: the highest request rate at which every tier keeps its SLO attainment at
or above the target (default 90%).

Search (bounded by `max_runs` runs in all):

    bracketing   start_rate, then x2 after each pass (up to max_rate), or /2 after each
                 fail (down to min_rate), until one passing and one failing rate are known
    bisection    try the midpoint of [highest pass below the lowest fail, lowest fail]
                 until the gap is within rel_tolerance of the failing rate

          pass     pass      pass  | fail
    ------o--------o---------o-----|---x------> rate
                         goodput ^ (highest pass below the lowest fail)

A pass measured above a lower fail is noise or a non-monotone server; it is kept in the
curve but never reported as goodput. `next_rate` and `goodput_of` are pure.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec

from bench.report import SCHEMA_VERSION, TOOL, RunReport


class SearchParams(msgspec.Struct, frozen=True):
    start_rate_rps: float = 1.0
    min_rate_rps: float = 0.05
    max_rate_rps: float = 1000.0
    max_runs: int = 8
    rel_tolerance: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.min_rate_rps <= self.start_rate_rps <= self.max_rate_rps:
            raise ValueError("need 0 < min_rate <= start_rate <= max_rate")
        if self.max_runs < 1 or not 0 < self.rel_tolerance < 1:
            raise ValueError("need max_runs >= 1 and 0 < rel_tolerance < 1")


class GoodputPoint(msgspec.Struct):
    rate_rps: float
    passed: bool
    attainment_by_tier: dict[str, float | None]
    report: RunReport


Bound = Literal["bracketed", "at_max_rate", "below_min_rate", "run_limit"]


class GoodputReport(msgspec.Struct):
    """JSON schema (SCHEMA_VERSION as run reports): schema_version, kind = "goodput", tool,
    attainment_target, goodput_rps (null when even min_rate failed or nothing passed),
    bound (how the search ended), num_runs, search (SearchParams), points sorted by rate,
    each with its full run report."""
    schema_version: int
    kind: str
    tool: str
    attainment_target: float
    goodput_rps: float | None
    bound: Bound
    num_runs: int
    search: SearchParams
    points: list[GoodputPoint]


def _bracket(points: list[tuple[float, bool]]) -> tuple[float | None, float | None]:
    fails = [rate for rate, passed in points if not passed]
    hi = min(fails) if fails else None
    passes = [rate for rate, passed in points if passed and (hi is None or rate < hi)]
    return (max(passes) if passes else None), hi


def goodput_of(points: list[tuple[float, bool]]) -> float | None:
    """The highest passing rate below the lowest failing rate."""
    return _bracket(points)[0]


def next_rate(points: list[tuple[float, bool]], params: SearchParams) -> float | None:
    """The next rate to measure, or None when the search is done. Side-effect free."""
    if len(points) >= params.max_runs:
        return None
    if not points:
        return params.start_rate_rps
    lo, hi = _bracket(points)
    if hi is None:  # only passes so far
        if lo >= params.max_rate_rps:  # type: ignore[operator]
            return None
        return min(lo * 2, params.max_rate_rps)  # type: ignore[operator]
    if lo is None:  # only fails so far
        if hi <= params.min_rate_rps:
            return None
        return max(hi / 2, params.min_rate_rps)
    if hi - lo <= params.rel_tolerance * hi:
        return None
    return (lo + hi) / 2


def search_bound(points: list[tuple[float, bool]], params: SearchParams) -> Bound:
    lo, hi = _bracket(points)
    if hi is None and lo is not None and lo >= params.max_rate_rps:
        return "at_max_rate"
    if lo is None and hi is not None and hi <= params.min_rate_rps:
        return "below_min_rate"
    if lo is not None and hi is not None and hi - lo <= params.rel_tolerance * hi:
        return "bracketed"
    return "run_limit"


async def search_goodput(run_at: Callable[[float], Awaitable[RunReport]],
                         params: SearchParams, attainment_target: float,
                         on_point: Callable[[GoodputPoint], None] | None = None
                         ) -> GoodputReport:
    """Measure rates chosen by `next_rate` with `run_at(rate)` until the search is done."""
    measured: list[GoodputPoint] = []
    while (rate := next_rate([(p.rate_rps, p.passed) for p in measured], params)) is not None:
        report = await run_at(rate)
        point = GoodputPoint(
            rate_rps=rate, passed=report.meets_target,
            attainment_by_tier={t: g.slo_attainment for t, g in report.tiers.items()},
            report=report)
        measured.append(point)
        if on_point is not None:
            on_point(point)
    pairs = [(p.rate_rps, p.passed) for p in measured]
    return GoodputReport(
        schema_version=SCHEMA_VERSION, kind="goodput", tool=TOOL,
        attainment_target=attainment_target, goodput_rps=goodput_of(pairs),
        bound=search_bound(pairs, params), num_runs=len(measured), search=params,
        points=sorted(measured, key=lambda p: p.rate_rps))


def format_curve(report: GoodputReport) -> str:
    tiers = sorted({t for p in report.points for t in p.attainment_by_tier})
    lines = [f"{'rate req/s':>10}  " + "  ".join(f"{t[:12]:>12}" for t in tiers)
             + "  result"]
    for p in report.points:
        cells = "  ".join(
            f"{'-' if (a := p.attainment_by_tier.get(t)) is None else f'{a:.1%}':>12}"
            for t in tiers)
        lines.append(f"{p.rate_rps:>10.3f}  {cells}  {'pass' if p.passed else 'FAIL'}")
    found = ("none (no rate passed)" if report.goodput_rps is None
             else f"{report.goodput_rps:.3f} req/s")
    lines.append(f"goodput at {report.attainment_target:.0%} SLO attainment: {found} "
                 f"[{report.bound}, {report.num_runs} runs]")
    return "\n".join(lines)
