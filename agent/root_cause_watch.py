"""The owner of root-cause reports in the control loop: it keeps the snapshots the
attribution compares (agent/root_cause.py) and decides when a tier gets a report.

Per tick (`tick`, after the observer's read): the gateways' tallies published since the
last tick (state/tier_tallies.py; Redis away: read at the next tick) and what the agent saw of each worker become one
`Snapshot`; snapshots older than both windows are dropped; then, per tier:

    QUIET ──(a drop)──▶ PENDING ──(a cause found, or the drop lasted recent_s)──▶ REPORTED
      ▲                    │                                                       │
      └──(recent window has min_requests and no drop; or no drop seen for baseline_s)┘

so a tier gets at most one report per episode (a drop and its recovery), not one per tick;
a drop without a cause yet is given one recent window for the evidence to show. A window
with too few requests to tell leaves the state as it is (for at most `baseline_s`).

Invariants (`check_invariants`): snapshots are in time order and none is older than
`baseline_s + recent_s`; `reports` holds at most `max_reports`, newest first; every
REPORTED tier's report is among those ever emitted (its latest is `latest[tier]`).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.health_rules import WorkerSample, peer_step_s
from agent.observer import Lapsed
from agent.root_cause import attribute, dropped
from agent.root_cause_window import RootCauseConfig, Snapshot, WorkerTick, split, windows
from protocol.agent_messages import HealthReport
from protocol.root_cause_report import RootCauseReport
from protocol.tier_tally import GatewayTally, TierTally, merged
from state.agent_state import now_unix_ms
from state.redis_state import REDIS_FAILURES, raise_if_cancelling
from state.tier_tallies import TallyStream


class Episode(enum.Enum):
    PENDING = "pending"
    REPORTED = "reported"


@dataclass(frozen=True, slots=True)
class _Open:
    state: Episode
    since_s: float  # the drop first seen
    seen_s: float  # ... last seen


def tier_tallies(tallies: Sequence[GatewayTally]) -> dict[str, TierTally]:
    """Every replica's tallies of this tick, merged per tier."""
    by_tier: dict[str, list[TierTally]] = {}
    for tally in tallies:
        for tier, counts in tally.tiers.items():
            by_tier.setdefault(tier, []).append(counts)
    return {tier: merged(counts) for tier, counts in by_tier.items()}


def worker_ticks(samples: Sequence[WorkerSample], reports: Mapping[str, HealthReport],
                 previous: Mapping[str, HealthReport], ejected_for: Mapping[str, str]
                 ) -> dict[str, WorkerTick]:
    """Each worker at this tick, its counters against its previous report of the same
    epoch (none: nothing counted yet)."""
    out = {}
    for sample in samples:
        report = reports.get(sample.worker_id)
        then = previous.get(sample.worker_id)
        if report is not None and then is not None and then.epoch != report.epoch:
            then = None

        def delta(name: str) -> float:
            if report is None or then is None:
                return 0
            return max(0, getattr(report, name) - getattr(then, name))

        out[sample.worker_id] = WorkerTick(
            worker_id=sample.worker_id, role=sample.role, step_s=sample.step_time_s,
            peer_step_s=peer_step_s(sample, samples) if sample.step_time_s else None,
            kv_usage=report.load.kv_usage if report and report.load.num_kv_blocks_total
            else 0.0,
            num_kv_waits=int(delta("num_kv_waits")),
            num_kv_waiting=report.num_kv_waiting if report else 0,
            num_transfers_mapped=int(delta("num_transfers_mapped")),
            num_transfers_carrier=int(delta("num_transfers_carrier")),
            transfer_s=delta("transfer_sum_s"),
            num_transfer_failures=int(delta("num_transfer_failures")),
            ejected_for=ejected_for.get(sample.worker_id),
            moe_imbalance=max(report.load.moe_imbalance, default=1.0) if report else 1.0)
    return out


