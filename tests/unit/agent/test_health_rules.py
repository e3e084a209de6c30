"""The agent's detection rules on hand-written windows of samples (agent/health_rules.py)."""

from __future__ import annotations

import pytest

from agent.health_rules import (Rule, Thresholds, WorkerSample, dead, detect, error_spike, hung,
                                latest_tick, leaked_kv, slow, still_slow)
from protocol.messages import Role
from protocol.worker_load import StepModel

T = Thresholds(lease_margin_s=1.0, hung_after_s=3.0, slow_factor=3.0, leak_after_s=30.0,
               error_rate=0.5, error_min_requests=10)


def sample(at_s: float, worker_id: str = "d-0", epoch: int = 1, role: Role = Role.DECODE,
           **fields) -> WorkerSample:
    base = dict(lease_left_s=2.5, process_alive=True, control_ok=True)
    base.update(fields)
    return WorkerSample(at_s=at_s, worker_id=worker_id, epoch=epoch, role=role, **base)


def test_dead_when_the_process_is_gone_or_the_lease_is_about_to_lapse() -> None:
    assert dead([sample(0.0)], T) is None
    assert dead([sample(0.0, lease_left_s=1.01)], T) is None
    found = dead([sample(0.0), sample(1.0, lease_left_s=0.99, control_ok=False)], T)
    assert found is not None and found.rule is Rule.DEAD and "0.99 s left" in found.evidence
    # A late heartbeat of a worker that still answers is not death.
    assert dead([sample(0.0), sample(1.0, lease_left_s=0.99)], T) is None
    assert dead([sample(0.0, process_alive=False)], T).evidence == "its process is gone"
    assert dead([sample(0.0, lease_left_s=None)], T).evidence == "its registry lease lapsed"
    assert dead([], T) is None


def test_hung_needs_the_whole_window_busy_without_a_step() -> None:
    stuck = [sample(float(t), num_running=2, num_steps=40) for t in range(5)]
    found = hung(stuck, 4.0, T)
    assert found is not None and found.rule is Rule.HUNG and "2 running" in found.evidence
    # One step in the window: alive.
    moving = stuck[:-1] + [sample(4.0, num_running=2, num_steps=41)]
    assert hung(moving, 4.0, T) is None
    # Idle (nothing running): no steps expected.
    idle = [sample(float(t), num_running=0, num_steps=40) for t in range(5)]
    assert hung(idle, 4.0, T) is None
    # Too short a window proves nothing.
    assert hung(stuck[-2:], 4.0, T) is None


def test_hung_when_the_control_api_misses_every_deadline() -> None:
    window = [sample(float(t), control_ok=False) for t in range(5)]
    assert hung(window, 4.0, T).evidence.startswith("its control API missed")
    window[-2] = sample(3.0, control_ok=True)
    assert hung(window, 4.0, T) is None


TICK_S = 1.007  # what the agent's 1 s period gives: each tick also takes its own time


@pytest.mark.parametrize("fields, evidence", [
    (dict(control_ok=False), "its control API missed"),  # refuses every connection
    (dict(num_running=1, num_steps=7), "no engine step"),  # busy, no step
])
def test_hung_fires_once_the_failing_ticks_cover_hung_after_s(fields, evidence) -> None:
    # The lease is renewed all along (lease_left_s 2.5): only `hung` can see it.
    window = [sample(i * TICK_S, **fields) for i in range(30)]
    fired = [i for i in range(1, 30) if hung(window[:i + 1], i * TICK_S, T) is not None]
    # From the first tick at least hung_after_s after the first failing one, at every tick.
    first = next(i for i in range(30) if i * TICK_S >= T.hung_after_s)
    assert fired == list(range(first, 30))
    assert evidence in hung(window, 29 * TICK_S, T).evidence
    # One tick that answered (or one step) within the last hung_after_s clears it.
    if "control" in evidence:
        window[-3] = sample(27 * TICK_S, control_ok=True)
    else:
        window[-3:] = [sample(i * TICK_S, num_running=1, num_steps=8) for i in (27, 28, 29)]
    assert hung(window, 29 * TICK_S, T) is None


