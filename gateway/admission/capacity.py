"""How many requests the gateway lets run at once: adapted to what the workers sustain.

Admission (gateway/admission/admission.py) holds requests beyond `max_running_total` in per-tier
queues, most urgent first, and rejects (429) those whose predicted wait passes their
tier's TTFT target. That only sheds when the limit matches the cluster: a limit far above
it admits everything, the queues form inside the workers instead, in arrival order, and
every tier misses together. So the limit follows the workers' latency:

    every period: r = max over tiers of (recent backend TTFT p90 / the tier's TTFT target)
      r > high (1.0: a tier misses), and no cut in the last cooldown_s
                                      → limit = max(min, 0.75 · min(limit, running))
      r < low (0.4) and requests wait → limit = min(max, limit + max(1, limit / 8))
      otherwise, or no recent samples → unchanged

A tier whose requests meet their target never makes the limit smaller: the limit is cut
only for a tier that misses (r > 1), never on the way there.

The cooldown lets the window fill with samples taken under the new limit before the next
cut; without it a slow window keeps cutting down to the minimum.

Only tiers that are refused rather than served late (`TierSpec.max_wait_ms` unset, so a
request that cannot start within its TTFT target gets a 429) drive the limit
(`limit_tiers`): a tier that waits past its target is served for throughput, and cutting
the limit for it would only shrink the workers' batches while its queue grows.

The backend TTFT is measured from admission to the first token, so it is the workers'
share; the queue adds to it, and there the most urgent tier goes first. Lower tiers wait
longer and are refused early only when their own wait cannot fit their own target (429
with Retry-After), never because another tier is busy.

Protection: only while the most urgent tier is predicted or measured to miss its target,
admission sheds lower tiers at once rather than queueing them
(gateway/admission/admission.py, `set_protection`):

    predicted TTFT = the urgent tier's backend TTFT p90 + the wait its queued requests
                     have ahead of them (0 while none of them waits)
    at risk        = predicted TTFT > its target (a p90 over the target is a measured miss)
    protected until = now + hold_s after the last tick at risk (hysteresis: no flapping)

A lower tier meeting its own targets is never shed while the urgent tier meets its own.

`next_limit` and `protected_until` are the policies (pure); `TtftWindow` the recent
samples; `CapacityGovernor` the owned task that applies them. Lifecycle of the governor:
start() → a tick every `period_s` → stop() (cancelled and awaited). Invariant:
min_limit <= limit <= max_limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gateway.admission.tiers import TierSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CapacityBounds:
    min_limit: int = 4  # never fewer: a handful of requests at once is no overload
    max_limit: int = 1024
    high: float = 1.0  # TTFT p90 / target above this: a tier misses, too much runs at once
    low: float = 0.4  # below this (and requests waiting): room for more
    hold_s: float = 5.0  # protection lasts this long after the urgent tier was last at risk
    cooldown_s: float = 2.0  # at least this long between two cuts of the limit

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= max_limit")
        if not 0 < self.low < self.high:
            raise ValueError("need 0 < low < high")


def next_limit(limit: int, num_running: int, num_queued: int, pressure: float | None,
               bounds: CapacityBounds) -> int:
    """The next concurrency limit (see the module docstring); side-effect free."""
    if pressure is None:
        return limit
    if pressure > bounds.high:
        return max(bounds.min_limit, int(0.75 * min(limit, max(num_running, 1))))
    if pressure < bounds.low and num_queued > 0:
        return min(bounds.max_limit, limit + max(1, limit // 8))
    return limit


class TtftWindow:
    """Backend TTFTs of the last `window_s` seconds, by tier."""

    def __init__(self, window_s: float = 4.0, clock: Callable[[], float] = time.monotonic,
                 max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, str, float]] = deque(maxlen=max_samples)

    def observe(self, tier: str, ttft_s: float) -> None:
        self._samples.append((self._clock(), tier, ttft_s))

    def p90(self) -> dict[str, float]:
        """Each tier's 90th percentile over the window (tiers without samples are absent)."""
        cutoff = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        by_tier: dict[str, list[float]] = {}
        for _, tier, ttft_s in self._samples:
            by_tier.setdefault(tier, []).append(ttft_s)
        out = {}
        for tier, values in by_tier.items():
            values.sort()
            out[tier] = values[min(len(values) - 1, int(0.9 * len(values)))]
        return out


