"""Expert placement and the replication planner (pure): a skewed load gets its hot experts
copied to the least loaded ranks, an even load moves nothing, and no expert is ever left
without a copy."""

from __future__ import annotations

import random

import pytest

from engine.expert_balance import plan_replicas
from engine.expert_placement import ExpertPlacement, homes, spread


def test_spread_puts_contiguous_experts_on_each_rank_and_refuses_what_does_not_divide() -> None:
    placement = spread(8, 2)
    assert placement.held(0) == (0, 1, 2, 3) and placement.held(1) == (4, 5, 6, 7)
    assert placement.share(1, 5) == (0, 1) and placement.share(0, 5) is None
    with pytest.raises(ValueError, match="does not divide"):
        spread(6, 4)


def test_loads_split_a_replicated_expert_evenly_between_its_copies() -> None:
    placement = ExpertPlacement(2, ((0, 1), (0,), (1,), (1,)))
    placement.check(slots_per_rank=3)
    assert placement.rank_loads([100, 10, 10, 10]) == [60, 70]
    assert placement.share(1, 0) == (1, 2)
    assert spread(4, 2).imbalance([100, 10, 10, 10]) == pytest.approx(110 / 65)


def test_a_skewed_load_gets_its_hot_expert_copied_to_the_other_rank() -> None:
    current = spread(8, 2)
    tokens = [400, 20, 20, 20, 20, 20, 20, 20]  # expert 0 (rank 0) takes most tokens
    plan = plan_replicas(tokens, current, slots_per_rank=5)
    assert plan.replicas[0] == (0, 1)
    assert all(plan.replicas[e][0] == current.replicas[e][0] for e in range(8))
    assert plan.imbalance(tokens) < current.imbalance(tokens) * 0.8


def test_an_even_load_or_an_already_balanced_one_moves_nothing() -> None:
    current = spread(8, 2)
    assert plan_replicas([50] * 8, current, slots_per_rank=6) is current
    assert plan_replicas([0] * 8, current, slots_per_rank=6) is current
    balanced = ExpertPlacement(2, ((0, 1),) + current.replicas[1:])
    tokens = [400, 20, 20, 20, 20, 20, 20, 20]
    assert plan_replicas(tokens, balanced, slots_per_rank=5) is balanced


def test_no_slot_to_spare_keeps_one_copy_each() -> None:
    current = spread(8, 2)
    assert plan_replicas([400] + [20] * 7, current, slots_per_rank=4) is current


def test_random_loads_never_leave_an_expert_without_its_home_nor_a_rank_over_its_slots() -> None:
    rng = random.Random(0)
    for _ in range(300):
        num_ranks = rng.choice([2, 4])
        num_experts = num_ranks * rng.randint(1, 4)
        slots = num_experts // num_ranks + rng.randint(0, 3)
        tokens = [rng.choice([0, 1, 10, 1000]) * rng.random() for _ in range(num_experts)]
        current = spread(num_experts, num_ranks)
        plan = plan_replicas(tokens, current, slots)
        plan.check(slots)
        assert homes(plan) == homes(current)
        assert plan.imbalance(tokens) <= current.imbalance(tokens) + 1e-9


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_replicas([1, 2], spread(4, 2), slots_per_rank=3)
    with pytest.raises(ValueError):
        plan_replicas([1, -2, 3, 4], spread(4, 2), slots_per_rank=3)


def test_the_expert_load_window_reports_each_layers_imbalance_and_hottest_expert(tiny_model):
    """On a real MoE model (transformers' tiny Qwen3-MoE): the window's figures are those of
    the router's own choices over the window's steps, read once the window has passed."""
    from engine.expert_load import ExpertLoadWindow, imbalance
    from engine.expert_parallel import moe_blocks
    from engine.loader import load_model
    from tests.unit.engine.conftest import Stepper

    model = load_model(str(tiny_model("qwen3_moe").path)).model
    now = [0.0]
    window = ExpertLoadWindow(model, window_s=5.0, clock=lambda: now[0])
    stepper = Stepper(model, num_blocks=16, block_size=4)
    routed: list[list[int]] = [[0] * 4 for _ in moe_blocks(model)]
    for block, counts in zip(moe_blocks(model), routed):  # what each router picks, recorded
        original = block.route
        block.route = (lambda x, original=original, counts=counts:  # type: ignore[method-assign]
                       _counted(original(x), counts))
    stepper.greedy(list(range(5, 17)), 4, list(range(8)))
    window.refresh()
    assert window.imbalance == [] and window.hottest == []  # the window has not passed
    now[0] = 5.0
    window.refresh()
    assert window.imbalance == [imbalance(c) for c in routed]
    assert window.hottest == [max(range(4), key=c.__getitem__) for c in routed]
    assert all(1.0 <= r <= 4.0 for r in window.imbalance) and sum(routed[0]) == 2 * (12 + 3)


def _counted(routing, counts: list[int]):
    """`routing` (weights, expert ids) passed through, its picks added to `counts`."""
    for e in routing[1].reshape(-1).tolist():
        counts[e] += 1
    return routing