def test_hung_waits_for_hung_after_s_of_evidence() -> None:
    # Samples since 1.2 s only: 2.8 s of a 3 s interval proves nothing yet.
    window = [sample(1.2 + i * TICK_S, control_ok=False) for i in range(3)]
    assert hung(window, 4.0, T) is None
    assert hung(window + [sample(4.2 + TICK_S, control_ok=False)], 4.2 + TICK_S, T) is not None


def test_a_restart_starts_a_clean_window() -> None:
    old = [sample(float(t), epoch=1, num_running=1, num_steps=5) for t in range(4)]
    new = [sample(4.0, epoch=2, num_running=1, num_steps=0)]
    assert hung(old + new, 4.0, T) is None


def ticks(worker_id: str, role: Role = Role.DECODE, at: range = range(0, 11), **fields
          ) -> list[WorkerSample]:
    """One sample per second over `at`, 5 engine steps between two."""
    return [sample(float(t), worker_id, role=role, num_steps=5 * t, **fields) for t in at]


def test_slow_is_an_outlier_against_its_role_only() -> None:
    windows = {
        "d-0": ticks("d-0", step_time_s=0.020),
        "d-1": ticks("d-1", step_time_s=0.022),
        "d-2": ticks("d-2", step_time_s=0.070),
        "p-0": ticks("p-0", role=Role.PREFILL, step_time_s=0.500),  # no peers: never slow
    }
    found = slow(windows, 10.0, T)
    assert [(d.worker_id, d.rule) for d in found] == [("d-2", Rule.SLOW)]
    assert "70.0 ms" in found[0].evidence and "21.0 ms" in found[0].evidence
    assert "at all 11 ticks of 10 s (50 steps)" in found[0].evidence
    windows["d-2"] = ticks("d-2", step_time_s=0.060)  # < 3 x 21 ms: not an outlier
    assert slow(windows, 10.0, T) == []


def test_slow_needs_every_tick_of_its_span_and_enough_steps() -> None:
    peers = {w: ticks(w, step_time_s=0.020) for w in ("d-0", "d-1")}
    burst = ticks("d-2", step_time_s=0.200)
    burst[4] = sample(4.0, "d-2", num_steps=20, step_time_s=0.021)  # one normal tick
    assert slow({**peers, "d-2": burst}, 10.0, T) == []
    idle = [sample(float(t), "d-2", num_steps=7, step_time_s=0.2) for t in range(11)]
    assert slow({**peers, "d-2": idle}, 10.0, T) == []  # no steps: nothing measured
    short = ticks("d-2", at=range(5, 11), step_time_s=0.2)  # 5 s of a 10 s span
    assert slow({**peers, "d-2": short}, 10.0, T) == []
    # A tick whose steps all prefilled measures nothing, and breaks nothing.
    missing = ticks("d-2", step_time_s=0.2)
    missing[3] = sample(3.0, "d-2", num_steps=15)
    assert [d.worker_id for d in slow({**peers, "d-2": missing}, 10.0, T)] == ["d-2"]
    sparse = [sample(float(t), "d-2", num_steps=5 * t, step_time_s=0.2 if t in (0, 10) else None)
              for t in range(11)]
    assert slow({**peers, "d-2": sparse}, 10.0, T) == []  # two measurements prove nothing


def test_slow_compares_steps_of_the_same_shape_through_the_peers_models() -> None:
    # Peers fitted ~ 10 ms + 5 ms per sequence: at batch 16 a step takes ~90 ms there.
    model = StepModel(base_s=0.010, prefill_token_s=0.0, decode_seq_s=0.005,
                      context_token_s=0.0, num_samples=64, num_decode_samples=64)
    peers = {w: ticks(w, step_time_s=0.015, step_shape=(1.0, 50.0), step_model=model)
             for w in ("d-0", "d-1")}
    busy = {**peers, "d-2": ticks("d-2", step_time_s=0.095, step_shape=(16.0, 800.0))}
    assert slow(busy, 10.0, T) == []  # 6x the peers' measured steps, but theirs are batch 1
    stuck = {**peers, "d-2": ticks("d-2", step_time_s=0.400, step_shape=(16.0, 800.0))}
    found = slow(stuck, 10.0, T)
    assert [d.worker_id for d in found] == ["d-2"]
    assert "90.0 ms" in found[0].evidence and "batch 16.0" in found[0].evidence
    # An idle peer (no recent step) still counts through its model.
    idle = {"d-0": ticks("d-0", step_model=model), "d-2": stuck["d-2"]}
    assert [d.worker_id for d in slow(idle, 10.0, T)] == ["d-2"]


