"""A worker's case through its lifecycle, without processes (agent/worker_case.py): every
transition is pure, and each test checks the case's invariants after every step."""

from __future__ import annotations

import dataclasses

import pytest

from agent.decision import Routine
from agent.guard_rails import ActionKind, Ledger
from agent.health_rules import Detection, Rule, WorkerSample
from agent.worker_case import (CaseState, Drop, Hold, Readmit, Recover, ReportLost, Restart,
                               Restrike, Sighting, Timing, WorkerCase, advance)
from protocol.messages import Role

TIMING = Timing(probation_s=10.0, drain_timeout_s=30.0, restart_grace_s=180.0,
                lease_margin_s=1.0)


def sample(epoch: int = 1, **fields) -> WorkerSample:
    base = dict(at_s=0.0, worker_id="d-0", epoch=epoch, role=Role.DECODE, lease_left_s=2.5,
                process_alive=True, control_ok=True)
    return WorkerSample(**{**base, **fields})


def seen(last: WorkerSample | None = None, known_epoch: int | None = 1,
         live_epoch: int | None = 1, still_slow: Detection | None = None) -> Sighting:
    return Sighting(last, known_epoch, live_epoch, still_slow)


def found(rule: Rule, epoch: int = 1) -> Detection:
    return Detection("d-0", epoch, rule, f"{rule.value} seen")


def checked(case: WorkerCase) -> WorkerCase:
    case.check_invariants()
    return case


def healthy_case() -> WorkerCase:
    return checked(WorkerCase("d-0", Ledger(1)))


def step(case: WorkerCase, sighting: Sighting, now_s: float):
    case, follow = advance(case, sighting, now_s, TIMING)
    return checked(case), follow


def test_a_slow_worker_is_ejected_then_readmitted_once_healthy_after_its_probation() -> None:
    case = checked(healthy_case().struck(found(Rule.SLOW), restart=False, restartable=True,
                                         now_s=100.0, probation_s=10.0))
    assert case.state is CaseState.EJECTED and case.out
    assert case.held() == Hold(1, Rule.SLOW, 100.0, 100.0) and case.readmit_after_s == 110.0
    assert case.ledger.strikes_in(1) == 1
    # Health checks pass from 101 s, but the probation runs to 110 s.
    case, follow = step(case, seen(sample()), 101.0)
    assert follow is None and case.healthy_since_s == 101.0
    case, follow = step(case, seen(sample()), 109.9)
    assert follow is None
    case, follow = step(case, seen(sample()), 110.0)
    assert follow == Readmit("ejected for slow; healthy for 9 s")
    back = checked(case.released())
    assert back.state is CaseState.HEALTHY and not back.out
    assert back.ledger.strikes_in(1) == 1  # found bad again in this epoch: a second strike


def test_a_failed_health_check_restarts_the_healthy_count() -> None:
    case = healthy_case().struck(found(Rule.ERROR_SPIKE), False, True, 100.0, 10.0)
    case, _ = step(case, seen(sample()), 101.0)
    case, follow = step(case, seen(sample(control_ok=False)), 108.0)
    assert follow is None and case.healthy_since_s is None
    case, follow = step(case, seen(sample(lease_left_s=0.5)), 109.0)  # under the margin
    assert follow is None and case.healthy_since_s is None
    case, follow = step(case, seen(sample()), 110.0)
    assert follow is None and case.healthy_since_s == 110.0
    case, follow = step(case, seen(sample()), 113.0)  # min(probation, 3 s) of passing checks
    assert isinstance(follow, Readmit)


@pytest.mark.parametrize("last", [None, sample(epoch=2)])
def test_an_ejection_whose_epoch_is_gone_is_dropped(last: WorkerSample | None) -> None:
    case = healthy_case().struck(found(Rule.SLOW), False, True, 100.0, 10.0)
    case, follow = step(case, seen(last), 101.0)
    assert follow == Drop()
    assert checked(case.released()).state is CaseState.HEALTHY


