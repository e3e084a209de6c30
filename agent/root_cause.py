"""Why a tier's attainment dropped: a pure attribution over two windows of snapshots.

    snapshots (one per agent tick, agent/root_cause_watch.py builds them)
        ├─ baseline: the `baseline_s` before the recent window
        └─ recent:   the last `recent_s`
    dropped(recent, baseline)  ─▶ the trigger, or None (no drop, or too few requests)
    attribute(...)             ─▶ RootCauseReport: the stages that grew, the causes ranked

A snapshot holds, per tier, the gateway's tally of the requests finished since the last
tick (protocol/tier_tally.py: outcomes, prompt lengths, stage times, per worker), and per
worker what the agent saw of it at that tick (`WorkerTick`: its decode step against its
peers', KV use and waits, KV pushes by path, failures, whether it is ejected).

A drop: at least `min_requests` finished in the recent window (refusals included), and
their attainment (met / finished) is below `attainment_target`, or below the baseline's
by `attainment_margin` (a baseline of at least `min_requests`).

The causes, each scored as its measure over the threshold at which it counts (a score of
at least 1 is a cause; the highest first, except that a slow worker the agent ejected in
the window comes before the rest: its own rule fired on it, and what it makes grow on
other workers follows from it):

    rate_surge         requests/s recent over baseline, against `surge_ratio`
                       (stage: the admission queue when it grew, else the prefill queue)
    mix_shift          mean prompt tokens recent over baseline, against `mix_ratio`
                       (stage: prefill compute)
    slow_worker        one worker against its role's peers, against `slow_ratio`: its decode
                       step over what the peers' step models predict for its shape (median
                       over the recent ticks), or the gateway's decode gap (TPOT) / prefill
                       stage of its requests over the median of the other workers'; a worker
                       the agent ejected in the recent window counts at least 1
                       (stage: decode step, or prefill compute for a prefill worker)
    kv_pressure        the fullest KV pool's peak use against `kv_usage_high`, and
                       reservations that waited for blocks (1 + waits per finished request)
                       (stage: prefill queue: a reservation waits before its prefill)
    transfer_fallback  KV pushes that failed or were retried (1 + failures per push), the
                       carrier's share of pushes up by more than `carrier_shift` against the
                       baseline (the mapped path lost), or the mean push time up by
                       `transfer_ratio` (stage: KV transfer)
    expert_imbalance   a MoE worker's busiest expert over the mean (agent/expert_cause.py)
    relay_lag          the gateway's event-loop lag while the tier's requests streamed
                       (the relay stage) against `relay_ms_high`, where it also grew by
                       `slow_ratio` over the baseline's, each over `min_requests` streamed
                       requests (stage: relay)

The prefill workers' queue (`PrefillResult.queue_ms`, split prompts) and the relay (the
gateway's share of the decode gap, gateway/ops/loop_lag.py) are stage rows of their own.
Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from agent.expert_cause import expert_imbalance
from agent.root_cause_window import RootCauseConfig, Snapshot, Window, windows
from protocol.messages import Role
from protocol.root_cause_report import Cause, CauseKind, RootCauseReport, StageChange, StageName
from protocol.tier_tally import StageSum


def dropped(baseline: Window, recent: Window, config: RootCauseConfig) -> str | None:
    """The trigger of a report (the figures that fell); None: no drop, or too few requests."""
    now = recent.attainment
    if now is None or recent.tally.num_requests < config.min_requests:
        return None
    text = f"attainment {now:.2f} over the last {recent.span_s:.0f} s " \
           f"({recent.tally.num_requests} requests)"
    if now < config.attainment_target:
        return f"{text}, below the target {config.attainment_target:.2f}"
    before = baseline.attainment
    if before is not None and baseline.tally.num_requests >= config.min_requests \
            and now < before - config.attainment_margin:
        return f"{text}, down from {before:.2f} over the {baseline.span_s:.0f} s before"
    return None


def attribute(tier: str, baseline: Sequence[Snapshot], recent: Sequence[Snapshot],
              at_unix_ms: int, config: RootCauseConfig) -> RootCauseReport | None:
    """The report on `tier`'s drop, or None when it did not drop (module doc)."""
    before, now = windows(tier, baseline, recent, config)
    trigger = dropped(before, now, config)
    if trigger is None:
        return None
    causes = [c for c in (rate_surge(before, now, config), mix_shift(before, now, config),
                          *slow_workers(now, config), kv_pressure(now, config),
                          transfer_fallback(before, now, config),
                          expert_imbalance(before, now), relay_lag(before, now, config))
              if c is not None]
    # A worker the agent ejected in the window is a fault seen on that worker itself (its own
    # rule fired); what it makes grow elsewhere (slower KV pushes into it, queues behind it)
    # ranks after it, whatever the scores.
    causes.sort(key=lambda c: (not (c.kind is CauseKind.SLOW_WORKER
                                    and _ejected_for(now, c.worker_ids[0])), -c.score))
    return RootCauseReport(
        at_unix_ms=at_unix_ms, tier=tier, trigger=trigger, baseline_s=config.baseline_s,
        recent_s=config.recent_s, attainment_baseline=before.attainment,
        attainment_recent=now.attainment or 0.0,
        num_requests_baseline=before.tally.num_requests,
        num_requests_recent=now.tally.num_requests, stages=stage_changes(before, now),
        causes=causes)


