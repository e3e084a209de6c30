"""Rebalancing the prefill and decode pools: which worker, if any, changes role. A pure policy.

    every tick     views ──pool_signals──▶ PoolSignals ──▶ history (kept by the caller)
    every period   history + views + last move ──plan_rebalance──▶ RoleMove | None

Signals, over the routable workers of each pool (an ejected or draining worker counts
nowhere; a worker of role `both` or `colocated` prefills and decodes itself, so it is in
neither pool and never a donor):

    prefill_pressure  the prefill pool's queue delay in seconds: prompt tokens queued or
                      mid-prefill on its workers / the pool's prefill capacity. A worker's
                      capacity is 1 / step_model.prefill_token_s; one whose model has seen
                      no prefill borrows its peers' mean; with none known the observed rates
                      stand in. What a new prompt waits before its prefill starts.
    prefill_busy      the share of that capacity in use: observed prefill tokens/s / capacity.
    decode_pressure   the decode pool's KV usage: blocks used / blocks in all (0..1).
No capacity known, or no KV pool known: the signal is 0 (no evidence, no pressure).

The rule (RebalanceConfig; defaults in brackets), n being the donor pool's size in a sample:

    decode -> prefill   prefill_pressure >= prefill_high_s [2 s]              prefill needs one
                        decode_pressure * n/(n-1) <= decode_low [0.5]         decode spares one
    prefill -> decode   decode_pressure >= decode_high [0.85]                 decode needs one
                        prefill_pressure * n/(n-1) <= prefill_low_s [0.5 s]   prefill spares one
                        prefill_busy * n/(n-1) <= prefill_spare_busy [0.6]

Both conditions of a direction must hold in every sample of the last `sustain_s` [20 s]:
from the newest sample at or before now - sustain_s to the newest one, none older than the
last move (evidence from before it describes a split that no longer exists). The worker
moved is the donor pool's least loaded candidate (fewest running + waiting; ties by id).

Invariants:
  * at most one move per decision, and none within `cooldown_s` [60 s] of the last one; as
    evidence must postdate the last move, two moves are at least `sustain_s` apart anyway;
  * a move never leaves its donor role with fewer than `min_per_role` [1] routable workers,
    and never picks an ejected worker, nor one of role both or colocated;
  * hysteresis: a donor gives a worker only if its signal, spread over one worker fewer,
    stays at or below its low mark, and the reverse move needs that signal at or above the
    high mark, strictly higher. Under a constant load a move is not followed by its reverse
    (for the KV share exactly; for the prefill queue, a pool at most `prefill_spare_busy`
    busy does not build a queue of `prefill_high_s` for `sustain_s`). The two directions
    exclude each other, so one history never asks for both;
  * history too short to cover `sustain_s`: no move.
Nothing here does I/O or reads a clock: `now_s` is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocol.messages import Role
from protocol.worker_load import WorkerLoad


@dataclass(frozen=True, slots=True)
class RoleView:
    """One worker as the rebalancer sees it."""

    worker_id: str
    epoch: int
    role: Role
    load: WorkerLoad
    ejected: bool = False  # out of routing now: never a candidate, not counted as capacity


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One observation of both pools, derived from the views (see the module docstring)."""

    at_s: float
    num_prefill: int  # routable workers of role prefill
    num_decode: int  # routable workers of role decode
    prefill_pressure: float  # prefill queue delay, s
    decode_pressure: float  # decode KV usage, 0..1
    prefill_busy: float = 0.0  # share of the prefill capacity in use, 0..1


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    prefill_high_s: float = 2.0  # prefill queue delay that asks for one more prefill worker
    prefill_low_s: float = 0.5  # the prefill pool spares one if its delay over n-1 stays below
    prefill_spare_busy: float = 0.6  # ... and its busy share over n-1 workers stays below
    decode_high: float = 0.85  # decode KV usage that asks for one more decode worker
    decode_low: float = 0.5  # the decode pool spares one if its KV usage over n-1 stays below
    sustain_s: float = 20.0  # how long both conditions must hold, in every sample
    cooldown_s: float = 60.0  # no move within this long of the last one
    min_per_role: int = 1  # routable workers a donor role keeps at least

    def __post_init__(self) -> None:
        floats = (self.prefill_high_s, self.prefill_low_s, self.prefill_spare_busy,
                  self.decode_high, self.decode_low, self.sustain_s, self.cooldown_s)
        if not all(math.isfinite(x) for x in floats):
            raise ValueError("rebalance thresholds must be finite numbers")
        if not 0 <= self.prefill_low_s < self.prefill_high_s:
            raise ValueError("need 0 <= prefill_low_s < prefill_high_s (hysteresis)")
        if not 0 < self.prefill_spare_busy < 1:
            raise ValueError("prefill_spare_busy must be in (0, 1)")
        if not 0 <= self.decode_low < self.decode_high <= 1:
            raise ValueError("need 0 <= decode_low < decode_high <= 1 (hysteresis)")
        if self.sustain_s <= 0 or self.cooldown_s < 0:
            raise ValueError("sustain_s must be > 0 and cooldown_s >= 0")
        if isinstance(self.min_per_role, bool) or not isinstance(self.min_per_role, int) \
                or self.min_per_role < 1:
            raise ValueError("min_per_role must be an integer >= 1")