def test_a_slow_worker_its_own_model_still_calls_slow_is_struck_again() -> None:
    case = healthy_case().struck(found(Rule.SLOW), False, True, 100.0, 10.0)
    verdict = Detection("d-0", 1, Rule.SLOW, "still slow by its own step model")
    case, _ = step(case, seen(sample(), still_slow=verdict), 101.0)
    case, follow = step(case, seen(sample(), still_slow=verdict), 110.0)
    assert follow == Restrike(verdict)
    # Struck again in the same epoch while alive: drained first, then restarted.
    drained = checked(case.struck(verdict, restart=True, restartable=True, now_s=110.0,
                                  probation_s=10.0))
    assert drained.state is CaseState.DRAINING and drained.ledger.strikes_in(1) == 2
    assert drained.drain_reason == "still slow by its own step model"


def test_an_error_spike_is_judged_by_its_health_checks_alone() -> None:
    case = healthy_case().struck(found(Rule.ERROR_SPIKE), False, True, 100.0, 10.0)
    verdict = Detection("d-0", 1, Rule.SLOW, "slow by its model")  # not what it was out for
    case, _ = step(case, seen(sample(), still_slow=verdict), 101.0)
    _, follow = step(case, seen(sample(), still_slow=verdict), 110.0)
    assert isinstance(follow, Readmit)


def draining_case(now_s: float = 100.0) -> WorkerCase:
    return checked(healthy_case().struck(found(Rule.SLOW), True, True, now_s, 10.0))


def test_a_draining_worker_is_restarted_once_it_runs_nothing() -> None:
    case = draining_case()
    case, follow = step(case, seen(sample(num_running=2)), 105.0)
    assert follow is None and case.state is CaseState.DRAINING
    case, follow = step(case, seen(sample(num_running=0, num_waiting=0)), 106.0)
    assert case.state is CaseState.HELD_OUT and case.drain_reason is None
    assert follow == Restart(1, "drained", "slow seen")
    restarting = checked(case.restart_begun(106.5))
    assert restarting.state is CaseState.RESTARTING and restarting.held().since_s == 106.5


def test_a_busy_draining_worker_is_cut_when_its_drain_time_is_up() -> None:
    case, follow = step(draining_case(), seen(sample(num_running=1)), 131.0)
    assert case.state is CaseState.HELD_OUT
    assert follow == Restart(1, "drain cut after 31 s", "slow seen")


@pytest.mark.parametrize("sighting", [
    seen(sample(num_running=1), known_epoch=None),  # gone from the registry
    seen(sample(epoch=2, num_running=1), known_epoch=2),  # replaced by a newer epoch
])
def test_a_draining_worker_gone_or_replaced_is_not_restarted(sighting: Sighting) -> None:
    case, follow = step(draining_case(), sighting, 101.0)
    assert case.state is CaseState.HELD_OUT and follow is None


def test_a_dead_worker_is_restarted_and_its_new_epoch_put_on_probation() -> None:
    case = checked(healthy_case().struck(found(Rule.DEAD), True, True, 100.0, 10.0))
    assert case.state is CaseState.HELD_OUT  # alive and answering it is not: no drain
    case = checked(case.restart_begun(100.0))
    case, follow = step(case, seen(known_epoch=1, live_epoch=None), 120.0)
    assert follow is None and case.state is CaseState.RESTARTING
    case, follow = step(case, seen(known_epoch=1, live_epoch=1), 121.0)
    assert follow is None
    case, follow = step(case, seen(known_epoch=2, live_epoch=2), 122.0)
    assert follow == Recover(2)
    on_probation = checked(case.recovered(2, on_probation=True, now_s=122.0, probation_s=10.0))
    assert on_probation.state is CaseState.EJECTED
    assert on_probation.held() == Hold(2, Routine.PROBATION, 122.0, 122.0)
    assert on_probation.readmit_after_s == 132.0
    assert on_probation.ledger.strikes_in(2) == 0  # a new incarnation starts clean
    admitted = checked(case.recovered(2, on_probation=False, now_s=122.0, probation_s=10.0))
    assert admitted.state is CaseState.HEALTHY