def predicted_pressure(p90_s: Mapping[str, float], wait_s: float,
                       targets_s: Mapping[str, float]) -> float | None:
    """max over the tiers of `targets_s` of (backend TTFT p90 + queue wait) / target: above
    1, a request of that tier arriving now is predicted to miss; None without samples and
    without a wait (pure)."""
    ratios = [(p90_s.get(tier, 0.0) + wait_s) / target for tier, target in targets_s.items()
              if tier in p90_s or wait_s > 0]
    return max(ratios, default=None)


def protected_until(now: float, until: float, urgent_predicted: float | None,
                    bounds: CapacityBounds) -> float:
    """When protection of the most urgent tier ends (see the module docstring); pure.
    `urgent_predicted`: `predicted_pressure` of the urgent tiers."""
    at_risk = urgent_predicted is not None and urgent_predicted > 1.0
    return max(until, now + bounds.hold_s) if at_risk else until


@dataclass(frozen=True, slots=True)
class GateState:
    limit: int
    num_running: int
    num_queued: int
    num_urgent_queued: int  # queued requests of the most urgent tier(s)
    urgent_wait_s: float = 0.0  # the queue wait of the urgent tier's queued requests (0: none)


def limit_tiers(specs: Iterable[TierSpec]) -> tuple[str, ...]:
    """The tiers whose TTFT drives the limit: those refused at their target (pure)."""
    return tuple(t.name for t in specs if t.wait_limit_ms <= t.ttft_ms)


def pressure(p90_s: Mapping[str, float], targets_s: Mapping[str, float]) -> float | None:
    """max over tiers of p90 / target; None without samples."""
    ratios = [p90 / targets_s[tier] for tier, p90 in p90_s.items() if tier in targets_s]
    return max(ratios, default=None)


class CapacityGovernor:
    def __init__(self, window: TtftWindow, targets_s: Mapping[str, float],
                 urgent_tiers: tuple[str, ...], get_state: Callable[[], GateState],
                 set_limit: Callable[[int], None], set_protection: Callable[[bool], None],
                 bounds: CapacityBounds = CapacityBounds(), period_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 limit_tiers: Iterable[str] | None = None) -> None:
        """`set_limit(n)` applies a limit, `set_protection(on)` protection; `limit_tiers`
        (default: every tier of `targets_s`) are the tiers whose TTFT moves the limit."""
        self.window = window
        self.targets_s = dict(targets_s)
        chosen = self.targets_s.keys() if limit_tiers is None else set(limit_tiers)
        self.limit_targets_s = {t: s for t, s in self.targets_s.items() if t in chosen}
        self.urgent_targets_s = {t: self.targets_s[t] for t in urgent_tiers}
        self.bounds = bounds
        self.period_s = period_s
        self._get_state = get_state
        self._set_limit = set_limit
        self._set_protection = set_protection
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._protected_until = float("-inf")
        self._last_cut = float("-inf")
        self.num_changes = 0
        self.protecting = False

    def tick(self) -> int:
        state = self._get_state()
        now = self._clock()
        p90 = self.window.p90()
        new = next_limit(state.limit, state.num_running, state.num_queued,
                         pressure(p90, self.limit_targets_s), self.bounds)
        if new < state.limit:
            if now - self._last_cut < self.bounds.cooldown_s:
                new = state.limit
            else:
                self._last_cut = now
        if new != state.limit:
            self.num_changes += 1
            log.info("concurrency limit %d -> %d (running %d, queued %d)", state.limit, new,
                     state.num_running, state.num_queued)
            self._set_limit(new)
        self._protected_until = protected_until(
            now, self._protected_until,
            predicted_pressure(p90, state.urgent_wait_s, self.urgent_targets_s), self.bounds)
        protecting = now < self._protected_until
        if protecting != self.protecting:
            log.info("%s shedding lower tiers early", "start" if protecting else "stop")
            self.protecting = protecting
        self._set_protection(protecting)
        return new

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("capacity governor already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="capacity")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bad tick must not end admission control
                log.exception("capacity governor tick failed")

    def check_invariants(self) -> None:
        limit = self._get_state().limit
        assert self.bounds.min_limit <= limit <= max(self.bounds.max_limit, limit)
