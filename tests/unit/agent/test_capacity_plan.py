"""The forecast and the capacity plan on replayed demand traces (agent/demand_forecast.py,
agent/capacity_plan.py): each expectation is worked out in its test's docstring."""

from __future__ import annotations

import random

import pytest

from agent.capacity_plan import (CapacityPlanner, Demand, PlanConfig, max_decode_batch,
                                 median_model, pool_demand, size_pools)
from agent.demand_forecast import Smoothing, updated
from agent.rebalance import RoleView
from protocol.messages import Role
from protocol.worker_load import StepModel, WorkerLoad

# 100 us a prefill token (10,000 tokens/s flat out), 5 ms a step, 0.1 ms a sequence and
# 0.1 us a context token: at 1,000 tokens of context a decode step holds
# (0.8 * 50 ms - 5 ms) / 0.2 ms = 175 sequences within 80% of a 50 ms TPOT.
MODEL = StepModel(base_s=0.005, prefill_token_s=1e-4, decode_seq_s=1e-4, context_token_s=1e-7,
                  num_samples=100, num_prefill_samples=50, num_decode_samples=50)


def views(prefill_tokens_per_s: float, decoding: int = 0, blocks_used: int = 0,
          num_prefill: int = 1, num_decode: int = 1) -> list[RoleView]:
    """The demand spread evenly over the pools' workers."""
    out = [RoleView(f"p{i}", 1, Role.PREFILL, WorkerLoad(
        prefill_tokens_per_s=prefill_tokens_per_s / num_prefill, num_kv_blocks_total=1000,
        step_model=MODEL)) for i in range(num_prefill)]
    out += [RoleView(f"d{i}", 1, Role.DECODE, WorkerLoad(
        num_decoding=decoding // num_decode, num_running=decoding // num_decode,
        num_context_tokens=1000 * (decoding // num_decode),
        num_kv_blocks_used=blocks_used // num_decode, num_kv_blocks_total=1000,
        step_model=MODEL)) for i in range(num_decode)]
    return out


def test_a_ramp_is_forecast_ahead_and_a_constant_keeps_no_trend() -> None:
    """A signal rising 10/s sampled every second: after ten trend half-lives the trend is
    within a few percent of 10/s, so 60 s ahead is forecast about 600 above the level;
    a constant signal's forecast is the constant."""
    ramp = None
    for t in range(600):
        ramp = updated(ramp, 10.0 * t, float(t), Smoothing())
    assert ramp is not None and ramp.trend == pytest.approx(10.0, rel=0.05)
    assert ramp.forecast(60.0) == pytest.approx(10.0 * 599 + 600, rel=0.02)
    flat = None
    for t in range(100):
        flat = updated(flat, 50.0, float(t), Smoothing())
    assert flat is not None and flat.forecast(120.0) == pytest.approx(50.0)


def test_a_sample_out_of_order_changes_nothing_and_a_bad_one_is_refused() -> None:
    state = updated(None, 5.0, 10.0, Smoothing())
    assert updated(state, 500.0, 10.0, Smoothing()) == state
    with pytest.raises(ValueError):
        updated(state, float("nan"), 11.0, Smoothing())


def test_the_pools_are_sized_from_the_step_model() -> None:
    """Prefill 14,000 tokens/s * 100 us / 0.7 busy = 2.0 workers; decode 350 sequences /
    175 per step = 2.0 workers, KV 1,200 blocks / (0.8 * 1,000) = 1.5: 2; both kinds of work
    on shared workers: 4."""
    sizes = size_pools(Demand(14_000, 350, 1000, 1200), MODEL, 1000, PlanConfig())
    assert max_decode_batch(MODEL, 1000, 0.04) == pytest.approx(175)
    assert (sizes.prefill, sizes.decode, sizes.total) == (2, 2, 4)
    idle = size_pools(Demand(), MODEL, 1000, PlanConfig())
    assert (idle.prefill, idle.decode, idle.total) == (1, 1, 1)


def test_ejected_workers_are_neither_demand_nor_a_model() -> None:
    ws = views(5000, decoding=10, blocks_used=100)
    ws[0] = RoleView("p0", 1, Role.PREFILL, ws[0].load, ejected=True)
    demand = pool_demand(ws, queue_drain_s=10)
    assert demand.prefill_tokens_per_s == 0 and demand.num_decoding == 10
    assert median_model([None, None]) is None


def _replay(trace: list[float], config: PlanConfig) -> list[int]:
    """The desired prefill workers after each second of a prefill-demand trace."""
    planner = CapacityPlanner(config)
    out = []
    for t, demand in enumerate(trace):
        out.append(planner.observe(views(demand), float(t)).prefill)
    return out


def test_a_ramp_asks_for_a_worker_before_the_pool_runs_out() -> None:
    """Prefill demand rises from 2,000 to 20,000 tokens/s over 10 minutes (30 tokens/s per
    second). One worker is flat out at 10,000 tokens/s (second 267): past that its queue,
    and every TTFT, grows. Sized for 70% busy, now-only planning asks for a second worker
    at 7,000 tokens/s (second 167); planning two minutes ahead asks at least a minute earlier
    (its trend settles over the trend half-life), with the pool at about half its capacity."""
    trace = [2000 + 30.0 * t for t in range(600)]
    saturated_at = next(t for t, d in enumerate(trace) if d >= 10_000)
    ahead = _replay(trace, PlanConfig(horizon_s=120))
    now_only = _replay(trace, PlanConfig(horizon_s=1e-3))
    first_ahead, first_now = ahead.index(2), now_only.index(2)
    assert first_now < saturated_at
    assert first_ahead <= first_now - 60, (first_ahead, first_now)
    # Never down on a ramp; at its end 20,000 tokens/s is forecast at about 23,600 two
    # minutes ahead: 23,600 * 100 us / 0.7 = 3.4 workers, so 4 (now-only: 2.9, so 3).
    assert ahead == sorted(ahead) and max(ahead) == 4 and max(now_only) == 3


def test_a_steady_trace_changes_nothing_for_ten_minutes() -> None:
    """5,000 tokens/s +- 20% (seeded noise), 10 simulated minutes: 5,000 * 100 us / 0.7 =
    0.71 workers, 0.86 at the top of the noise; the plan stays at one worker throughout,
    and so does the decode pool at 50 sequences (50 / 175)."""
    rng = random.Random(7)
    planner = CapacityPlanner(PlanConfig())
    seen = set()
    for t in range(600):
        desired = planner.observe(views(5000 * rng.uniform(0.8, 1.2), decoding=50), float(t))
        seen.add((desired.prefill, desired.decode))
    assert seen == {(1, 1)}


def test_a_lull_removes_a_worker_only_after_the_scale_down_time() -> None:
    """20,000 tokens/s (3 workers) for 2 minutes, then 2,000 (1 worker): the plan holds 3
    for 300 s after the fall is first planned, then drops; a burst back within the window
    keeps it."""
    config = PlanConfig(horizon_s=1e-3)
    trace = [20_000.0] * 120 + [2_000.0] * 600
    desired = _replay(trace, config)
    assert desired[119] == 3
    assert all(d == 3 for d in desired[120:400])
    assert desired[-1] == 1
    bursty = [20_000.0] * 120 + ([2_000.0] * 200 + [20_000.0] * 20) * 3
    assert min(_replay(bursty, config)[120:]) == 3


def test_without_a_step_model_the_plan_is_the_pools_as_they_are() -> None:
    """A fresh cluster: 2 prefill and 3 decode workers, one of them ejected, no model yet."""
    planner = CapacityPlanner(PlanConfig())
    bare = [RoleView(f"p{i}", 1, Role.PREFILL, WorkerLoad(prefill_tokens_per_s=1e6))
            for i in range(2)]
    bare += [RoleView(f"d{i}", 1, Role.DECODE, WorkerLoad(), ejected=i == 0) for i in range(3)]
    desired = planner.observe(bare, 0.0)
    assert (desired.prefill, desired.decode, desired.total) == (2, 2, 4)


def test_config_refuses_nonsense() -> None:
    for bad in (dict(horizon_s=0), dict(prefill_busy=0), dict(kv_usage_high=1.5),
                dict(min_per_role=0), dict(tpot_s=float("inf"))):
        with pytest.raises(ValueError):
            PlanConfig(**bad)  # type: ignore[arg-type]
