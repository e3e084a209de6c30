from __future__ import annotations

import pytest

from gateway.admission.admission import AdmissionController, Admitted, Queued, Rejected
from gateway.admission.rate_limit import TokenRateLimiter
from gateway.admission.tiers import TierSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tier(name, priority, ttft_ms, max_queued=100, max_running=100,
         max_wait_ms=None) -> TierSpec:
    return TierSpec(name, priority=priority, ttft_ms=ttft_ms, tpot_ms=50, max_queued=max_queued,
                    max_running=max_running, tokens_per_min=None, local_prefill_max_tokens=0,
                    max_wait_ms=max_wait_ms)


INTERACTIVE = tier("interactive", 0, ttft_ms=10_000)
STANDARD = tier("standard", 1, ttft_ms=20_000)
BATCH = tier("batch", 2, ttft_ms=600_000)


def controller(capacity=2, max_queued_total=100, tiers=(INTERACTIVE, STANDARD, BATCH),
               service_s=1.0) -> tuple[AdmissionController, Clock]:
    clock = Clock()
    return AdmissionController(list(tiers), capacity, max_queued_total, clock,
                               initial_service_s=service_s), clock


def test_admits_until_capacity_then_queues():
    c, _ = controller(capacity=2)
    assert c.submit("a", "standard") == Admitted("a")
    assert c.submit("b", "standard") == Admitted("b")
    assert isinstance(c.submit("c", "standard"), Queued)
    c.check_invariants()
    assert c.release("a") == ("c",)
    c.check_invariants()
    assert c.num_running == 2 and c.num_queued == 0


def test_priority_order_interactive_never_waits_behind_batch():
    c, clock = controller(capacity=1)
    assert c.submit("running", "batch") == Admitted("running")
    for i in range(3):
        assert isinstance(c.submit(f"batch{i}", "batch"), Queued)
    clock.now += 1
    assert isinstance(c.submit("std", "standard"), Queued)
    assert isinstance(c.submit("inter", "interactive"), Queued)
    order = []
    running = "running"
    for _ in range(5):
        (running,) = c.release(running)
        order.append(running)
        c.check_invariants()
    assert order == ["inter", "std", "batch0", "batch1", "batch2"]


def test_within_a_tier_earliest_deadline_first():
    c, clock = controller(capacity=1)
    c.submit("run", "standard")
    for name in ("x", "y", "z"):
        c.submit(name, "standard")
        clock.now += 0.1
    assert c.release("run") == ("x",)
    assert c.release("x") == ("y",)


def test_batch_capped_by_its_max_running_leaves_slots_for_interactive():
    batch = tier("batch", 2, ttft_ms=600_000, max_running=2)
    c, _ = controller(capacity=3, tiers=(INTERACTIVE, STANDARD, batch))
    assert c.submit("b0", "batch") == Admitted("b0")
    assert c.submit("b1", "batch") == Admitted("b1")
    assert isinstance(c.submit("b2", "batch"), Queued)  # global slot free, tier full
    assert c.submit("i0", "interactive") == Admitted("i0")
    c.check_invariants()


def test_early_rejection_when_ttft_deadline_cannot_be_met():
    fast = tier("interactive", 0, ttft_ms=2_500)
    c, _ = controller(capacity=1, tiers=(fast, STANDARD, BATCH), service_s=1.0)
    c.submit("run", "interactive")
    # Each queued request adds ~1 s (mean service 1 s / 1 slot) to the wait.
    assert isinstance(c.submit("q1", "interactive"), Queued)
    assert isinstance(c.submit("q2", "interactive"), Queued)
    rejected = c.submit("q3", "interactive")
    assert isinstance(rejected, Rejected) and rejected.reason == "deadline"
    assert rejected.retry_after_s == pytest.approx(3.0)
    c.check_invariants()
    assert c.num_queued == 2  # the rejected one holds nothing


def test_under_overload_lower_tiers_are_rejected_first():
    """Same backlog, three tiers: batch's long TTFT target tolerates it, but a tier's
    backlog includes every queued request of more urgent tiers."""
    inter = tier("interactive", 0, ttft_ms=3_500)
    std = tier("standard", 1, ttft_ms=3_500)
    c, _ = controller(capacity=1, tiers=(inter, std, BATCH), service_s=1.0)
    c.submit("run", "standard")
    assert isinstance(c.submit("i1", "interactive"), Queued)
    assert isinstance(c.submit("i2", "interactive"), Queued)
    assert isinstance(c.submit("s1", "standard"), Queued)
    # Now interactive still fits (3 ahead of it: i1, i2 -> wait 3 s < 3.5 s) ...
    assert isinstance(c.submit("i3", "interactive"), Queued)
    # ... standard does not (i1, i2, i3, s1 ahead: 5 s > 3.5 s).
    assert isinstance(c.submit("s2", "standard"), Rejected)
    c.check_invariants()


def test_full_shared_queue_sheds_least_urgent_lower_tier_first():
    c, clock = controller(capacity=1, max_queued_total=3)
    c.submit("run", "batch")
    c.submit("b0", "batch")
    clock.now += 1
    c.submit("b1", "batch")  # later deadline: shed first
    c.submit("s0", "standard")
    outcome = c.submit("i0", "interactive")
    assert isinstance(outcome, Queued)
    assert [r.request_id for r in outcome.shed] == ["b1"]
    assert outcome.shed[0].reason == "shed"
    outcome = c.submit("i1", "interactive")
    assert [r.request_id for r in outcome.shed] == ["b0"]
    # Only more urgent arrivals may shed: a batch arrival is refused instead.
    refused = c.submit("b2", "batch")
    assert isinstance(refused, Rejected) and refused.reason == "queue_full"
    c.check_invariants()
    assert c.release("run") == ("i0",)


