"""The predictive router on recorded snapshots: each case is computed by hand in its
docstring (gateway/plan_model.py's formulas) and the router must pick the same plan."""

from __future__ import annotations

import random

import pytest

from common.contract.protocol import Role
from common.contract.worker_load import StepModel, WorkerLoad
from gateway.plan_model import Targets, WorkerSide, predict_local, predict_split
from gateway.router import ClusterSnapshot, RouteRequest, WorkerView, plan_route

# 5 ms a step, 20 us a prefill token, 0.1 ms a decoding sequence, 1 ns a context token.
MODEL = StepModel(base_s=0.005, prefill_token_s=20e-6, decode_seq_s=1e-4, context_token_s=1e-6,
                  num_samples=100, num_prefill_samples=50, num_decode_samples=80)
INTERACTIVE = Targets(ttft_s=0.5, tpot_s=0.05, strictest_tpot_s=0.05, max_tokens=64)
IDLE = WorkerLoad(num_kv_blocks_total=1000)
BUSY = WorkerLoad(num_kv_blocks_total=1000, num_running=32, num_decoding=32,
                  num_context_tokens=16_000)


def worker(wid: str, role: Role, load: WorkerLoad = IDLE,
           model: StepModel | None = MODEL) -> WorkerView:
    import msgspec

    return WorkerView(wid, role, msgspec.structs.replace(load, step_model=model),
                      max_batched_tokens=2048, kv_bytes_per_token=1000)


def route(workers: list[WorkerView], prompt_len: int, seed: int = 0,
          targets: Targets = INTERACTIVE, local: bool | None = None):
    request = RouteRequest(prompt_len=prompt_len, block_hashes=(), local_prefill=local,
                           targets=targets)
    return plan_route(request, ClusterSnapshot(tuple(workers), {}, 16), random.Random(seed))


def side(view: WorkerView) -> WorkerSide:
    assert view.load.step_model is not None
    return WorkerSide(view.load, view.load.step_model, 2048, 1000)


def test_a_short_prompt_leaves_a_busy_decode_worker_for_an_idle_prefill_worker() -> None:
    """100 tokens, D decodes 32 seqs over 16k tokens, P idle.
    local on D: TTFT 2 + 24.2 = 26.2 ms; D's running TPOT step(100, 32, 16000) = 26.2 ms
        -> 0.524 of 50 ms; this request's TPOT step(0, 33, 16100) = 24.4 ms -> 0.488
        score 0.524
    P -> D:     TTFT 2 + 5 = 7 ms; TPOT 24.4 ms + 0.1 ms transfer / 64 -> 0.488; score 0.488
    -> the split, by 0.036 (more than the 0.02 tie margin)."""
    d, p = worker("d", Role.DECODE, BUSY), worker("p", Role.PREFILL)
    local = predict_local(side(d), 100, 0, INTERACTIVE)
    split = predict_split(side(p), side(d), 100, 0, 0, INTERACTIVE)
    assert local.ttft_s == pytest.approx(0.0262) and local.running_tpot_s == pytest.approx(0.0262)
    assert local.score == pytest.approx(0.524)
    assert split.ttft_s == pytest.approx(0.007)
    assert split.score == pytest.approx(0.488, abs=1e-3)
    for seed in range(10):
        plan = route([d, p], 100, seed)
        assert (plan.decode_worker_id, plan.prefill_worker_id, plan.kind) == ("d", "p", "split")


def test_an_idle_decode_worker_prefills_a_short_prompt_itself() -> None:
    """Both idle: local TTFT 7 ms, TPOT step(0, 1, 100) = 5.2 ms; the split predicts the
    same plus a transfer: a tie on score and sum, so the local plan (one worker, no KV move)."""
    d, p = worker("d", Role.DECODE), worker("p", Role.PREFILL)
    for seed in range(10):
        assert route([d, p], 100, seed).kind == "local"


def test_a_long_prompt_would_stall_the_running_streams_so_it_goes_to_the_prefill_pool() -> None:
    """2000 tokens on the busy D: its running TPOT would be step(2000, 32, 16000) = 64.2 ms,
    1.28 of 50 ms; the split keeps them at 24.2 ms and this one at ~26.4 ms (0.53)."""
    d, p = worker("d", Role.DECODE, BUSY), worker("p", Role.PREFILL)
    assert predict_local(side(d), 2000, 0, INTERACTIVE).score == pytest.approx(1.284)
    assert route([d, p], 2000).kind == "split"


def test_a_backlogged_prefill_worker_loses_to_a_local_prefill() -> None:
    """P has 20,000 tokens queued: TTFT 20e-6 * 20100 + 10 steps * 5 ms = 452 ms (0.904);
    local on the busy D scores 0.524 -> local."""
    d = worker("d", Role.DECODE, BUSY)
    p = worker("p", Role.PREFILL, WorkerLoad(num_kv_blocks_total=1000,
                                             num_queued_prefill_tokens=20_000))
    assert predict_split(side(p), side(d), 100, 0, 0, INTERACTIVE).ttft_s == pytest.approx(0.452)
    assert route([d, p], 100).kind == "local"


def test_both_workers_split_between_themselves_when_one_is_busy() -> None:
    """Two BOTH workers, b0 busy decoding, b1 idle: a short prompt is best prefilled on b1;
    b1 decoding it locally (score 0.104) beats a split onto busy b0 and a local on b0."""
    b0, b1 = worker("b0", Role.BOTH, BUSY), worker("b1", Role.BOTH)
    plan = route([b0, b1], 100)
    assert (plan.decode_worker_id, plan.kind) == ("b1", "local")


def test_a_worker_without_a_measured_prefill_term_borrows_its_peers() -> None:
    decode_only = StepModel(base_s=0.005, prefill_token_s=0.0, decode_seq_s=1e-4,
                            context_token_s=1e-6, num_samples=50, num_prefill_samples=0,
                            num_decode_samples=50)
    d, p = worker("d", Role.DECODE, BUSY, decode_only), worker("p", Role.PREFILL)
    # Borrowed 20 us/token: the same choice as with the full model, not a free local prefill.
    assert route([d, p], 2000).kind == "split"


def test_without_models_or_with_a_tier_override_the_token_cost_rule_decides() -> None:
    d, p = worker("d", Role.DECODE, BUSY, None), worker("p", Role.PREFILL)
    plan = route([d, p], 100)
    assert plan.predicted is None
    forced = route([worker("d", Role.DECODE, BUSY), p], 100, local=True)
    assert forced.kind == "local" and forced.predicted is None