@dataclass(frozen=True, slots=True)
class RoleMove:
    worker_id: str
    epoch: int
    from_role: Role
    to_role: Role
    reason: str  # the evidence, for the audit log


def _prefill_capacity(load: WorkerLoad) -> float | None:
    """Tokens/s this worker can prefill, from its fitted step model; None: not known."""
    m = load.step_model
    if m is None or m.prefill_token_s <= 0 or m.num_prefill_samples == 0:
        return None
    return 1.0 / m.prefill_token_s


def _prefill_signals(loads: Sequence[WorkerLoad]) -> tuple[float, float]:
    """(queue delay s, busy share) of a prefill pool."""
    queued = sum(load.num_queued_prefill_tokens for load in loads)
    rate = sum(load.prefill_tokens_per_s for load in loads)
    known = [c for load in loads if (c := _prefill_capacity(load)) is not None]
    capacity = sum(known) * len(loads) / len(known) if known else rate
    if capacity <= 0:
        return 0.0, 0.0
    return queued / capacity, min(1.0, rate / capacity)


def pool_signals(views: Sequence[RoleView], now_s: float) -> PoolSignals:
    """The pools' signals at `now_s`; side-effect free."""
    prefill = [v.load for v in views if v.role == Role.PREFILL and not v.ejected]
    decode = [v.load for v in views if v.role == Role.DECODE and not v.ejected]
    delay_s, busy = _prefill_signals(prefill)
    total = sum(load.num_kv_blocks_total for load in decode)
    used = sum(load.num_kv_blocks_used for load in decode if load.num_kv_blocks_total > 0)
    return PoolSignals(at_s=now_s, num_prefill=len(prefill), num_decode=len(decode),
                       prefill_pressure=delay_s, decode_pressure=used / total if total else 0.0,
                       prefill_busy=busy)


def _spread(value: float, n: int) -> float:
    """`value` of a pool of n, carried by n - 1 workers."""
    return value * n / (n - 1) if n >= 2 else math.inf


def _prefill_wanted(s: PoolSignals, cfg: RebalanceConfig) -> bool:
    return s.prefill_pressure >= cfg.prefill_high_s and \
        _spread(s.decode_pressure, s.num_decode) <= cfg.decode_low


def _decode_wanted(s: PoolSignals, cfg: RebalanceConfig) -> bool:
    return s.decode_pressure >= cfg.decode_high and \
        _spread(s.prefill_pressure, s.num_prefill) <= cfg.prefill_low_s and \
        _spread(s.prefill_busy, s.num_prefill) <= cfg.prefill_spare_busy