def test_still_slow_judges_an_idle_worker_by_its_own_model_at_its_last_shape() -> None:
    def model(base_s: float, num_decode_samples: int = 64) -> StepModel:
        return StepModel(base_s=base_s, prefill_token_s=0.0, decode_seq_s=0.005,
                         context_token_s=0.0, num_samples=64,
                         num_decode_samples=num_decode_samples)
    peers = {w: ticks(w, step_model=model(0.010)) for w in ("d-0", "d-1")}
    # Measured at batch 4 when it was ejected, no step since (the router sends it nothing).
    measured = [sample(0.0, "d-2", step_time_s=0.4, step_shape=(4.0, 100.0))]
    idle = [sample(float(t), "d-2", step_model=model(0.300)) for t in range(1, 11)]
    windows = {**peers, "d-2": measured + idle}
    found = still_slow(windows["d-2"], latest_tick(windows), T)
    assert found is not None and found.rule == Rule.SLOW and found.worker_id == "d-2"
    assert found.evidence == ("still slow by its own step model: 320.0 ms vs 30.0 ms its "
                              "peers take at batch 4.0, context 100")
    windows["d-2"] = measured + [sample(float(t), "d-2", step_model=model(0.050))
                                 for t in range(1, 11)]  # < 3 x 30 ms: recovered
    assert still_slow(windows["d-2"], latest_tick(windows), T) is None
    no_decode = [sample(10.0, "d-2", step_model=model(0.3, num_decode_samples=0))]
    assert still_slow(measured + no_decode, latest_tick(windows), T) is None
    assert still_slow(idle, latest_tick(windows), T) is None  # no shape ever measured
    alone = {"d-2": measured + idle}
    assert still_slow(alone["d-2"], latest_tick(alone), T) is None  # no peer to compare with


def test_fast_steps_are_never_slow() -> None:
    windows = {"a": ticks("a", step_time_s=0.0001), "b": ticks("b", step_time_s=0.004)}
    assert slow(windows, 10.0, T) == []


def test_leaked_kv_is_blocks_held_with_nothing_to_hold_them_for_long() -> None:
    window = [sample(float(t), num_kv_blocks_used=3) for t in range(0, 40, 5)]
    found = leaked_kv(window, 40.0, T)
    assert found is not None and "3 KV block(s)" in found.evidence
    assert leaked_kv(window, 25.0, T) is None  # not yet leak_after_s
    busy = window[:-1] + [sample(35.0, num_kv_blocks_used=3, num_waiting=1)]
    assert leaked_kv(busy, 40.0, T) is None


def test_error_spike_counts_the_window_not_the_lifetime() -> None:
    window = [sample(0.0, num_requests=100, num_failed=90),
              sample(5.0, num_requests=110, num_failed=91)]
    assert error_spike(window, T) is None  # 1 of the last 10 failed
    window.append(sample(10.0, num_requests=120, num_failed=101))
    found = error_spike(window, T)
    assert found is not None and found.evidence == "11 of its last 20 requests failed"
    few = [sample(0.0), sample(5.0, num_requests=4, num_failed=4)]
    assert error_spike(few, T) is None  # under error_min_requests


def test_detect_reports_the_gravest_finding_once_per_worker() -> None:
    windows = {
        "d-0": [sample(0.0, "d-0", lease_left_s=0.5, control_ok=False, step_time_s=0.5)],
        "d-1": [sample(0.0, "d-1", step_time_s=0.01)],
        "d-2": [sample(0.0, "d-2", step_time_s=0.01)],
    }
    assert [(d.worker_id, d.rule) for d in detect(windows, 0.0, T)] == [("d-0", Rule.DEAD)]


@pytest.mark.parametrize("bad", [dict(hung_after_s=0), dict(slow_factor=1.0), dict(slow_for_s=0),
                                 dict(error_rate=0.0), dict(error_rate=1.5)])
def test_thresholds_refuse_nonsense(bad) -> None:
    with pytest.raises(ValueError):
        Thresholds(**bad)
