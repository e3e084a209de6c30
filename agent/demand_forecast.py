"""A forecast of one demand signal: Holt's linear exponential smoothing (a level and a trend,
no seasonality) over samples taken at irregular times. A pure function of the samples.

For a sample x at time t, dt seconds after the previous one:

    a = 1 - 2 ** (-dt / level_half_life_s)        b = 1 - 2 ** (-dt / trend_half_life_s)
    level' = a * x + (1 - a) * (level + trend * dt)
    trend' = b * (level' - level) / dt + (1 - b) * trend          (per second)
    forecast(h) = max(0, level' + trend' * h)

Half-lives in seconds (rather than per-sample weights) make the smoothing the same whatever
the tick rate: a sample's weight halves every `level_half_life_s`. The level follows the
signal with that lag; the trend, smoothed over the longer `trend_half_life_s`, is what lets
the forecast lead it (a steady ramp of slope s is forecast h seconds ahead within about s*h
once the trend has settled; a constant signal keeps a trend that decays to 0).

Invariants: a state's time only moves forward (a sample at or before it is ignored); the
forecast is never negative (demand is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Smoothing:
    level_half_life_s: float = 20.0
    trend_half_life_s: float = 60.0

    def __post_init__(self) -> None:
        if not (0 < self.level_half_life_s < math.inf and 0 < self.trend_half_life_s < math.inf):
            raise ValueError(f"half-lives must be positive and finite: {self}")


@dataclass(frozen=True, slots=True)
class Holt:
    level: float
    trend: float  # per second
    at_s: float  # time of the newest sample

    def forecast(self, horizon_s: float) -> float:
        """The signal `horizon_s` seconds after the newest sample (>= 0)."""
        return max(0.0, self.level + self.trend * max(0.0, horizon_s))


def updated(state: Holt | None, value: float, at_s: float, smoothing: Smoothing) -> Holt:
    """The state after one more sample; the first sample starts a flat one."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"a demand sample must be a finite number >= 0, got {value}")
    if state is None:
        return Holt(level=value, trend=0.0, at_s=at_s)
    dt = at_s - state.at_s
    if dt <= 0:
        return state
    a = 1.0 - 2.0 ** (-dt / smoothing.level_half_life_s)
    b = 1.0 - 2.0 ** (-dt / smoothing.trend_half_life_s)
    level = a * value + (1.0 - a) * (state.level + state.trend * dt)
    trend = b * (level - state.level) / dt + (1.0 - b) * state.trend
    return Holt(level=level, trend=trend, at_s=at_s)