def stage_changes(before: Window, now: Window) -> list[StageChange]:
    """Each measured stage's mean in both windows (ms), with the workers where it grew."""
    def transfer_ms(window: Window) -> float | None:
        ticks = [t for s in window.snapshots for t in s.workers.values()]
        num = sum(t.num_transfers_mapped + t.num_transfers_carrier for t in ticks)
        return sum(t.transfer_s for t in ticks) * 1000 / num if num else None

    b, n = before.tally, now.tally
    return [
        StageChange(stage=StageName.ADMISSION_QUEUE, baseline_ms=_ms(b.admission_queue.mean_ms),
                    recent_ms=_ms(n.admission_queue.mean_ms)),
        StageChange(stage=StageName.PREFILL, baseline_ms=_ms(b.prefill.mean_ms),
                    recent_ms=_ms(n.prefill.mean_ms),
                    worker_ids=_grew(n.prefill_by_worker)),
        StageChange(stage=StageName.PREFILL_QUEUE, baseline_ms=_ms(b.prefill_queue.mean_ms),
                    recent_ms=_ms(n.prefill_queue.mean_ms)),
        StageChange(stage=StageName.KV_TRANSFER, baseline_ms=_ms(transfer_ms(before)),
                    recent_ms=_ms(transfer_ms(now))),
        StageChange(stage=StageName.DECODE_STEP, baseline_ms=_ms(b.decode.mean_ms),
                    recent_ms=_ms(n.decode.mean_ms),
                    worker_ids=_grew(n.decode_by_worker)),
        StageChange(stage=StageName.RELAY, baseline_ms=_ms(b.relay.mean_ms),
                    recent_ms=_ms(n.relay.mean_ms)),
    ]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _grew(now: Mapping[str, StageSum]) -> list[str]:
    """The workers whose recent mean is at least 1.5 x the other workers' median."""
    ratios = _outliers({w: s.mean_ms for w, s in now.items()})
    return sorted(w for w, r in ratios.items() if r >= 1.5)


def _ratio(now: float | None, before: float | None) -> float | None:
    if now is None or before is None or before <= 0:
        return None
    return now / before


def rate_surge(before: Window, now: Window, config: RootCauseConfig) -> Cause | None:
    if before.tally.num_requests < config.min_requests:
        return None
    ratio = _ratio(now.rate_per_s, before.rate_per_s)
    if ratio is None or ratio < config.surge_ratio:
        return None
    queue_grew = (_ratio(now.tally.admission_queue.mean_ms,
                         before.tally.admission_queue.mean_ms) or 0.0) >= config.surge_ratio
    return Cause(
        kind=CauseKind.RATE_SURGE, score=round(ratio / config.surge_ratio, 2),
        stage=StageName.ADMISSION_QUEUE if queue_grew else StageName.PREFILL_QUEUE,
        worker_ids=[],
        evidence=f"{now.rate_per_s:.2f} requests/s over the last {now.span_s:.0f} s vs "
                 f"{before.rate_per_s:.2f}/s over the {before.span_s:.0f} s before "
                 f"(x{ratio:.1f})",
        action="recommend: more workers (pdserve_agent_desired_workers), or a lower rate "
               "limit for the tier")


