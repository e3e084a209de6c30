"""The concurrency limit follows the workers' latency: down fast when a tier's backend TTFT
misses its target, up slowly while requests wait and latency is low; lower tiers are shed
only while the most urgent tier is predicted or measured to miss, never while it meets."""

from __future__ import annotations

import pytest

from gateway.admission.admission import AdmissionController, Rejected
from gateway.admission.capacity import (CapacityBounds, CapacityGovernor, GateState, TtftWindow,
                                        limit_tiers, next_limit, predicted_pressure, pressure,
                                        protected_until)
from gateway.admission.tiers import TierSpec

BOUNDS = CapacityBounds(min_limit=2, max_limit=64, high=0.6, low=0.3)


def test_the_limit_drops_below_what_runs_when_latency_is_high() -> None:
    assert next_limit(1024, num_running=40, num_queued=0, pressure=0.9, bounds=BOUNDS) == 30
    assert next_limit(30, num_running=40, num_queued=5, pressure=0.9, bounds=BOUNDS) == 22
    assert next_limit(2, num_running=2, num_queued=5, pressure=5.0, bounds=BOUNDS) == 2


def test_the_limit_grows_only_while_requests_wait_and_latency_is_low() -> None:
    assert next_limit(16, num_running=16, num_queued=3, pressure=0.1, bounds=BOUNDS) == 18
    assert next_limit(16, num_running=16, num_queued=0, pressure=0.1, bounds=BOUNDS) == 16
    assert next_limit(64, num_running=64, num_queued=3, pressure=0.1, bounds=BOUNDS) == 64
    assert next_limit(16, num_running=16, num_queued=3, pressure=0.45, bounds=BOUNDS) == 16
    assert next_limit(16, num_running=16, num_queued=3, pressure=None, bounds=BOUNDS) == 16


def test_pressure_is_the_worst_tier_against_its_own_target() -> None:
    assert pressure({"interactive": 0.3, "batch": 10.0}, {"interactive": 0.5, "batch": 60.0}) \
        == pytest.approx(0.6)
    assert pressure({}, {"interactive": 0.5}) is None


def test_the_window_forgets_old_samples() -> None:
    now = [0.0]
    window = TtftWindow(window_s=10.0, clock=lambda: now[0])
    for i in range(10):
        window.observe("interactive", 0.1 * (i + 1))
    assert window.p90() == {"interactive": pytest.approx(1.0)}
    now[0] = 20.0
    assert window.p90() == {}


def test_a_governor_converges_on_what_a_simulated_cluster_sustains() -> None:
    """A cluster whose TTFT grows with concurrency past 8 requests: the limit settles
    where the most urgent tier keeps its target, with requests waiting at the gateway."""
    now = [0.0]
    window = TtftWindow(window_s=2.0, clock=lambda: now[0])
    state = {"limit": 64}

    def cluster_ttft_s(running: int) -> float:
        return 0.05 * max(1, running - 7)  # fine up to 8 at once, then worse per request

    def get_state() -> GateState:
        limit = state["limit"]
        return GateState(limit, limit, 100, 0)  # always saturated: 100 requests wait

    governor = CapacityGovernor(window, {"interactive": 0.5}, ("interactive",), get_state,
                                lambda n: state.__setitem__("limit", n), lambda on: None,
                                BOUNDS, clock=lambda: now[0])
    for _ in range(200):
        now[0] += 0.5
        window.observe("interactive", cluster_ttft_s(state["limit"]))
        governor.tick()
    assert 8 <= state["limit"] <= 13, state  # p90 0.05..0.3 s: under 0.6 x 0.5 s
    assert governor.num_changes > 0


def test_protection_starts_when_the_urgent_tier_is_predicted_to_miss_and_holds() -> None:
    bounds = CapacityBounds(hold_s=5.0)
    assert protected_until(10.0, float("-inf"), 0.9, bounds) == float("-inf")  # it meets
    assert protected_until(10.0, float("-inf"), None, bounds) == float("-inf")
    assert protected_until(10.0, float("-inf"), 1.2, bounds) == 15.0
    assert protected_until(12.0, 15.0, 0.1, bounds) == 15.0  # calm: the hold runs out
    assert protected_until(14.0, 15.0, 1.1, bounds) == 19.0  # at risk again: extended


def test_the_prediction_adds_the_queue_wait_to_the_backend_ttft() -> None:
    targets = {"interactive": 0.5}
    assert predicted_pressure({"interactive": 0.3}, 0.0, targets) == pytest.approx(0.6)
    assert predicted_pressure({"interactive": 0.3}, 0.3, targets) == pytest.approx(1.2)
    assert predicted_pressure({}, 0.6, targets) == pytest.approx(1.2)  # a queue, no samples
    assert predicted_pressure({}, 0.0, targets) is None


