"""What the operations agent concludes about a worker: detection rules as pure functions.

Each rule reads a window of samples (what the agent saw of one worker at each tick, oldest
first) and returns a `Detection` with its evidence, or None. Nothing here does I/O or
reads a clock: `now_s` is passed in, so the rules are tested with hand-written windows.

    dead         the process is gone, or its registry lease is about to lapse while its
                 control API does not answer either (heartbeats stopped: a killed, frozen
                 or partitioned worker) — act before it expires
    hung         alive and leased, but no engine step for `hung_after_s` while it has
                 running requests, or its control API missed its deadline that long: at
                 every tick since the last one at least `hung_after_s` ago (`covering`)
    slow         its decode steps take `slow_factor` x what its role's peers take for the
                 same shape: the median of the peers' fitted step models (StepModel)
                 evaluated at its own mean batch and context (peers without a model yet
                 count with their measured step time), at every tick for `slow_for_s`
                 over at least `slow_min_steps` steps; its own step is the longer of the
                 device's time and the wall time per step (a host that feeds its GPU late)
    leaked_kv    KV blocks held with nothing running or waiting for `leak_after_s`
    error_spike  at least `error_rate` of its requests failed over the window

Invariants: a rule only compares samples of one epoch (a restarted worker starts clean);
a window of fewer than two samples of the current epoch proves nothing but `dead`.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from protocol.messages import Role
from protocol.worker_load import StepModel


class Rule(enum.StrEnum):
    DEAD = "dead"
    HUNG = "hung"
    SLOW = "slow"
    LEAKED_KV = "leaked_kv"
    ERROR_SPIKE = "error_spike"


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker as the agent saw it at one tick."""

    at_s: float  # the agent's monotonic clock when it read this
    worker_id: str
    epoch: int
    role: Role | None  # None: its lease lapsed, and its registry entry (its role) with it
    lease_left_s: float | None  # None: no lease in the registry any more
    process_alive: bool | None  # None: not known (the worker runs on another host)
    control_ok: bool  # its control API answered within the deadline
    num_steps: int = 0  # engine steps of this epoch so far
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    step_time_s: float | None = None  # recent mean decode-only step (device or wall, the
    # longer: agent/observer.py DecodeSteps); None: none yet
    step_shape: tuple[float, float] | None = None  # those steps' mean (batch, context tokens)
    step_model: StepModel | None = None  # its own fitted step model (what peers are told)
    num_requests: int = 0  # requests this epoch has ended, in all
    num_failed: int = 0  # of those, failed ones