def relay_lag(before: Window, now: Window, config: RootCauseConfig) -> Cause | None:
    recent, baseline = now.tally.relay.mean_ms, before.tally.relay.mean_ms
    if min(now.tally.relay.count, before.tally.relay.count) < config.min_requests:
        return None  # too few streams to say, or nothing to compare with
    ratio = _ratio(recent, baseline)
    if recent is None or recent < config.relay_ms_high or ratio is None \
            or ratio < config.slow_ratio:
        return None  # not late, or as late as before: not what changed
    was = f"{baseline:.1f} ms over the {before.span_s:.0f} s before"
    return Cause(
        kind=CauseKind.RELAY_LAG, score=round(recent / config.relay_ms_high, 2),
        stage=StageName.RELAY, worker_ids=[],
        evidence=f"the gateway's event loop ran {recent:.1f} ms late on average while the "
                 f"tier's requests streamed over the last {now.span_s:.0f} s vs {was}",
        action="recommend: more gateway replicas (pdserve up --gateways), or a core of its "
               "own for the gateway")


def mix_shift(before: Window, now: Window, config: RootCauseConfig) -> Cause | None:
    if before.tally.num_prompts < config.min_requests:
        return None
    ratio = _ratio(now.prompt_tokens, before.prompt_tokens)
    if ratio is None or ratio < config.mix_ratio or now.prompt_tokens is None:
        return None
    return Cause(
        kind=CauseKind.MIX_SHIFT, score=round(ratio / config.mix_ratio, 2),
        stage=StageName.PREFILL_COMPUTE, worker_ids=[],
        evidence=f"mean prompt {now.prompt_tokens:.0f} tokens over the last "
                 f"{now.span_s:.0f} s vs {before.prompt_tokens:.0f} over the "
                 f"{before.span_s:.0f} s before (x{ratio:.1f})",
        action="recommend: more prefill capacity (a worker moved to prefill, or added), or "
               "a lower max prompt for the tier")


def _ejected_for(now: Window, worker_id: str) -> str | None:
    """Why the agent ejected the worker in the window (its latest ejection), else None."""
    return next((t.ejected_for for t in reversed(now.ticks(worker_id)) if t.ejected_for), None)


