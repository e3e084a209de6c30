"""Acting ahead of the capacity plan (agent/planned_move.py): a move toward the plan's
prefill/decode split, one at a time, never below min_per_role, never within the cooldown."""

from __future__ import annotations

from agent.capacity_plan import PoolSizes
from agent.planned_move import plan_ahead, wanted_prefill
from agent.rebalance import RebalanceConfig, RoleView
from protocol.messages import Role
from protocol.worker_load import WorkerLoad

CFG = RebalanceConfig()  # cooldown 60 s, at least 1 per role


def view(worker_id: str, role: Role, running: int = 0, ejected: bool = False) -> RoleView:
    return RoleView(worker_id, 1, role, WorkerLoad(num_running=running), ejected=ejected)


POOLS = [view("p-0", Role.PREFILL, 3), view("d-0", Role.DECODE, 9), view("d-1", Role.DECODE, 2),
         view("d-2", Role.DECODE, 5)]


def test_the_plans_split_over_the_workers_there_are() -> None:
    assert wanted_prefill(PoolSizes(2, 2, 4, ""), 4, 1) == 2
    assert wanted_prefill(PoolSizes(1, 1, 2, ""), 3, 1) == 1  # a half goes to decode
    assert wanted_prefill(PoolSizes(5, 1, 6, ""), 3, 1) == 2  # 2.5
    assert wanted_prefill(PoolSizes(6, 2, 8, ""), 4, 1) == 3
    assert wanted_prefill(PoolSizes(9, 0, 9, ""), 4, 1) == 3  # a decode worker stays
    assert wanted_prefill(PoolSizes(0, 0, 1, ""), 4, 1) is None
    assert wanted_prefill(PoolSizes(1, 1, 2, ""), 1, 1) is None


def test_a_forecast_that_needs_more_prefill_moves_the_least_loaded_decode_worker() -> None:
    move = plan_ahead(PoolSizes(2, 2, 4, "prefill 2.0 workers' worth ahead"), POOLS, None,
                      100.0, CFG)
    assert move is not None
    assert (move.worker_id, move.from_role, move.to_role) == ("d-1", Role.DECODE, Role.PREFILL)
    assert "2 should prefill, 1 do" in move.reason and "capacity plan" in move.reason


def test_a_forecast_that_needs_more_decode_moves_a_prefill_worker_only_if_one_is_left() -> None:
    pools = [view("p-0", Role.PREFILL, 4), view("p-1", Role.PREFILL, 1), view("d-0", Role.DECODE)]
    move = plan_ahead(PoolSizes(1, 5, 6, ""), pools, None, 100.0, CFG)
    assert move is not None and (move.worker_id, move.to_role) == ("p-1", Role.DECODE)
    assert plan_ahead(PoolSizes(1, 5, 6, ""), pools[1:], None, 100.0, CFG) is None


def test_pools_as_planned_a_cooldown_or_no_plan_move_nothing() -> None:
    assert plan_ahead(PoolSizes(1, 3, 4, ""), POOLS, None, 100.0, CFG) is None
    assert plan_ahead(PoolSizes(2, 2, 4, ""), POOLS, 50.0, 100.0, CFG) is None  # 50 s ago
    assert plan_ahead(None, POOLS, None, 100.0, CFG) is None


def test_ejected_workers_and_workers_that_do_both_are_left_alone() -> None:
    pools = [view("p-0", Role.PREFILL), view("d-0", Role.DECODE, ejected=True),
             view("d-1", Role.DECODE), view("b-0", Role.BOTH)]
    # Of the two routable prefill/decode workers one prefills, as a 1:1 plan wants.
    assert plan_ahead(PoolSizes(3, 3, 6, ""), pools, None, 100.0, CFG) is None
    move = plan_ahead(PoolSizes(1, 1, 2, ""), POOLS[:1] + [view("d-1", Role.DECODE),
                                                           view("d-3", Role.DECODE)], None,
                      100.0, CFG)
    assert move is None  # 3 workers, a 1:1 plan: 1.5 prefill workers, the half to decode
