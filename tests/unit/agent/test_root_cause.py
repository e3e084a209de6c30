"""Root-cause attribution (agent/root_cause.py) and its owner (agent/root_cause_watch.py)
over recorded snapshot sequences: one second per snapshot, a 60 s baseline of steady
traffic on one prefill worker (p0) and two decode workers (d0, d1) of tier "standard",
then 10 s in which one thing changed. Each change must be named first."""

from __future__ import annotations

import pytest

from agent.health_rules import WorkerSample
from agent.root_cause import attribute
from agent.root_cause_window import RootCauseConfig, Snapshot, WorkerTick, split
from agent.root_cause_watch import RootCauseWatch, worker_ticks
from protocol.agent_messages import HealthReport
from protocol.messages import Role
from protocol.root_cause_report import CauseKind, RootCauseReport, StageName
from protocol.tier_tally import StageSum, TierTally
from protocol.worker_load import WorkerLoad

CONFIG = RootCauseConfig()  # recent 10 s, baseline 60 s, target 0.9

# One second of a tier, recorded: (met, missed, mean prompt tokens, admission queue ms,
# prefill ms, TPOT ms on d0, TPOT ms on d1, transfer retries). Each request's decode ran
# on d0 or d1 in turn; every prefill on p0.
Tier = tuple[int, int, int, float, float, float, float, int]
STEADY_TIER: Tier = (2, 0, 200, 5.0, 80.0, 30.0, 31.0, 0)

# One second of a worker, recorded: (step s, peers' step s for its shape, KV use, KV waits,
# pushes mapped, pushes over a carrier, push seconds, push failures, ejected for).
Worker = tuple[float | None, float | None, float, int, int, int, float, int, str | None]
STEADY_WORKERS: dict[str, Worker] = {
    "p0": (None, None, 0.30, 0, 2, 0, 0.004, 0, None),
    "d0": (0.030, 0.031, 0.40, 0, 0, 0, 0.0, 0, None),
    "d1": (0.031, 0.030, 0.42, 0, 0, 0, 0.0, 0, None),
}
ROLES = {"p0": Role.PREFILL, "d0": Role.DECODE, "d1": Role.DECODE}


def tally(row: Tier) -> TierTally:
    met, missed, prompt, queue_ms, prefill_ms, tpot0, tpot1, retries = row
    n = met + missed
    half, rest = (n + 1) // 2, n // 2
    return TierTally(
        num_met=met, num_missed=missed, num_prompt_tokens=prompt * n, num_prompts=n,
        num_transfer_retries=retries, admission_queue=StageSum(queue_ms * n, n),
        prefill=StageSum(prefill_ms * n, n), decode=StageSum(tpot0 * half + tpot1 * rest, n),
        prefill_by_worker={"p0": StageSum(prefill_ms * n, n)},
        decode_by_worker={w: StageSum(t * k, k) for w, t, k in (("d0", tpot0, half),
                                                                ("d1", tpot1, rest)) if k})


def workers(rows: dict[str, Worker]) -> dict[str, WorkerTick]:
    return {w: WorkerTick(worker_id=w, role=ROLES[w], step_s=r[0], peer_step_s=r[1],
                          kv_usage=r[2], num_kv_waits=r[3], num_transfers_mapped=r[4],
                          num_transfers_carrier=r[5], transfer_s=r[6],
                          num_transfer_failures=r[7], ejected_for=r[8])
            for w, r in rows.items()}


def recording(recent_tier: Tier, recent_workers: dict[str, Worker] | None = None,
              num_recent: int = 10) -> list[Snapshot]:
    """60 steady seconds, then `num_recent` seconds of the recorded change."""
    steady = [Snapshot(float(t), {"standard": tally(STEADY_TIER)}, workers(STEADY_WORKERS))
              for t in range(1, 61)]
    changed = {**STEADY_WORKERS, **(recent_workers or {})}
    return steady + [Snapshot(float(t), {"standard": tally(recent_tier)}, workers(changed))
                     for t in range(61, 61 + num_recent)]


def report_of(snapshots: list[Snapshot]) -> RootCauseReport | None:
    baseline, recent = split(snapshots, snapshots[-1].at_s, CONFIG)
    return attribute("standard", baseline, recent, 1_000, CONFIG)


def test_steady_traffic_gives_no_report() -> None:
    assert report_of(recording(STEADY_TIER)) is None


