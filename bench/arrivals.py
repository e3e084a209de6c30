"""Seeded inter-arrival gaps for open-loop load (pure, no clock).

Gamma arrivals follow the usual serving-benchmark convention: shape = burstiness,
scale = 1 / (rate * burstiness), so the mean rate is `rate` whatever the burstiness.
burstiness = 1 is exactly Poisson (exponential gaps); < 1 is burstier (clumps of requests
and long pauses); > 1 is smoother, approaching a fixed interval.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

ArrivalKind = Literal["poisson", "gamma"]


def arrival_gaps_s(rng: random.Random, rate_rps: float, kind: ArrivalKind = "poisson",
                   burstiness: float = 1.0) -> Iterator[float]:
    """Endless gaps in seconds between successive request arrivals."""
    if rate_rps <= 0:
        raise ValueError(f"rate must be positive, got {rate_rps}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    while True:
        if kind == "poisson":
            yield rng.expovariate(rate_rps)
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate_rps * burstiness))
