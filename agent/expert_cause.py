"""Root cause: an overloaded expert (mixture-of-experts models; pure, like agent/root_cause.py).

A worker whose model is a mixture of experts reports, per MoE layer, how much more its most
used expert took than the mean over the last window (engine/expert_load.py; its load's
`moe_imbalance`). When a tier drops and some worker's worst layer is at least
IMBALANCE_HIGH and has grown by GROWTH against the baseline, a few hot experts carry its
traffic: where experts are spread over ranks (`--ep`) their ranks are the stragglers of
every step, and the rebalancer's copies are the cure; on one device the grouped matmuls of
the hot experts grow while the others idle.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Protocol

from protocol.root_cause_report import Cause, CauseKind, StageName


class _Tick(Protocol):
    @property
    def moe_imbalance(self) -> float: ...


class _Snapshot(Protocol):
    @property
    def workers(self) -> Mapping[str, object]: ...


class Window(Protocol):
    """What this cause reads of a window (agent/root_cause.py's `Window`)."""

    @property
    def span_s(self) -> float: ...

    @property
    def snapshots(self) -> Sequence[_Snapshot]: ...

    def ticks(self, worker_id: str) -> Sequence[_Tick]: ...

IMBALANCE_HIGH = 2.0  # the busiest expert at twice the mean or more
GROWTH = 1.3  # ... and 30% above its baseline


def expert_imbalance(before: Window, now: Window) -> Cause | None:
    worst: tuple[float, str, float, float] | None = None
    for worker_id in sorted({w for s in now.snapshots for w in s.workers}):
        recent = [t.moe_imbalance for t in now.ticks(worker_id)]
        baseline = [t.moe_imbalance for t in before.ticks(worker_id)] or [1.0]
        if not recent:
            continue
        high, base = statistics.fmean(recent), statistics.fmean(baseline)
        if high >= IMBALANCE_HIGH and high >= GROWTH * base:
            score = high / IMBALANCE_HIGH * min(high / base, 2.0)
            if worst is None or score > worst[0]:
                worst = (score, worker_id, high, base)
    if worst is None:
        return None
    score, worker_id, high, base = worst
    return Cause(
        kind=CauseKind.EXPERT_IMBALANCE, score=round(score, 2), stage=StageName.DECODE_STEP,
        worker_ids=[worker_id],
        evidence=f"its busiest expert took {high:.1f}x the mean over the last "
                 f"{now.span_s:.0f} s against {base:.1f}x before (worst MoE layer)",
        action="recommend: spread the experts over ranks with --ep (hot experts are copied "
               "as the load shifts); pdserve_moe_hottest_expert names them per layer")
