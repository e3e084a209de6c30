"""How many prefill and decode workers the coming demand needs: a forecast and a pure sizing
policy, published as the desired worker count per role (a gauge an autoscaler scales on).

    every tick   views ──pool_demand──▶ Demand ──(one Holt forecast per signal)──▶ ahead
                 (now, ahead, step models) ──size_pools──▶ PoolSizes ──hysteresis──▶ desired

Demand, over the routable workers (their load reports; ejected and draining ones count as
neither demand nor capacity):

    prefill_tokens_per_s  prompt tokens/s prefilled, plus the prompt tokens queued spread
                          over `queue_drain_s` (a queue that grows is demand not yet served)
    num_decoding          sequences decoding, with their mean context (tokens)
    num_kv_blocks         KV blocks in use on the workers that decode

Sizing (for the larger of the demand now and the forecast `horizon_s` ahead, so a rise is
met before it arrives; the step model's terms are the median over the workers that
measured them, as the router borrows them):

    prefill workers  prefill_tokens_per_s * prefill_token_s / prefill_busy
                     (a worker kept at most `prefill_busy` busy: the rest is its queueing room)
    decode workers   max(num_decoding / B*, num_kv_blocks / (kv_usage_high * blocks a worker has))
                     B* = the largest batch whose decode step base + b*B + c*B*ctx stays within
                     tpot_headroom * tpot_s, at least 1
    workers of role both or colocated serve both: the total is the two fractions added

each rounded up, and at least `min_per_role` (the total at least 1). Before any worker has
fitted a step model (a fresh cluster: 16 engine steps) there is no evidence of capacity, and
the plan is the pools as they are (`as_they_are`): no change recommended.

Hysteresis (`CapacityPlanner`): a larger count is taken at once (the forecast is the lead
time a new worker needs to start); a smaller one only when every plan of the last
`scale_down_after_s` asked for at most it, so a lull between two bursts removes nothing.

What it does not see: per-tier arrivals and the prompt/answer mix (the gateway's); the
demand is what reaches the workers, so requests refused by admission are not counted.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from agent.demand_forecast import Holt, Smoothing, updated
from agent.rebalance import RoleView
from protocol.messages import Role
from protocol.worker_load import StepModel


@dataclass(frozen=True, slots=True)
class PlanConfig:
    horizon_s: float = 120.0  # how far ahead to size: about a new worker's start-up time
    tpot_s: float = 0.05  # the strictest TPOT target the decode pool must hold
    tpot_headroom: float = 0.8  # of that target, the share a full batch's step may take
    prefill_busy: float = 0.7  # the busy share a prefill worker is sized for
    kv_usage_high: float = 0.8  # the KV share a decode worker is sized for
    queue_drain_s: float = 10.0  # a prompt queue counts as demand spread over this long
    scale_down_after_s: float = 300.0  # a fall is taken once it held this long
    min_per_role: int = 1
    smoothing: Smoothing = Smoothing()
    act: bool = False  # move roles toward the plan's split ahead of pressure (planned_move.py)

    def __post_init__(self) -> None:
        positive = (self.horizon_s, self.tpot_s, self.queue_drain_s, self.scale_down_after_s)
        if not all(0 < x < math.inf for x in positive):
            raise ValueError(f"horizon, TPOT, drain and scale-down times must be positive: "
                             f"{self}")
        if not all(0 < x <= 1 for x in (self.tpot_headroom, self.prefill_busy,
                                        self.kv_usage_high)):
            raise ValueError("headroom, busy and KV shares must be in (0, 1]")
        if self.min_per_role < 1:
            raise ValueError("min_per_role must be >= 1")


@dataclass(frozen=True, slots=True)
class Demand:
    prefill_tokens_per_s: float = 0.0
    num_decoding: float = 0.0
    context_tokens_per_seq: float = 0.0
    num_kv_blocks: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolSizes:
    prefill: int
    decode: int
    total: int  # for workers that do both (role both / colocated)
    reason: str  # the figures behind it, for the log


def pool_demand(views: Sequence[RoleView], queue_drain_s: float) -> Demand:
    """The demand on the routable workers now (module doc)."""
    routable = [v for v in views if not v.ejected]
    decoders = [v for v in routable if v.role.decodes]
    prefill = sum(v.load.prefill_tokens_per_s + v.load.num_queued_prefill_tokens / queue_drain_s
                  for v in routable)
    decoding = sum(v.load.num_decoding for v in decoders)
    context = sum(v.load.num_context_tokens for v in decoders)
    return Demand(prefill_tokens_per_s=prefill, num_decoding=decoding,
                  context_tokens_per_seq=context / decoding if decoding else 0.0,
                  num_kv_blocks=sum(v.load.num_kv_blocks_used for v in decoders))


def median_model(models: Sequence[StepModel | None]) -> StepModel | None:
    """Each term the median over the models that measured it; None without a prefill
    measurement (nothing to size the prefill pool with)."""
    known = [m for m in models if m is not None]
    prefill = [m for m in known if m.num_prefill_samples]
    decode = [m for m in known if m.num_decode_samples] or known
    if not prefill:
        return None
    return StepModel(base_s=statistics.median(m.base_s for m in decode),
                     prefill_token_s=statistics.median(m.prefill_token_s for m in prefill),
                     decode_seq_s=statistics.median(m.decode_seq_s for m in decode),
                     context_token_s=statistics.median(m.context_token_s for m in decode))


def max_decode_batch(model: StepModel, context_tokens_per_seq: float, step_limit_s: float) -> float:
    """B*: the most sequences one decode step holds within `step_limit_s` (at least 1)."""
    per_seq = model.decode_seq_s + model.context_token_s * context_tokens_per_seq
    if per_seq <= 0:
        return math.inf
    return max(1.0, (step_limit_s - model.base_s) / per_seq)


def size_pools(demand: Demand, model: StepModel, blocks_per_worker: float,
               config: PlanConfig) -> PoolSizes:
    """The workers `demand` needs (module doc), for one demand (now or ahead)."""
    prefill = demand.prefill_tokens_per_s * model.prefill_token_s / config.prefill_busy
    batch = max_decode_batch(model, demand.context_tokens_per_seq,
                             config.tpot_headroom * config.tpot_s)
    by_batch = demand.num_decoding / batch
    by_kv = demand.num_kv_blocks / (config.kv_usage_high * blocks_per_worker) \
        if blocks_per_worker > 0 else 0.0
    decode = max(by_batch, by_kv)
    floor = config.min_per_role
    return PoolSizes(
        prefill=max(floor, math.ceil(prefill - 1e-9)), decode=max(floor, math.ceil(decode - 1e-9)),
        total=max(1, math.ceil(prefill + decode - 1e-9)),
        reason=(f"prefill {demand.prefill_tokens_per_s:.0f} tokens/s at "
                f"{model.prefill_token_s * 1e6:.1f} us/token = {prefill:.2f} workers; "
                f"decode {demand.num_decoding:.1f} seqs over {demand.context_tokens_per_seq:.0f} "
                f"tokens at <= {batch:.0f} per step = {by_batch:.2f} workers, KV "
                f"{demand.num_kv_blocks:.0f} blocks = {by_kv:.2f}"))


def as_they_are(views: Sequence[RoleView], config: PlanConfig) -> PoolSizes:
    """The routable workers per role now, as a plan (at least `min_per_role` each)."""
    routable = [v for v in views if not v.ejected]
    floor = config.min_per_role
    return PoolSizes(prefill=max(floor, sum(v.role is Role.PREFILL for v in routable)),
                     decode=max(floor, sum(v.role is Role.DECODE for v in routable)),
                     total=max(1, len(routable)),
                     reason="no worker has fitted a step model yet: the pools as they are")


def larger(a: PoolSizes, b: PoolSizes) -> PoolSizes:
    """Each count the larger of the two (the reason of the one with the larger total)."""
    return PoolSizes(max(a.prefill, b.prefill), max(a.decode, b.decode), max(a.total, b.total),
                     a.reason if a.total >= b.total else b.reason)


class CapacityPlanner:
    """The forecasts and the hysteresis over `size_pools`' answers, one `observe` per tick.

    Invariants: the desired counts only rise to a plan's counts and only fall to the largest
    count planned over the last `scale_down_after_s`; `plans` holds no plan older than that.
    """

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self.forecasts: dict[str, Holt] = {}
        self.plans: deque[tuple[float, PoolSizes]] = deque()
        self.desired: PoolSizes | None = None
        self.ahead: Demand | None = None

    def observe(self, views: Sequence[RoleView], now_s: float) -> PoolSizes:
        """The desired counts after this tick's views."""
        config = self.config
        now = pool_demand(views, config.queue_drain_s)
        for name in ("prefill_tokens_per_s", "num_decoding", "num_kv_blocks"):
            self.forecasts[name] = updated(self.forecasts.get(name), getattr(now, name), now_s,
                                           config.smoothing)
        self.ahead = Demand(
            prefill_tokens_per_s=self.forecasts["prefill_tokens_per_s"].forecast(config.horizon_s),
            num_decoding=self.forecasts["num_decoding"].forecast(config.horizon_s),
            context_tokens_per_seq=now.context_tokens_per_seq,
            num_kv_blocks=self.forecasts["num_kv_blocks"].forecast(config.horizon_s))
        routable = [v for v in views if not v.ejected]
        model = median_model([v.load.step_model for v in routable])
        if model is None:
            plan = as_they_are(views, config)
        else:
            blocks = [v.load.num_kv_blocks_total for v in routable
                      if v.role.decodes and v.load.num_kv_blocks_total]
            per_worker = statistics.median(blocks) if blocks else 0.0
            plan = larger(size_pools(now, model, per_worker, config),
                          size_pools(self.ahead, model, per_worker, config))
        self.plans.append((now_s, plan))
        while self.plans and self.plans[0][0] < now_s - config.scale_down_after_s:
            self.plans.popleft()
        self.desired = self._with_hysteresis(plan)
        return self.desired

    def _with_hysteresis(self, plan: PoolSizes) -> PoolSizes:
        held = self.desired
        if held is None:
            return plan
        span = self.plans[-1][0] - self.plans[0][0]
        recent = [p for _, p in self.plans]

        def count(field: str) -> int:
            want, was = getattr(plan, field), getattr(held, field)
            if want >= was:
                return int(want)
            if span < self.config.scale_down_after_s * 0.99:
                return int(was)  # not long enough seen lower
            return int(max(getattr(p, field) for p in recent))

        return PoolSizes(count("prefill"), count("decode"), count("total"), plan.reason)