def test_a_mix_shift_toward_long_prompts_is_named_first() -> None:
    # Prompts 6x longer: the prefill stage grows and TTFT is missed; the rate is the same.
    report = report_of(recording((1, 1, 1200, 6.0, 900.0, 32.0, 33.0, 0)))
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.MIX_SHIFT, report.causes
    assert report.cause.stage is StageName.PREFILL_COMPUTE
    assert "1200 tokens" in report.cause.evidence and "200" in report.cause.evidence
    assert report.attainment_recent == 0.5 and report.attainment_baseline == 1.0
    prefill = next(s for s in report.stages if s.stage is StageName.PREFILL)
    assert prefill.baseline_ms == 80.0 and prefill.recent_ms == 900.0
    # No prefill worker reported its queue in this recording: the row says so (None).
    queue = next(s for s in report.stages if s.stage is StageName.PREFILL_QUEUE)
    assert queue.baseline_ms is None and queue.recent_ms is None


def test_the_prefill_workers_queue_is_a_stage_row_where_they_report_it() -> None:
    snapshots = recording((1, 1, 210, 6.0, 700.0, 32.0, 33.0, 0))
    for n, snapshot in enumerate(snapshots):
        tier = snapshot.tiers["standard"]
        count = tier.prefill.count
        tier.prefill_queue = StageSum((5.0 if n < 60 else 600.0) * count, count)
    report = report_of(snapshots)
    assert report is not None
    queue = next(s for s in report.stages if s.stage is StageName.PREFILL_QUEUE)
    assert (queue.baseline_ms, queue.recent_ms) == (5.0, 600.0)


def with_relay(snapshots: list[Snapshot], baseline_ms: float, recent_ms: float
               ) -> list[Snapshot]:
    for n, snapshot in enumerate(snapshots):
        tier = snapshot.tiers["standard"]
        tier.relay = StageSum((baseline_ms if n < 60 else recent_ms) * tier.decode.count,
                              tier.decode.count)
    return snapshots


def test_a_gateway_relaying_late_is_named_first_with_the_relay_stage() -> None:
    # Every token waits ~150 ms for the gateway's loop: TPOT grows alike on both decode
    # workers (neither is slower than the other), their own steps did not change.
    report = report_of(with_relay(recording((1, 1, 205, 6.0, 85.0, 180.0, 181.0, 0)),
                                  baseline_ms=0.4, recent_ms=150.0))
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.RELAY_LAG, report.causes
    assert report.cause.stage is StageName.RELAY and "150.0 ms late" in report.cause.evidence
    assert [c.kind for c in report.causes] == [CauseKind.RELAY_LAG]
    relay = next(s for s in report.stages if s.stage is StageName.RELAY)
    assert (relay.baseline_ms, relay.recent_ms) == (0.4, 150.0)


def test_a_gateway_as_late_as_before_is_not_what_changed() -> None:
    report = report_of(with_relay(recording((1, 1, 1200, 6.0, 900.0, 32.0, 33.0, 0)),
                                  baseline_ms=20.0, recent_ms=25.0))
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.MIX_SHIFT
    assert CauseKind.RELAY_LAG not in [c.kind for c in report.causes]


def test_an_arrival_rate_surge_is_named_first() -> None:
    # Three times the requests: they queue for admission; the KV pools fill up somewhat.
    busier = {"d0": (0.045, 0.044, 0.75, 0, 0, 0, 0.0, 0, None),
              "d1": (0.044, 0.045, 0.78, 0, 0, 0, 0.0, 0, None)}
    report = report_of(recording((3, 3, 210, 450.0, 300.0, 45.0, 44.0, 0), busier))
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.RATE_SURGE, report.causes
    assert report.cause.stage is StageName.ADMISSION_QUEUE
    assert report.cause.evidence.startswith("6.00 requests/s over the last 10 s vs 2.00/s")


def test_one_slow_worker_is_named_with_the_decode_stage() -> None:
    slow = {"d1": (0.300, 0.031, 0.45, 0, 0, 0, 0.0, 0, None)}
    report = report_of(recording((1, 1, 200, 5.0, 85.0, 30.0, 310.0, 0), slow))
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.SLOW_WORKER, report.causes
    assert report.cause.worker_ids == ["d1"]
    assert report.cause.stage is StageName.DECODE_STEP
    assert "x9.7" in report.cause.evidence  # 0.300 / 0.031
    decode = next(s for s in report.stages if s.stage is StageName.DECODE_STEP)
    assert decode.worker_ids == ["d1"]


def test_an_ejected_worker_is_named_as_what_the_agent_did() -> None:
    slow = {"d1": (0.300, 0.031, 0.45, 0, 0, 0, 0.0, 0, "slow")}
    report = report_of(recording((1, 1, 200, 5.0, 85.0, 30.0, 310.0, 0), slow))
    assert report is not None and report.cause is not None
    assert report.cause.worker_ids == ["d1"]
    assert report.cause.action == "ejected by the agent (slow): restarted if still slow " \
                                  "after its probation"


