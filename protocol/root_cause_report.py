"""The operations agent's root-cause report: why a tier's attainment dropped, as the agent
writes it (agent/root_cause.py) and the gateway serves it (`GET /admin/agent/reports`,
the cluster page).

A report names the tier and what triggered it (the attainment of the recent window below
the target, or below its own baseline by a margin), the windows compared, the stages whose
time grew, and the causes that explain the drop ranked by `score` (each cause's measure
over the threshold at which it counts: 1.0 is just enough, 3.0 three times that), each with
its evidence in figures and what the agent did or recommends.
"""

from __future__ import annotations

import enum

import msgspec

REPORT_VERSION = 2  # 2: the relay stage and the relay_lag cause (a reader of 1 knows neither)


class CauseKind(enum.StrEnum):
    MIX_SHIFT = "mix_shift"  # the prompts grew longer
    RATE_SURGE = "rate_surge"  # more requests arrive
    SLOW_WORKER = "slow_worker"  # one worker's steps (or stage) are slower than its peers'
    KV_PRESSURE = "kv_pressure"  # KV pools near full, reservations wait for blocks
    TRANSFER_FALLBACK = "transfer_fallback"  # KV transfers fail or take a slower path
    EXPERT_IMBALANCE = "expert_imbalance"  # a few experts of a MoE model carry the traffic
    RELAY_LAG = "relay_lag"  # the gateway's event loop runs late: every token waits for it


class StageName(enum.StrEnum):
    ADMISSION_QUEUE = "admission_queue"
    PREFILL = "prefill"  # admitted -> first token, as the gateway times it: the three below
    PREFILL_QUEUE = "prefill_queue"
    PREFILL_COMPUTE = "prefill_compute"
    KV_TRANSFER = "kv_transfer"
    DECODE_STEP = "decode_step"
    RELAY = "relay"  # of the decode gap, the gateway's: how late its event loop ran


class StageChange(msgspec.Struct, frozen=True, kw_only=True):
    """One stage's mean time (ms) in the baseline and the recent window."""

    stage: StageName
    baseline_ms: float | None  # None: not measured then
    recent_ms: float | None
    worker_ids: list[str] = []  # where it grew most (the gateway's per-worker figures)


class Cause(msgspec.Struct, frozen=True, kw_only=True):
    kind: CauseKind
    score: float
    stage: StageName  # the stage this cause makes grow
    worker_ids: list[str]  # the workers it is seen on ([]: the whole tier)
    evidence: str  # the figures, with their windows
    action: str  # what the agent did, or what it recommends


class RootCauseReport(msgspec.Struct, frozen=True, kw_only=True):
    version: int = REPORT_VERSION
    at_unix_ms: int
    tier: str
    trigger: str  # why a report: the attainment figures that fell
    baseline_s: float  # the windows compared: the baseline's length ...
    recent_s: float  # ... and the recent one's, which ends at `at_unix_ms`
    attainment_baseline: float | None  # met / finished; None: no request in the baseline
    attainment_recent: float
    num_requests_baseline: int
    num_requests_recent: int
    stages: list[StageChange]
    causes: list[Cause]  # ranked, the likeliest first; [] when nothing observed explains it

    @property
    def cause(self) -> Cause | None:
        return self.causes[0] if self.causes else None