def test_a_restart_that_brings_no_new_epoch_is_reported_and_held_out() -> None:
    case = healthy_case().struck(found(Rule.HUNG), True, True, 100.0, 10.0).restart_begun(100.0)
    case, follow = step(case, seen(live_epoch=None), 280.0)
    assert follow is None
    case, follow = step(case, seen(live_epoch=None), 280.5)
    assert case.state is CaseState.HELD_OUT and case.out
    assert follow == ReportLost("no new epoch within 180 s")
    # Held out with nothing under way: time alone moves it no further.
    assert step(case, seen(live_epoch=2), 900.0) == (case, None)


def test_a_worker_that_cannot_be_restarted_is_held_out_not_drained() -> None:
    case = checked(healthy_case().struck(found(Rule.SLOW), True, False, 100.0, 10.0))
    assert case.state is CaseState.HELD_OUT and case.drain_reason is None


def test_what_a_case_handles_already() -> None:
    ejected = healthy_case().struck(found(Rule.SLOW), False, True, 100.0, 10.0)
    assert ejected.handling(found(Rule.SLOW)) and ejected.handling(found(Rule.ERROR_SPIKE))
    assert not ejected.handling(found(Rule.DEAD))  # graver: acted on at once
    assert not ejected.handling(found(Rule.SLOW, epoch=2))  # another incarnation
    assert draining_case().handling(found(Rule.DEAD))
    assert not healthy_case().handling(found(Rule.SLOW))
    held_out = healthy_case().struck(found(Rule.DEAD), True, True, 100.0, 10.0)
    assert not held_out.handling(found(Rule.DEAD))  # struck again after its cooldown


def test_misuse_raises() -> None:
    with pytest.raises(ValueError):
        draining_case().struck(found(Rule.DEAD), True, True, 101.0, 10.0)
    with pytest.raises(ValueError):
        healthy_case().restart_begun(100.0)
    with pytest.raises(ValueError):
        draining_case().recovered(2, True, 101.0, 10.0)
    with pytest.raises(ValueError):
        healthy_case().renewed(100.0)


def test_renewal_and_stamps_keep_the_state() -> None:
    case = draining_case()
    renewed = checked(case.renewed(200.0))
    assert renewed.held().renewed_s == 200.0 and renewed.state is CaseState.DRAINING
    stamped = checked(renewed.stamped(1, ActionKind.RECLAIM_KV, 201.0))
    assert stamped.ledger.last_in(1, ActionKind.RECLAIM_KV) == 201.0
    assert stamped.ledger.strikes_in(1) == 1 and stamped.state is CaseState.DRAINING


def test_the_ledger_starts_afresh_for_another_epoch() -> None:
    ledger = Ledger(1).struck(1).stamped(1, ActionKind.EJECT, 5.0)
    assert (ledger.strikes_in(1), ledger.last_in(1, ActionKind.EJECT)) == (1, 5.0)
    assert (ledger.strikes_in(2), ledger.last_in(2, ActionKind.EJECT)) == (0, None)
    newer = ledger.stamped(2, ActionKind.RECLAIM_KV, 9.0)
    assert newer == Ledger(2, 0, {ActionKind.RECLAIM_KV: 9.0})


def test_an_adopted_ejection_is_on_probation() -> None:
    case = checked(WorkerCase.adopted("d-0", 4, Rule.ERROR_SPIKE, 50.0, 10.0))
    assert case.state is CaseState.EJECTED and case.readmit_after_s == 60.0
    assert case.held() == Hold(4, Rule.ERROR_SPIKE, 50.0, 50.0)


@pytest.mark.parametrize("broken", [
    dict(state=CaseState.HEALTHY),  # holding an ejection while healthy
    dict(readmit_after_s=None),  # ejected with no end to its probation
    dict(drain_reason="why"),  # a drain reason while not draining
    dict(healthy_since_s=99.0),  # healthy since before it was ejected
    dict(hold=Hold(1, Routine.PROBATION, 100.0, 100.0), state=CaseState.RESTARTING,
         readmit_after_s=None),  # a probation restarting
])
def test_check_invariants_catches_a_broken_case(broken: dict) -> None:
    case = healthy_case().struck(found(Rule.SLOW), False, True, 100.0, 10.0)
    with pytest.raises(AssertionError):
        dataclasses.replace(case, **broken).check_invariants()