def test_an_ejected_slow_worker_comes_before_the_slower_pushes_it_causes() -> None:
    # d1 was ejected for slowness and is back at a normal step; meanwhile pushes into it
    # took 10x longer and some were retried, which scores higher than the ejection alone.
    ejected = {"d1": (0.031, 0.031, 0.45, 0, 0, 0, 0.0, 0, "slow"),
               "p0": (None, None, 0.30, 0, 2, 0, 0.040, 0, None)}
    report = report_of(recording((1, 1, 200, 5.0, 300.0, 30.0, 31.0, 1), ejected))
    assert report is not None and report.cause is not None
    kinds = [c.kind for c in report.causes]
    assert kinds[:2] == [CauseKind.SLOW_WORKER, CauseKind.TRANSFER_FALLBACK], report.causes
    assert report.causes[1].score > report.causes[0].score  # first by the rule, not the score
    assert report.cause.worker_ids == ["d1"]


def test_kv_pressure_is_named_first() -> None:
    # The decode pools are nearly full and reservations wait for blocks: the first token
    # comes late; arrivals and prompts are as before.
    full = {"d0": (0.033, 0.032, 0.97, 1, 0, 0, 0.0, 0, None),
            "d1": (0.032, 0.033, 0.96, 1, 0, 0, 0.0, 0, None)}
    report = report_of(recording((1, 1, 205, 6.0, 1400.0, 33.0, 32.0, 0), full))
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.KV_PRESSURE, report.causes
    assert report.cause.worker_ids == ["d0", "d1"]
    assert "97%" in report.cause.evidence and "20 reservation(s)" in report.cause.evidence


def test_a_fallback_to_a_slower_transport_is_named_first() -> None:
    # The pushes leave the mapped pool for a carrier, take 25x longer and a few fail
    # (retried by the gateway): the prefill stage grows.
    fallback = {"p0": (None, None, 0.30, 0, 0, 2, 0.100, 0, None)}
    report = report_of(recording((1, 1, 200, 5.0, 700.0, 30.0, 31.0, 1), fallback))
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.TRANSFER_FALLBACK, report.causes
    assert report.cause.stage is StageName.KV_TRANSFER and report.cause.worker_ids == ["p0"]
    assert "100% of KV pushes over a carrier" in report.cause.evidence
    transfer = next(s for s in report.stages if s.stage is StageName.KV_TRANSFER)
    assert transfer.baseline_ms == 2.0 and transfer.recent_ms == 50.0


def test_too_few_requests_tell_nothing() -> None:
    # A quiet spell: three requests, all late, in the recent window (fewer than 5).
    snapshots = recording(STEADY_TIER)[:60] + [
        Snapshot(float(t), {"standard": tally((0, 1, 200, 5.0, 80.0, 30.0, 900.0, 0))}
                 if t % 3 == 0 else {}, workers(STEADY_WORKERS)) for t in range(61, 71)]
    assert report_of(snapshots) is None


def feed(watch: RootCauseWatch, snapshots: list[Snapshot]) -> list[RootCauseReport]:
    """Replay snapshots through the watch, as the control loop would, tick by tick."""
    emitted = []
    for snapshot in snapshots:
        emitted += watch.take(snapshot, int(snapshot.at_s * 1000))
        watch.check_invariants()
    return emitted


def shifted(snapshots: list[Snapshot], by_s: float) -> list[Snapshot]:
    return [Snapshot(s.at_s + by_s, s.tiers, s.workers) for s in snapshots]


def test_a_report_is_not_repeated_every_tick_and_a_new_drop_is_reported_again() -> None:
    slow = {"d1": (0.300, 0.031, 0.45, 0, 0, 0, 0.0, 0, None)}
    watch = RootCauseWatch(CONFIG)
    first = feed(watch, recording((1, 1, 200, 5.0, 85.0, 30.0, 310.0, 0), slow,
                                  num_recent=30))
    assert len(first) == 1 and first[0].cause is not None
    assert first[0].cause.kind is CauseKind.SLOW_WORKER
    assert watch.latest["standard"] is first[0]
    # Recovered (a steady minute), then slow again: one new report.
    steady = [Snapshot(s.at_s + 90, s.tiers, s.workers) for s in recording(STEADY_TIER)[:60]]
    assert feed(watch, steady) == []
    again = feed(watch, shifted(recording((1, 1, 200, 5.0, 85.0, 30.0, 310.0, 0), slow,
                                          num_recent=15)[60:], 90))
    assert len(again) == 1 and list(watch.reports) == [again[0], first[0]]


def test_a_drop_without_a_cause_is_reported_once_the_recent_window_passed() -> None:
    # Attainment falls with nothing observed changing: reported, causes [], after 10 s.
    watch = RootCauseWatch(CONFIG)
    emitted = feed(watch, recording((1, 1, 200, 5.0, 80.0, 30.0, 31.0, 0), num_recent=25))
    assert len(emitted) == 1 and emitted[0].causes == []
    assert "below the target 0.90" in emitted[0].trigger


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        RootCauseConfig(attainment_target=0)
    with pytest.raises(ValueError):
        RootCauseConfig(slow_ratio=1.0)