def slow_workers(now: Window, config: RootCauseConfig) -> list[Cause]:
    """One cause per worker slower than its peers (module doc); none when more than half
    of a role is "slow" (then the peers are not the measure: the load is)."""
    roles: dict[str, Role | None] = {}
    for snapshot in now.snapshots:
        for tick in snapshot.workers.values():
            roles[tick.worker_id] = tick.role
    tpot = _outliers({w: s.mean_ms for w, s in now.tally.decode_by_worker.items()})
    prefill = _outliers({w: s.mean_ms for w, s in now.tally.prefill_by_worker.items()})
    found = []
    for worker_id in sorted(set(roles) | set(tpot) | set(prefill)):
        ticks = now.ticks(worker_id)
        steps = [t.step_s / t.peer_step_s for t in ticks
                 if t.step_s is not None and t.peer_step_s]
        step_ratio = statistics.median(steps) if steps else None
        ejected = _ejected_for(now, worker_id)
        measures = [(r, text, stage) for r, text, stage in (
            (step_ratio, f"its decode step x{step_ratio or 0:.1f} what its peers' step models "
                         f"predict for the same batch (median of {len(steps)} ticks)",
             StageName.DECODE_STEP),
            (tpot.get(worker_id), f"the tier's decode gap (TPOT) on it "
                                  f"x{tpot.get(worker_id) or 0:.1f} the other workers'",
             StageName.DECODE_STEP),
            (prefill.get(worker_id), f"the tier's prefill stage on it "
                                     f"x{prefill.get(worker_id) or 0:.1f} the other workers'",
             StageName.PREFILL_COMPUTE))
            if r is not None and r >= config.slow_ratio]
        if not measures and ejected is None:
            continue
        measures.sort(key=lambda m: -m[0])
        score = measures[0][0] / config.slow_ratio if measures else 1.0
        evidence = "; ".join(text for _, text, _ in measures)
        if ejected is not None:
            evidence = f"{evidence}; ejected ({ejected})" if evidence else f"ejected ({ejected})"
        stage = measures[0][2] if measures else StageName.PREFILL_COMPUTE \
            if roles.get(worker_id) is Role.PREFILL else StageName.DECODE_STEP
        found.append(Cause(
            kind=CauseKind.SLOW_WORKER, score=round(score, 2), stage=stage,
            worker_ids=[worker_id], evidence=f"{worker_id} over the last {now.span_s:.0f} s: "
                                             f"{evidence}",
            action=_ejection_text(ejected) if ejected else
                   "recommend: eject it (the agent's slow rule does once it stays slow), "
                   "then restart it"))
    num_workers = max(1, len(roles))
    return found if len(found) <= max(1, num_workers // 2) else []


def _ejection_text(rule: str) -> str:
    follow = "restarted if still slow after its probation" if rule == "slow" else \
        "re-admitted after its probation once healthy"
    return f"ejected by the agent ({rule}): {follow}"


def _outliers(means: Mapping[str, float | None]) -> dict[str, float]:
    """Each worker's mean over the median of the other workers' (two or more workers)."""
    known = {w: m for w, m in means.items() if m is not None}
    out = {}
    for worker_id, mean in known.items():
        others = [m for w, m in known.items() if w != worker_id]
        if others and statistics.median(others) > 0:
            out[worker_id] = mean / statistics.median(others)
    return out


def kv_pressure(now: Window, config: RootCauseConfig) -> Cause | None:
    ticks = [t for s in now.snapshots for t in s.workers.values()]
    if not ticks:
        return None
    fullest = max(ticks, key=lambda t: t.kv_usage)
    num_waits = sum(t.num_kv_waits for t in ticks)
    waiting = sorted({t.worker_id for t in ticks if t.num_kv_waits or t.num_kv_waiting})
    usage_score = fullest.kv_usage / config.kv_usage_high
    wait_score = 1 + num_waits / max(1, now.tally.num_requests) if num_waits else 0.0
    score = max(usage_score if usage_score >= 1 else 0.0, wait_score)
    if score < 1:
        return None
    return Cause(
        kind=CauseKind.KV_PRESSURE, score=round(score, 2), stage=StageName.PREFILL_QUEUE,
        worker_ids=sorted(set(waiting) | ({fullest.worker_id} if usage_score >= 1 else set())),
        evidence=f"KV pool of {fullest.worker_id} up to {fullest.kv_usage:.0%} full; "
                 f"{num_waits} reservation(s) waited for free blocks over the last "
                 f"{now.span_s:.0f} s ({now.tally.num_requests} requests)",
        action="recommend: more decode workers or KV blocks (--kv-blocks), or shorter "
               "max_tokens for the tier")


def transfer_fallback(before: Window, now: Window, config: RootCauseConfig) -> Cause | None:
    def pushes(window: Window) -> tuple[int, int, float, int, set[str]]:
        ticks = [t for s in window.snapshots for t in s.workers.values()]
        carrier = sum(t.num_transfers_carrier for t in ticks)
        total = carrier + sum(t.num_transfers_mapped for t in ticks)
        failures = sum(t.num_transfer_failures for t in ticks)
        senders = {t.worker_id for t in ticks if t.num_transfer_failures
                   or t.num_transfers_carrier}
        return total, carrier, sum(t.transfer_s for t in ticks), failures, senders

    total, carrier, seconds, failures, senders = pushes(now)
    b_total, b_carrier, b_seconds, _, _ = pushes(before)
    failures += now.tally.num_transfer_retries
    measures: list[tuple[float, str]] = []
    if failures:
        measures.append((1 + failures / max(1, total),
                         f"{failures} KV transfer(s) failed or were retried vs {total} done"))
    if total and b_total:
        shift = carrier / total - b_carrier / b_total
        if shift >= config.carrier_shift:
            measures.append((shift / config.carrier_shift,
                             f"{carrier / total:.0%} of KV pushes over a carrier (the "
                             f"fallback) vs {b_carrier / b_total:.0%} before"))
        ratio = _ratio(seconds / total, b_seconds / b_total)
        if ratio is not None and ratio >= config.transfer_ratio:
            measures.append((ratio / config.transfer_ratio,
                             f"a KV push takes {seconds / total * 1000:.1f} ms vs "
                             f"{b_seconds / b_total * 1000:.1f} ms before"))
    if not measures:
        return None
    return Cause(
        kind=CauseKind.TRANSFER_FALLBACK, score=round(max(m for m, _ in measures), 2),
        stage=StageName.KV_TRANSFER, worker_ids=sorted(senders),
        evidence=f"over the last {now.span_s:.0f} s: " + "; ".join(t for _, t in measures),
        action="recommend: check the link between prefill and decode workers (the mapped "
               "path needs them on one host); requests are retried on another pair")