class RootCauseWatch:
    def __init__(self, config: RootCauseConfig, tallies: TallyStream | None = None,
                 max_reports: int = 50) -> None:
        self.config = config
        self.tallies = tallies  # None: fed by hand (tests)
        self._tallies_after: str | None = None  # the last tally entry read
        self.max_reports = max_reports
        self.snapshots: deque[Snapshot] = deque()
        self.episodes: dict[str, _Open] = {}
        self.reports: deque[RootCauseReport] = deque(maxlen=max_reports)  # newest first
        self.latest: dict[str, RootCauseReport] = {}
        self._previous: dict[str, HealthReport] = {}

    async def tick(self, now_s: float, observed: Sequence[WorkerSample | Lapsed],
                   reports: Mapping[str, HealthReport], ejected_for: Mapping[str, str]
                   ) -> list[RootCauseReport]:
        """Read the tallies the gateways published since the last tick, then `observe`."""
        tallies: list[GatewayTally] = []
        if self.tallies is not None:
            try:
                self._tallies_after, tallies = await self.tallies.read_after(
                    self._tallies_after)
            except REDIS_FAILURES as exc:
                raise_if_cancelling(exc)  # read next tick: the entries stay in the stream
        samples = [s for s in observed if isinstance(s, WorkerSample)]
        return self.observe(now_s, now_unix_ms(), tallies, samples, reports, ejected_for)

    def observe(self, now_s: float, now_unix_ms: int, tallies: Sequence[GatewayTally],
                samples: Sequence[WorkerSample], reports: Mapping[str, HealthReport],
                ejected_for: Mapping[str, str]) -> list[RootCauseReport]:
        """Take this tick's snapshot; the reports it brings (at most one per tier)."""
        workers = worker_ticks(samples, reports, self._previous, ejected_for)
        # A worker that missed this tick's question counts from its last answer next time.
        self._previous = {w: r for w, r in {**self._previous, **reports}.items()
                          if w in workers}
        return self.take(Snapshot(now_s, tier_tallies(tallies), workers), now_unix_ms)

    def take(self, snapshot: Snapshot, now_unix_ms: int) -> list[RootCauseReport]:
        """Keep `snapshot` (the newest), drop what both windows left behind, and judge."""
        self.snapshots.append(snapshot)
        keep_from = snapshot.at_s - self.config.recent_s - self.config.baseline_s
        while self.snapshots and self.snapshots[0].at_s < keep_from:
            self.snapshots.popleft()
        return self._judge(snapshot.at_s, now_unix_ms)

    def _judge(self, now_s: float, now_unix_ms: int) -> list[RootCauseReport]:
        config = self.config
        baseline, recent = split(list(self.snapshots), now_s, config)
        tiers = sorted({t for s in self.snapshots for t in s.tiers} | set(self.episodes))
        emitted = []
        for tier in tiers:
            before, now = windows(tier, baseline, recent, config)
            trigger = dropped(before, now, config)
            episode = self.episodes.get(tier)
            if trigger is None:
                # Recovered (the next drop is news), or quiet since long before.
                if now.tally.num_requests >= config.min_requests or (
                        episode is not None and now_s - episode.seen_s > config.baseline_s):
                    self.episodes.pop(tier, None)
                continue
            since = now_s if episode is None else episode.since_s
            state = Episode.PENDING if episode is None else episode.state
            episode = self.episodes[tier] = _Open(state, since, now_s)
            if episode.state is Episode.REPORTED:
                continue
            report = attribute(tier, baseline, recent, now_unix_ms, config)
            if report is None:
                continue
            if report.causes or now_s - episode.since_s >= config.recent_s:
                self.episodes[tier] = _Open(Episode.REPORTED, episode.since_s, now_s)
                self.reports.appendleft(report)
                self.latest[tier] = report
                emitted.append(report)
        return emitted

    def check_invariants(self) -> None:
        times = [s.at_s for s in self.snapshots]
        assert times == sorted(times), "snapshots out of order"
        if times:
            span = times[-1] - times[0]
            assert span <= self.config.recent_s + self.config.baseline_s, \
                f"snapshots span {span:.1f} s"
        assert len(self.reports) <= self.max_reports
        for tier, episode in self.episodes.items():
            if episode.state is Episode.REPORTED:
                assert tier in self.latest, f"{tier} reported without a report"