@dataclass(frozen=True, slots=True)
class Thresholds:
    lease_margin_s: float = 1.0  # "about to lapse": less than this left
    hung_after_s: float = 3.0
    slow_factor: float = 3.0
    slow_min_step_s: float = 0.005  # faster than this is never "slow", whatever the peers
    slow_for_s: float = 10.0  # an outlier at every tick this long
    slow_min_steps: int = 5  # ... over at least this many engine steps
    leak_after_s: float = 30.0  # longer than a transfer's stage deadline
    error_rate: float = 0.5
    error_min_requests: int = 10

    def __post_init__(self) -> None:
        if min(self.lease_margin_s, self.hung_after_s, self.leak_after_s, self.slow_for_s) <= 0:
            raise ValueError("thresholds in seconds must be > 0")
        if self.slow_factor <= 1:
            raise ValueError("slow_factor must be > 1")
        if not 0 < self.error_rate <= 1:
            raise ValueError("error_rate must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class Detection:
    worker_id: str
    epoch: int
    rule: Rule
    evidence: str  # what was seen, for the audit log


def current_epoch(window: Sequence[WorkerSample]) -> list[WorkerSample]:
    """The samples of the latest epoch in the window, oldest first."""
    if not window:
        return []
    epoch = window[-1].epoch
    return [s for s in window if s.epoch == epoch]


def covering(samples: Sequence[WorkerSample], start_s: float) -> list[WorkerSample] | None:
    """The samples that cover [start_s, now]: the newest one taken at or before `start_s`
    and every later one; None when the samples do not reach back that far (or there are
    fewer than two).

    Anchored at the old end by a sample, not cut at `start_s`: ticks come every period
    plus the time a tick takes (~1.007 s, not 1 s), so the samples taken after `start_s`
    span one period less than the interval, every time (~2.0 s of a 3 s one), and a rule
    asking for most of the interval would never be satisfied."""
    anchor = None
    for i in range(len(samples) - 1, -1, -1):
        if samples[i].at_s <= start_s:
            anchor = i
            break
    if anchor is None or len(samples) - anchor < 2:
        return None
    return list(samples[anchor:])


def dead(window: Sequence[WorkerSample], t: Thresholds) -> Detection | None:
    if not window:
        return None
    last = window[-1]
    if last.process_alive is False:
        return Detection(last.worker_id, last.epoch, Rule.DEAD, "its process is gone")
    if last.lease_left_s is None:
        return Detection(last.worker_id, last.epoch, Rule.DEAD, "its registry lease lapsed")
    if last.lease_left_s < t.lease_margin_s and not last.control_ok:
        # (A worker that still answers its control API is alive: its heartbeat is late,
        # Redis is slow, and the lease will be renewed; the gateway drops it if not.)
        return Detection(last.worker_id, last.epoch, Rule.DEAD,
                         f"its lease has {last.lease_left_s:.2f} s left: heartbeats stopped")
    return None


def hung(window: Sequence[WorkerSample], now_s: float, t: Thresholds) -> Detection | None:
    samples = covering(current_epoch(window), now_s - t.hung_after_s)
    if samples is None:
        return None
    last = samples[-1]
    if all(not s.control_ok for s in samples):
        return Detection(last.worker_id, last.epoch, Rule.HUNG,
                         f"its control API missed every deadline for {t.hung_after_s:g} s")
    busy = all(s.num_running > 0 for s in samples)
    if busy and samples[0].num_steps == last.num_steps:
        return Detection(last.worker_id, last.epoch, Rule.HUNG,
                         f"no engine step for {last.at_s - samples[0].at_s:.1f} s with "
                         f"{last.num_running} running request(s)")
    return None


def slow(windows: Mapping[str, Sequence[WorkerSample]], now_s: float,
         t: Thresholds) -> list[Detection]:
    """Workers whose decode steps were outliers among their role's at every tick of the
    last `slow_for_s` that could judge them (at least three, spread over most of it), over
    at least `slow_min_steps` engine steps: one slow burst (a host's cores busy for a
    moment) is not a slow worker; a tick with no decode step of its own, or no peer to
    compare with, says nothing either way."""
    by_tick: dict[float, list[WorkerSample]] = {}
    for window in windows.values():
        for sample in window:
            by_tick.setdefault(sample.at_s, []).append(sample)
    found = []
    for window in windows.values():
        # One tick (~1 s) of slack at the old end: ticks drift, and a span must be able to
        # reach slow_for_s back.
        span = [s for s in current_epoch(window) if s.at_s >= now_s - t.slow_for_s - 1.0]
        judged = [(s, v) for s in span if (v := _outlier(s, by_tick[s.at_s], t)) is not None]
        if any(v is False for _, v in judged):
            continue  # normal at some tick of the span
        measured = [s for s, _ in judged]
        if len(measured) < 3 or measured[-1].at_s - measured[0].at_s < 0.8 * t.slow_for_s:
            continue
        num_steps = span[-1].num_steps - span[0].num_steps
        if num_steps < t.slow_min_steps:
            continue
        last, (step, reference) = judged[-1]  # type: ignore[misc]
        found.append(Detection(last.worker_id, last.epoch, Rule.SLOW,
                               f"decode step {step * 1000:.1f} ms vs {reference * 1000:.1f} ms "
                               f"its peers take{_shape_text(last.step_shape)}, at all "
                               f"{len(measured)} ticks of {last.at_s - measured[0].at_s:.0f} s "
                               f"({num_steps} steps)"))
    return found


def _outlier(sample: WorkerSample, tick: Sequence[WorkerSample],
             t: Thresholds) -> tuple[float, float] | bool | None:
    """(its step, the peers' reference) when `sample` is an outlier among the samples of
    the same tick; False when it was measured and is not; None when the tick says nothing
    (no fresh decode step of its own, or no peer to compare with)."""
    step = sample.step_time_s
    if step is None:
        return None
    reference = peer_step_s(sample, tick)
    if reference is None:
        return None  # nobody to compare with: one worker of a role is never "slow"
    if step >= t.slow_min_step_s and step > t.slow_factor * reference:
        return step, reference
    return False


def still_slow(window: Sequence[WorkerSample], tick: Sequence[WorkerSample],
               t: Thresholds) -> Detection | None:
    """A worker ejected for `slow` runs no steps, and the router keeps sending it nothing
    while its fitted model says it is slow, so nothing but that model can clear it: its
    own model (fitted from its own decode steps), evaluated at the last shape it was
    measured at, against what its peers (the samples of the latest tick) predict for that
    shape. None: not slow by that measure, or no model or shape to judge by."""
    samples = current_epoch(window)
    shapes = [s.step_shape for s in samples if s.step_shape is not None]
    if not shapes:
        return None
    last, shape = samples[-1], shapes[-1]
    model = last.step_model
    if model is None or model.num_decode_samples == 0:
        return None
    step = model.step_s(0.0, shape[0], shape[1])
    verdict = _outlier(replace(last, step_time_s=step, step_shape=shape), tick, t)
    if not isinstance(verdict, tuple):
        return None
    return Detection(last.worker_id, last.epoch, Rule.SLOW,
                     f"still slow by its own step model: {step * 1000:.1f} ms vs "
                     f"{verdict[1] * 1000:.1f} ms its peers take{_shape_text(shape)}")


def latest_tick(windows: Mapping[str, Sequence[WorkerSample]]) -> list[WorkerSample]:
    """The samples of the most recent tick (every worker's, when it was seen then)."""
    last = max((w[-1].at_s for w in windows.values() if w), default=None)
    return [w[-1] for w in windows.values() if w and w[-1].at_s == last]


def peer_step_s(sample: WorkerSample, tick: Sequence[WorkerSample]) -> float | None:
    """What the peers of `sample` (its role's other workers in `tick`) take for a decode
    step of its shape: the median of their expectations (None: no peer to ask)."""
    expected = [e for p in tick if p.role == sample.role and p.worker_id != sample.worker_id
                and (e := _expected(p, sample.step_shape)) is not None]
    return statistics.median(expected) if expected else None


def _expected(peer: WorkerSample, shape: tuple[float, float] | None) -> float | None:
    """What `peer` takes for a decode step of `shape`: its model's prediction when it has
    one fitted from decode steps, else its own measured step time (None: neither)."""
    model = peer.step_model
    if shape is not None and model is not None and model.num_decode_samples > 0:
        return model.step_s(0.0, shape[0], shape[1])
    return peer.step_time_s


def _shape_text(shape: tuple[float, float] | None) -> str:
    return "" if shape is None else f" at batch {shape[0]:.1f}, context {shape[1]:.0f}"


def leaked_kv(window: Sequence[WorkerSample], now_s: float, t: Thresholds) -> Detection | None:
    samples = current_epoch(window)
    idle_holding = []
    for sample in reversed(samples):
        if sample.num_kv_blocks_used > 0 and sample.num_running == 0 and sample.num_waiting == 0:
            idle_holding.append(sample)
        else:
            break
    if not idle_holding or now_s - idle_holding[-1].at_s < t.leak_after_s:
        return None
    last = samples[-1]
    return Detection(last.worker_id, last.epoch, Rule.LEAKED_KV,
                     f"{last.num_kv_blocks_used} KV block(s) held with nothing running for "
                     f"{now_s - idle_holding[-1].at_s:.0f} s")


def error_spike(window: Sequence[WorkerSample], t: Thresholds) -> Detection | None:
    samples = current_epoch(window)
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    num_requests = last.num_requests - first.num_requests
    num_failed = last.num_failed - first.num_failed
    if num_requests < t.error_min_requests or num_failed < t.error_rate * num_requests:
        return None
    return Detection(last.worker_id, last.epoch, Rule.ERROR_SPIKE,
                     f"{num_failed} of its last {num_requests} requests failed")


def detect(windows: Mapping[str, Sequence[WorkerSample]], now_s: float,
           t: Thresholds) -> list[Detection]:
    """Every rule over every worker; at most one detection per worker, the gravest first
    (dead, hung, error spike, slow, leaked KV)."""
    by_worker: dict[str, Detection] = {}
    for worker_id, window in windows.items():
        for found in (dead(window, t), hung(window, now_s, t), error_spike(window, t)):
            if found is not None:
                by_worker.setdefault(worker_id, found)
    for found in slow(windows, now_s, t):
        by_worker.setdefault(found.worker_id, found)
    for worker_id, window in windows.items():
        leak = leaked_kv(window, now_s, t)
        if leak is not None:
            by_worker.setdefault(worker_id, leak)
    return sorted(by_worker.values(), key=lambda d: d.worker_id)