def health(epoch: int, waits: int, carrier: int, failures: int) -> HealthReport:
    return HealthReport(epoch=epoch, load=WorkerLoad(num_kv_blocks_used=90,
                                                     num_kv_blocks_total=100),
                        num_steps=10, step_sum_s=0.5, num_decode_steps=5, decode_sum_s=0.1,
                        decode_seqs=5, decode_context=500, num_requests=3, num_failed=0,
                        num_kv_waits=waits, num_kv_waiting=1, num_transfers_carrier=carrier,
                        transfer_sum_s=0.1 * carrier, num_transfer_failures=failures)


def test_worker_counters_count_from_the_previous_report_of_the_same_epoch() -> None:
    sample = WorkerSample(at_s=1.0, worker_id="d0", epoch=2, role=Role.DECODE,
                          lease_left_s=2.0, process_alive=True, control_ok=True)
    ticks = worker_ticks([sample], {"d0": health(2, waits=5, carrier=4, failures=1)},
                         {"d0": health(2, waits=3, carrier=1, failures=1)}, {"d0": "slow"})
    tick = ticks["d0"]
    assert (tick.num_kv_waits, tick.num_transfers_carrier, tick.num_transfer_failures) == \
        (2, 3, 0)
    assert tick.kv_usage == 0.9 and tick.num_kv_waiting == 1 and tick.ejected_for == "slow"
    assert tick.transfer_s == pytest.approx(0.3)
    # A restarted worker (a new epoch) counts nothing until its second report.
    fresh = worker_ticks([sample], {"d0": health(3, waits=1, carrier=1, failures=0)},
                         {"d0": health(2, waits=5, carrier=4, failures=1)}, {})["d0"]
    assert (fresh.num_kv_waits, fresh.num_transfers_carrier, fresh.ejected_for) == (0, 0, None)


def test_a_tier_that_fell_quiet_after_its_report_is_reported_again_at_its_next_drop() -> None:
    slow = {"d1": (0.300, 0.031, 0.45, 0, 0, 0, 0.0, 0, None)}
    watch = RootCauseWatch(CONFIG)
    assert len(feed(watch, recording((1, 1, 200, 5.0, 85.0, 30.0, 310.0, 0), slow,
                                     num_recent=12))) == 1
    # No request for 70 s (longer than the baseline), then late requests again.
    quiet = [Snapshot(float(t), {}, workers(STEADY_WORKERS)) for t in range(73, 143)]
    assert feed(watch, quiet) == [] and watch.episodes == {}
    late = [Snapshot(float(t), {"standard": tally((1, 1, 200, 5.0, 85.0, 30.0, 310.0, 0))},
                     workers({**STEADY_WORKERS, **slow})) for t in range(143, 150)]
    assert len(feed(watch, late)) == 1


def test_a_young_agent_compares_rates_over_the_time_it_saw() -> None:
    # The agent started 20 s ago: 10 s of baseline at 2 requests/s, then 2 requests/s
    # with every other one late. The same rate, however short the baseline: no surge.
    snapshots = recording((1, 1, 200, 5.0, 85.0, 30.0, 31.0, 0))[50:]
    report = report_of(snapshots)
    assert report is not None
    assert all(c.kind is not CauseKind.RATE_SURGE for c in report.causes), report.causes


def test_an_overloaded_expert_is_named_first() -> None:
    """d0 runs a mixture-of-experts model whose busiest expert went from 1.2x to 3.5x the
    mean (its traffic turned to one topic): its TPOT grew, and nothing else changed."""
    import dataclasses

    snapshots = recording((1, 1, 200, 5.0, 85.0, 45.0, 31.0, 0))
    for snapshot in snapshots:
        tick = snapshot.workers["d0"]
        hot = 3.5 if snapshot.at_s > 60 else 1.2
        snapshot.workers["d0"] = dataclasses.replace(tick, moe_imbalance=hot)  # type: ignore[index]
    report = report_of(snapshots)
    assert report is not None and report.cause is not None
    assert report.cause.kind is CauseKind.EXPERT_IMBALANCE, report.causes
    assert report.cause.worker_ids == ["d0"] and report.cause.stage is StageName.DECODE_STEP
    assert "3.5x the mean" in report.cause.evidence and "1.2x before" in report.cause.evidence
    # An even (or unchanged) load names nothing of the kind.
    even = report_of(recording((1, 1, 200, 5.0, 85.0, 45.0, 31.0, 0)))
    assert even is not None and CauseKind.EXPERT_IMBALANCE not in [c.kind for c in even.causes]