def test_the_governor_protects_on_the_urgent_tier_alone() -> None:
    """Batch far past its own target does not trigger protection; interactive past its
    own does."""
    now = [0.0]
    window = TtftWindow(window_s=10.0, clock=lambda: now[0])
    calls: list[bool] = []
    governor = CapacityGovernor(window, {"interactive": 0.5, "batch": 60.0}, ("interactive",),
                                lambda: GateState(16, 16, 0, 0), lambda n: None, calls.append,
                                CapacityBounds(hold_s=5.0), clock=lambda: now[0])
    window.observe("interactive", 0.1)
    window.observe("batch", 100.0)
    governor.tick()
    assert calls[-1] is False
    window.observe("interactive", 0.55)
    window.observe("interactive", 0.55)
    governor.tick()
    assert calls[-1] is True and governor.protecting
    now[0] = 30.0  # samples aged out, hold over
    governor.tick()
    assert calls[-1] is False


def test_only_tiers_refused_at_their_target_move_the_limit() -> None:
    """Standard waits past its TTFT target (served late): its slow TTFT must not shrink the
    limit; interactive, refused at its target, does."""
    from gateway.admission.tiers import load_tier_config

    tiers = load_tier_config(None, {}).tiers
    assert limit_tiers(tiers.values()) == ("interactive",)
    now = [0.0]
    window = TtftWindow(window_s=10.0, clock=lambda: now[0])
    limits: list[int] = []
    governor = CapacityGovernor(window, {t.name: t.ttft_ms / 1000 for t in tiers.values()},
                                ("interactive",), lambda: GateState(64, 64, 10, 0),
                                limits.append, lambda on: None, CapacityBounds(),
                                clock=lambda: now[0], limit_tiers=limit_tiers(tiers.values()))
    for _ in range(5):
        window.observe("standard", 30.0)  # 15x its 2 s target
    assert governor.tick() == 64 and limits == []
    window.observe("interactive", 0.45)  # 0.9 of its 0.5 s target: it meets
    assert governor.tick() == 64 and limits == []
    window.observe("interactive", 0.6)
    window.observe("interactive", 0.6)  # 1.2 of it: it misses
    assert governor.tick() == 48 and limits == [48]


INTERACTIVE = TierSpec("interactive", priority=0, ttft_ms=500, tpot_ms=50, max_queued=64,
                       max_running=64, tokens_per_min=None)
BATCH = TierSpec("batch", priority=2, ttft_ms=10_000, tpot_ms=250, max_queued=64,
                 max_running=64, tokens_per_min=None, max_wait_ms=60_000)


def run_overloaded(interactive_ttft_s: float, interactive_queued: bool) -> tuple[
        list[object], CapacityGovernor]:
    """A saturated gateway (every slot taken) under a governor: what batch arrivals get."""
    now = [0.0]
    controller = AdmissionController((INTERACTIVE, BATCH), max_running_total=8,
                                     max_queued_total=64, clock=lambda: now[0])
    for i in range(8):
        controller.submit(f"b{i}", "batch")  # every slot busy
    if interactive_queued:
        controller.submit("i-queued", "interactive")
    window = TtftWindow(window_s=10.0, clock=lambda: now[0])
    governor = CapacityGovernor(
        window, {"interactive": 0.5, "batch": 10.0}, ("interactive",),
        lambda: GateState(controller.max_running_total, controller.num_running,
                          controller.num_queued, controller.num_queued_urgent(),
                          controller.urgent_wait_s()),
        controller.set_capacity, controller.set_protection, CapacityBounds(),
        clock=lambda: now[0], limit_tiers=("interactive",))
    answers = []
    for i in range(20):
        now[0] += 0.5
        window.observe("interactive", interactive_ttft_s)
        window.observe("batch", 0.12)  # batch meets its 10 s target 80x over
        governor.tick()
        answers.append(controller.submit(f"late-batch-{i}", "batch"))
        controller.check_invariants()
    return answers, governor


def test_a_tier_meeting_its_targets_is_never_shed() -> None:
    # Interactive at 90% of its target and queued behind a full house: it still meets, so
    # no batch arrival is refused to protect it, and the limit is never cut.
    answers, governor = run_overloaded(interactive_ttft_s=0.45, interactive_queued=False)
    assert not [a for a in answers if isinstance(a, Rejected)]
    assert not governor.protecting and governor.num_changes == 0


def test_a_lower_tier_is_shed_only_while_a_higher_one_is_predicted_to_miss() -> None:
    # The same backend TTFT, but an interactive request waits for a slot: its wait plus the
    # backend's TTFT passes its target, so batch arrivals are refused (429) to protect it.
    answers, governor = run_overloaded(interactive_ttft_s=0.45, interactive_queued=True)
    refused = [a for a in answers if isinstance(a, Rejected)]
    assert refused and all(r.reason == "overload" for r in refused)
    assert governor.protecting