def _prefill_evidence(span: Sequence[PoolSignals], cfg: RebalanceConfig) -> str:
    s = span[-1]
    return (f"prefill queue delay {s.prefill_pressure:.1f} s over {s.num_prefill} prefill "
            f"worker(s), >= {cfg.prefill_high_s:g} s in all {len(span)} samples of the last "
            f"{s.at_s - span[0].at_s:.0f} s (least {min(x.prefill_pressure for x in span):.1f} "
            f"s); decode KV usage {s.decode_pressure:.0%} would be "
            f"{_spread(s.decode_pressure, s.num_decode):.0%} over {s.num_decode - 1} decode "
            f"worker(s) (<= {cfg.decode_low:.0%})")


def _decode_evidence(span: Sequence[PoolSignals], cfg: RebalanceConfig) -> str:
    s = span[-1]
    return (f"decode KV usage {s.decode_pressure:.0%} over {s.num_decode} decode worker(s), "
            f">= {cfg.decode_high:.0%} in all {len(span)} samples of the last "
            f"{s.at_s - span[0].at_s:.0f} s (least {min(x.decode_pressure for x in span):.0%}); "
            f"prefill queue delay {s.prefill_pressure:.1f} s and busy {s.prefill_busy:.0%} "
            f"would be {_spread(s.prefill_pressure, s.num_prefill):.1f} s and "
            f"{_spread(s.prefill_busy, s.num_prefill):.0%} over {s.num_prefill - 1} prefill "
            f"worker(s) (<= {cfg.prefill_low_s:g} s, <= {cfg.prefill_spare_busy:.0%})")


Wanted = Callable[[PoolSignals, RebalanceConfig], bool]
Evidence = Callable[[Sequence[PoolSignals], RebalanceConfig], str]
# (donor role, taker role, the test every sample must pass, its evidence)
_DIRECTIONS: tuple[tuple[Role, Role, Wanted, Evidence], ...] = (
    (Role.DECODE, Role.PREFILL, _prefill_wanted, _prefill_evidence),
    (Role.PREFILL, Role.DECODE, _decode_wanted, _decode_evidence))


def sustained_span(history: Sequence[PoolSignals], last_move_s: float | None, now_s: float,
                   sustain_s: float) -> list[PoolSignals] | None:
    """The samples that must all agree: from the newest one at or before now - sustain_s to
    the newest one, none older than the last move; None if the history does not reach back
    that far (or holds nothing newer)."""
    samples = sorted((s for s in history if s.at_s <= now_s
                      and (last_move_s is None or s.at_s > last_move_s)), key=lambda s: s.at_s)
    start = now_s - sustain_s
    first = next((i for i in range(len(samples) - 1, -1, -1) if samples[i].at_s <= start), None)
    if first is None or samples[-1].at_s <= start:
        return None
    return samples[first:]


def plan_rebalance(history: Sequence[PoolSignals], views: Sequence[RoleView],
                   last_move_s: float | None, now_s: float, cfg: RebalanceConfig
                   ) -> RoleMove | None:
    """At most one role change, or None; side-effect free. `history` holds this caller's
    PoolSignals (any order; the newest should be of `views`), `views` the workers now."""
    if last_move_s is not None and now_s - last_move_s < cfg.cooldown_s:
        return None
    span = sustained_span(history, last_move_s, now_s, cfg.sustain_s)
    if span is None:
        return None
    for donor, taker, wanted, evidence in _DIRECTIONS:
        if not all(wanted(s, cfg) for s in span):
            continue
        routable = [v for v in views if v.role == donor and not v.ejected]
        if len(routable) - 1 < cfg.min_per_role:
            return None
        pick = least_loaded(routable)
        return RoleMove(pick.worker_id, pick.epoch, donor, taker,
                        f"{evidence(span, cfg)}; {pick.worker_id} is the least loaded "
                        f"{donor.value} worker ({pick.load.num_running} running, "
                        f"{pick.load.num_waiting} waiting)")
    return None


def least_loaded(views: Sequence[RoleView]) -> RoleView:
    """The worker a role move takes: the fewest running + waiting requests, ties by id."""
    return min(views, key=lambda v: (v.load.num_running + v.load.num_waiting, v.worker_id))
