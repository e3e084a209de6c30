"""The agent's recorded ticks and the windows root-cause attribution compares (pure).

Once a tick the agent records a `Snapshot`: each tier's requests finished since the last
tick (protocol/tier_tally.py) and a `WorkerTick` per worker. `split` cuts the recorded
snapshots into the baseline and the recent window (`RootCauseConfig`'s lengths), `windows`
merges each into a `Window`, over the time it actually covers (agent/root_cause.py
attributes a drop between the two). Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from protocol.messages import Role
from protocol.tier_tally import TierTally, merged


@dataclass(frozen=True, slots=True)
class RootCauseConfig:
    recent_s: float = 10.0
    baseline_s: float = 60.0
    min_requests: int = 5
    attainment_target: float = 0.9
    attainment_margin: float = 0.15
    surge_ratio: float = 1.5
    mix_ratio: float = 1.5
    slow_ratio: float = 2.0
    kv_usage_high: float = 0.9
    carrier_shift: float = 0.25
    transfer_ratio: float = 2.0
    relay_ms_high: float = 10.0  # the gateway's loop lag that counts as a relay problem

    def __post_init__(self) -> None:
        if min(self.recent_s, self.baseline_s) <= 0 or self.min_requests < 1:
            raise ValueError("windows must be > 0 and min_requests >= 1")
        if not 0 < self.attainment_target <= 1 or not 0 < self.attainment_margin < 1:
            raise ValueError("attainment target in (0, 1], margin in (0, 1)")
        if min(self.surge_ratio, self.mix_ratio, self.slow_ratio, self.transfer_ratio) <= 1:
            raise ValueError("ratios must be > 1")
        if self.relay_ms_high <= 0:
            raise ValueError("relay_ms_high must be > 0")
        if not 0 < self.kv_usage_high <= 1 or not 0 < self.carrier_shift <= 1:
            raise ValueError("kv_usage_high and carrier_shift must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class WorkerTick:
    """One worker at one tick; counters are the increase since the previous tick."""

    worker_id: str
    role: Role | None
    step_s: float | None = None  # mean decode-only step since the last tick
    peer_step_s: float | None = None  # what its role's peers take for that shape
    kv_usage: float = 0.0  # used / total blocks
    num_kv_waits: int = 0  # reservations that waited in line for free blocks
    num_kv_waiting: int = 0  # ... waiting now
    num_transfers_mapped: int = 0  # KV pushes it completed through the mapped pool
    num_transfers_carrier: int = 0  # ... through a carrier (the fallback)
    transfer_s: float = 0.0  # their time
    num_transfer_failures: int = 0
    ejected_for: str | None = None  # the rule the agent holds it out for; None: routable
    moe_imbalance: float = 1.0  # its worst MoE layer's busiest expert over the mean


@dataclass(frozen=True, slots=True)
class Snapshot:
    at_s: float  # the agent's monotonic clock at the tick
    tiers: Mapping[str, TierTally]  # requests finished since the previous tick
    workers: Mapping[str, WorkerTick]


@dataclass(frozen=True, slots=True)
class Window:
    """A run of snapshots, merged: what attribution compares."""

    span_s: float
    tally: TierTally
    snapshots: Sequence[Snapshot]

    @classmethod
    def of(cls, tier: str, snapshots: Sequence[Snapshot], span_s: float) -> Window:
        return cls(span_s, merged([s.tiers[tier] for s in snapshots if tier in s.tiers]),
                   snapshots)

    @property
    def attainment(self) -> float | None:
        n = self.tally.num_requests
        return self.tally.num_met / n if n else None

    @property
    def rate_per_s(self) -> float:
        return self.tally.num_requests / self.span_s if self.span_s > 0 else 0.0

    @property
    def prompt_tokens(self) -> float | None:
        t = self.tally
        return t.num_prompt_tokens / t.num_prompts if t.num_prompts else None

    def ticks(self, worker_id: str) -> list[WorkerTick]:
        return [s.workers[worker_id] for s in self.snapshots if worker_id in s.workers]


def covered_s(snapshots: Sequence[Snapshot], until_s: float, nominal_s: float) -> float:
    """The time `snapshots` (ending at `until_s`) cover: the nominal window, or less for an
    agent that started within it (a rate over it is not diluted by time it did not see).
    A snapshot's tallies cover the tick before it."""
    if not snapshots:
        return nominal_s
    tick_s = snapshots[1].at_s - snapshots[0].at_s if len(snapshots) > 1 else 1.0
    return max(tick_s, min(nominal_s, until_s - snapshots[0].at_s + tick_s))


def split(snapshots: Sequence[Snapshot], now_s: float, config: RootCauseConfig
          ) -> tuple[list[Snapshot], list[Snapshot]]:
    """(baseline, recent): the snapshots of each window, oldest first."""
    recent_from = now_s - config.recent_s
    baseline_from = recent_from - config.baseline_s
    return ([s for s in snapshots if baseline_from < s.at_s <= recent_from],
            [s for s in snapshots if s.at_s > recent_from])


def windows(tier: str, baseline: Sequence[Snapshot], recent: Sequence[Snapshot],
            config: RootCauseConfig) -> tuple[Window, Window]:
    """The baseline and recent windows of `tier`, each over the time it covers."""
    now_s = recent[-1].at_s if recent else baseline[-1].at_s if baseline else 0.0
    recent_from = now_s - config.recent_s
    return (Window.of(tier, baseline, covered_s(baseline, recent_from, config.baseline_s)),
            Window.of(tier, recent, covered_s(recent, now_s, config.recent_s)))