def test_protection_sheds_lower_tiers_at_once_and_caps_their_share():
    c, _ = controller(capacity=4)
    c.set_protection(True)
    assert c.submit("b1", "batch") == Admitted("b1")
    assert c.submit("b2", "batch") == Admitted("b2")  # half of 4 slots
    rejected = c.submit("b3", "batch")  # a slot is free, but not within batch's share
    assert isinstance(rejected, Rejected) and rejected.reason == "overload"
    assert rejected.retry_after_s >= 1.0
    assert c.submit("i1", "interactive") == Admitted("i1")
    assert c.submit("i2", "interactive") == Admitted("i2")
    assert isinstance(c.submit("i3", "interactive"), Queued)  # urgent tiers still queue
    c.check_invariants()
    assert c.release("b1") == ("i3",)
    c.check_invariants()


def test_queued_lower_tiers_start_when_protection_ends():
    c, _ = controller(capacity=2)
    assert c.submit("b1", "batch") == Admitted("b1")
    assert c.submit("b2", "batch") == Admitted("b2")
    assert isinstance(c.submit("b3", "batch"), Queued)
    c.set_protection(True)
    assert c.release("b1") == ()  # a free slot, but batch is at its share (1 of 2)
    c.check_invariants()
    assert c.set_protection(False) == ("b3",)
    c.check_invariants()


def test_tier_queue_limit():
    small = tier("standard", 1, ttft_ms=60_000, max_queued=1)
    c, _ = controller(capacity=1, tiers=(INTERACTIVE, small, BATCH))
    c.submit("run", "standard")
    assert isinstance(c.submit("q", "standard"), Queued)
    refused = c.submit("q2", "standard")
    assert isinstance(refused, Rejected) and refused.reason == "tier_queue_full"


def test_a_tier_with_a_longer_wait_limit_queues_what_would_miss_its_ttft_and_expires_later():
    patient = tier("standard", 1, ttft_ms=2_500, max_wait_ms=4_500)
    c, clock = controller(capacity=1, tiers=(INTERACTIVE, patient, BATCH), service_s=1.0)
    c.submit("run", "standard")
    # Waits of ~1, 2, 3, 4 s (mean service 1 s / 1 slot): past the 2.5 s TTFT target from
    # q3 on, yet queued up to the 4.5 s wait limit; q5 (~5 s) is refused.
    for rid in ("q1", "q2", "q3", "q4"):
        assert isinstance(c.submit(rid, "standard"), Queued), rid
    rejected = c.submit("q5", "standard")
    assert isinstance(rejected, Rejected) and rejected.reason == "deadline"
    assert rejected.retry_after_s == pytest.approx(5.0)
    # Past the TTFT target nothing expires; past the wait limit everything still queued does.
    clock.now += 2.5 + 0.001
    assert c.expire() == ()
    assert c.release("run") == ("q1",)
    clock.now += 2.0
    assert [r.request_id for r in c.expire()] == ["q2", "q3", "q4"]
    c.check_invariants()
    assert c.num_queued == 0 and c.is_running("q1")


def test_expire_rejects_queued_requests_past_their_deadline():
    c, clock = controller(capacity=1)
    c.submit("run", "batch")
    c.submit("i", "interactive")
    c.submit("b", "batch")
    clock.now += INTERACTIVE.ttft_ms / 1000 + 0.001
    expired = c.expire()
    assert [r.request_id for r in expired] == ["i"]
    c.check_invariants()
    assert c.release("run") == ("b",)


def test_cancel_of_queued_and_running_requests():
    c, _ = controller(capacity=1)
    c.submit("run", "standard")
    c.submit("q1", "standard")
    c.submit("q2", "standard")
    assert c.cancel("q1") == ()
    assert c.cancel("run") == ("q2",)
    assert c.cancel("unknown") == ()
    c.check_invariants()


def test_service_time_estimate_learns_from_releases():
    c, clock = controller(capacity=1, service_s=1.0)
    for i in range(50):
        c.submit(f"r{i}", "batch")
        clock.now += 5.0
        c.release(f"r{i}")
    assert c.mean_service_s == pytest.approx(5.0, rel=0.01)


def test_larger_capacity_admits_queued_requests():
    c, _ = controller(capacity=1)
    c.submit("a", "standard")
    c.submit("b", "standard")
    c.submit("c", "standard")
    assert c.set_capacity(3) == ("b", "c")
    c.check_invariants()


def test_duplicate_submission_is_a_programming_error():
    c, _ = controller()
    c.submit("a", "standard")
    with pytest.raises(ValueError):
        c.submit("a", "standard")


def test_token_bucket_limits_refills_and_refunds():
    clock = Clock()
    limiter = TokenRateLimiter(clock)
    assert limiter.try_consume("k", 600, tokens_per_min=1000) is None
    wait = limiter.try_consume("k", 600, tokens_per_min=1000)
    assert wait == pytest.approx(200 * 60 / 1000)  # 200 tokens short at 1000/min
    clock.now += wait
    assert limiter.try_consume("k", 600, tokens_per_min=1000) is None
    limiter.refund("k", 500, tokens_per_min=1000)
    assert limiter.level("k", 1000) == pytest.approx(500)
    limiter.refund("k", 10_000, tokens_per_min=1000)
    assert limiter.level("k", 1000) == pytest.approx(1000)  # never above capacity
    assert limiter.try_consume("other", 1, tokens_per_min=1000) is None  # keys are separate
    limiter.check_invariants({"k": 1000, "other": 1000})
