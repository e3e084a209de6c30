"""The predictive router on recorded snapshots: each case is computed by hand in its
docstring (gateway/routing/plan_model.py's formulas) and the router must pick the same plan."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest

from gateway.routing.plan_model import Targets, WorkerSide, predict_local, predict_split
from gateway.routing.router import (ClusterSnapshot, RouteRequest, WorkerView, load_at_routing,
                                    plan_route)
from protocol.messages import Role
from protocol.worker_load import StepModel, WorkerLoad

# 5 ms a step, 20 us a prefill token, 0.1 ms a decoding sequence, 1 ns a context token.
MODEL = StepModel(base_s=0.005, prefill_token_s=20e-6, decode_seq_s=1e-4, context_token_s=1e-6,
                  num_samples=100, num_prefill_samples=50, num_decode_samples=80)
INTERACTIVE = Targets(ttft_s=0.5, tpot_s=0.05, strictest_tpot_s=0.05, max_tokens=64)
IDLE = WorkerLoad(num_kv_blocks_total=1000)
BUSY = WorkerLoad(num_kv_blocks_total=1000, num_running=32, num_decoding=32,
                  num_context_tokens=16_000)


def worker(wid: str, role: Role, load: WorkerLoad = IDLE,
           model: StepModel | None = MODEL) -> WorkerView:
    return WorkerView(wid, role, msgspec.structs.replace(load, step_model=model),
                      max_batched_tokens=2048, kv_bytes_per_token=1000)


def route(workers: list[WorkerView], prompt_len: int, seed: int = 0,
          targets: Targets = INTERACTIVE, local: bool | None = None):
    request = RouteRequest(prompt_len=prompt_len, block_hashes=(), local_prefill=local,
                           targets=targets)
    return plan_route(request, ClusterSnapshot(tuple(workers), {}, 16), random.Random(seed))


def side(view: WorkerView) -> WorkerSide:
    """What the router predicts the view's worker with (its queue as of routing)."""
    assert view.load.step_model is not None
    return WorkerSide(load_at_routing(view), view.load.step_model, 2048, 1000)


def test_a_short_prompt_leaves_a_busy_decode_worker_for_an_idle_prefill_worker() -> None:
    """100 tokens, D decodes 32 seqs over 16k tokens, P idle.
    local on D: TTFT 2 + 24.2 = 26.2 ms; D's running TPOT step(100, 32, 16000) = 26.2 ms
        -> 0.524 of 50 ms; this request's TPOT step(0, 33, 16100) = 24.4 ms -> 0.488
        score 0.524; cost 26.2 ms + 64 * 24.4 ms + D's 32 decodes stalled 32 * 20 us * 100
        = 64 ms + one more sequence 32 * (0.1 + 0.1) ms * 64 = 409.6 ms -> 2061.4 ms
    P -> D:     TTFT max(2 + 5 on P, D's current step 24.2) = 24.2 ms (the reservation waits
        for D's step); TPOT 24.4 ms + 0.1 ms transfer / 64 -> 0.488; score 0.488;
        cost 24.2 + 1561.7 + 0 (P decodes nothing) + 409.6 = 1995.5 ms
    -> both meet every target; the split is cheaper by 3% (more than the 2% tie margin)."""
    d, p = worker("d", Role.DECODE, BUSY), worker("p", Role.PREFILL)
    local = predict_local(side(d), 100, 0, INTERACTIVE)
    split = predict_split(side(p), side(d), 100, 0, 0, INTERACTIVE)
    assert local.ttft_s == pytest.approx(0.0262) and local.running_tpot_s == pytest.approx(0.0262)
    assert local.score == pytest.approx(0.524)
    assert split.ttft_s == pytest.approx(0.0242)
    assert split.score == pytest.approx(0.488, abs=1e-3)
    assert local.cost_s == pytest.approx(2.0614) and split.cost_s == pytest.approx(1.9955,
                                                                                   abs=1e-4)
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
    """P has 200 prompts of 100 tokens queued, none shorter than this one: all 20,000
    tokens go first. TTFT 20e-6 * 20100 + ceil(20100 / 2048) = 10 steps * 5 ms = 452 ms,
    after the chunk in progress (20e-6 * 2048 = 40.96 ms): 492.96 ms (0.986); local on the
    busy D scores 0.524 -> local."""
    d = worker("d", Role.DECODE, BUSY)
    p = worker("p", Role.PREFILL, WorkerLoad(num_kv_blocks_total=1000, num_waiting=200,
                                             num_queued_prefill_tokens=20_000))
    assert predict_split(side(p), side(d), 100, 0, 0, INTERACTIVE).ttft_s == pytest.approx(0.49296)
    assert route([d, p], 100).kind == "local"


def test_a_short_prompt_is_one_step_behind_a_long_one() -> None:
    """P prefills one 20,000-token prompt: the engine computes a shorter one first, in the
    next step, which the long one fills: TTFT 20e-6 * 2048 + 5 ms = 45.96 ms after the
    chunk in progress (40.96 ms): 86.92 ms, not the 452 ms of the whole queue, so the split
    meets every target (0.488); its cost (86.92 + 1561.7 + 409.6 = 2058.2 ms) ties the
    busy D's local prefill (2061.4 ms) within 2%, which then wins the tie."""
    d = worker("d", Role.DECODE, BUSY)
    p = worker("p", Role.PREFILL, WorkerLoad(num_kv_blocks_total=1000, num_running=1,
                                             num_queued_prefill_tokens=20_000))
    split = predict_split(side(p), side(d), 100, 0, 0, INTERACTIVE)
    assert split.ttft_s == pytest.approx(0.08692) and split.score < 1
    assert split.cost_s == pytest.approx(2.0582, abs=1e-4)
    assert route([d, p], 100).kind == "local"


def test_a_long_prompt_routed_a_moment_ago_counts_before_the_worker_reports_it() -> None:
    """D prefills at 60 us a token, P at 20 us. A 500-token prompt, both idle:
    local on D: TTFT 30 + 5 = 35 ms; TPOT step(0, 1, 500) = 5.6 ms; cost 393.4 ms
    P -> D:     TTFT 10 + 5 = 15 ms; TPOT 5.6 ms + 0.5 ms transfer / 64; cost 373.9 ms
    -> the split, 5% cheaper. The gateway has just routed a 20,000-token prompt to P, which
    P's last load report (idle) does not show: counted, this one waits for the chunk in
    progress and one full step there (2 * 20e-6 * 2048 + 5 = 86.9 ms; cost 445.9 ms) ->
    local on D."""
    slow_prefill = msgspec.structs.replace(MODEL, prefill_token_s=60e-6)
    d, p = worker("d", Role.DECODE, model=slow_prefill), worker("p", Role.PREFILL)
    for seed in range(10):
        assert route([d, p], 500, seed).kind == "split"
    busy_p = dataclasses.replace(p, num_routed_prefills=1, num_routed_prefill_tokens=20_000)
    split = predict_split(side(busy_p), side(d), 500, 0, 0, INTERACTIVE)
    assert split.ttft_s == pytest.approx(0.08692)
    assert predict_local(side(d), 500, 0, INTERACTIVE).cost_s == pytest.approx(0.3934, abs=1e-4)
    assert split.cost_s == pytest.approx(0.4459, abs=1e-4)
    for seed in range(10):
        assert route([d, busy_p], 500, seed).kind == "local"


def test_both_workers_split_between_themselves_when_one_is_busy() -> None:
    """Two BOTH workers, b0 busy decoding, b1 idle: a short prompt is best prefilled on b1;
    b1 decoding it locally (score 0.104) beats a split onto busy b0 and a local on b0."""
    b0, b1 = worker("b0", Role.BOTH, BUSY), worker("b1", Role.BOTH)
    plan = route([b0, b1], 100)
    assert (plan.decode_worker_id, plan.kind) == ("b1", "local")


def test_a_decode_goes_to_the_worker_that_prefills_little() -> None:
    """Two BOTH workers, each decoding 8 seqs over 4000 tokens; b0 prefills 30,000 tokens/s
    for others (busy 20 us * 30,000 = 60% of its time), b1 nothing. A 100-token prompt:
    local on b1: TTFT 2 + step(0, 8, 4000) 9.8 = 11.8 ms; TPOT step(0, 9, 4100) = 10.0 ms;
        cost 11.8 + 640 + stall 8 * 20 us * 100 = 16 + one more sequence 8 * 0.2 ms * 64
        = 102.4 -> 770.2 ms
    local on b0: the same TTFT, TPOT 10.0 / (1 - 0.6) = 25 ms -> cost 1730.2 ms
    b0 -> b1 costs what local on b1 does plus a transfer (a tie, so local) -> local on b1."""
    busy_prefiller = WorkerLoad(num_kv_blocks_total=1000, num_running=8, num_decoding=8,
                                num_context_tokens=4000, prefill_tokens_per_s=30_000)
    b0 = worker("b0", Role.BOTH, busy_prefiller)
    b1 = worker("b1", Role.BOTH, msgspec.structs.replace(busy_prefiller, prefill_tokens_per_s=0))
    on_b1, on_b0 = (predict_local(side(b), 100, 0, INTERACTIVE) for b in (b1, b0))
    assert on_b1.cost_s == pytest.approx(0.7702) and on_b0.cost_s == pytest.approx(1.7302)
    assert on_b0.tpot_s == pytest.approx(0.025)
    for seed in range(10):
        plan = route([b0, b1], 100, seed)
        assert (plan.decode_worker_id, plan.kind) == ("b1", "local")


def test_a_prefill_goes_to_the_worker_that_decodes_little() -> None:
    """b0 decodes 2 seqs over 1000 tokens and prefills 45,000 tokens/s (90% busy: a decode
    there would take 7.3 / 0.1 = 73 ms a token, past the 50 ms target); b1 decodes 32 over
    16,000 (BUSY). A 1000-token prompt, of the plans that decode on b1:
    local on b1: stall 32 * 20 us * 1000 = 640 ms of b1's running decodes
    b0 -> b1: stall 2 * 20 us * 1000 = 40 ms, TTFT 20 + step(0, 2, 1000) 6.2 = 26.2 ms
    the same TPOT on b1 (plus 1 ms transfer / 64) -> the split, ~600 ms cheaper."""
    b0 = worker("b0", Role.BOTH, WorkerLoad(num_kv_blocks_total=1000, num_running=2,
                                            num_decoding=2, num_context_tokens=1000,
                                            prefill_tokens_per_s=45_000))
    b1 = worker("b1", Role.BOTH, BUSY)
    local = predict_local(side(b1), 1000, 0, INTERACTIVE)
    split = predict_split(side(b0), side(b1), 1000, 0, 0, INTERACTIVE)
    assert split.ttft_s == pytest.approx(0.0262)
    assert local.cost_s - split.cost_s == pytest.approx(0.64 - 0.04 + local.ttft_s - 0.0262
                                                        - 0.001, abs=1e-6)
    plan = route([b0, b1], 1000)
    assert (plan.prefill_worker_id, plan.decode_worker_id) == ("b0", "b1")


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


# Recorded on one H200 at the end of an adaptive run (Llama-3-8B shape, two `both` workers
# under MPS, 50% of the SMs each; /admin/workers), idle but for their recent prefill rates.
RECORDED_B0 = StepModel(base_s=0.008873072296577366, prefill_token_s=4.4105103607996015e-05,
                        decode_seq_s=2.187054517796061e-05,
                        context_token_s=3.883035321262662e-07, num_samples=512,
                        num_prefill_samples=256, num_decode_samples=484)
RECORDED_B1 = StepModel(base_s=0.011078520738380594, prefill_token_s=0.0002212274836297896,
                        decode_seq_s=2.720905090420568e-05, context_token_s=0.0,
                        num_samples=359, num_prefill_samples=103, num_decode_samples=354)


def test_a_recorded_h200_snapshot_prefills_where_prefill_is_fast() -> None:
    """A 1000-token prompt; 8B KV is 131,072 bytes a token; b0 pushes at 4.36 GB/s.
    local on b0: TTFT 44.1 + 8.9 = 53.0 ms; busy 44.1 us * 6117 = 27%, TPOT
        step(0, 1, 1000) 9.28 / 0.730 = 12.71 ms; cost 53.0 + 64 * 12.71 = 866.6 ms
    local on b1: TTFT 221.2 + 11.1 = 232.3 ms; busy 9.5%, TPOT 12.28 ms; cost 1018.0 ms
    b0 -> b1: TTFT 53.0 ms, transfer 131 MB / 4.36 GB/s = 30.0 ms -> TPOT 12.28 + 0.47
        = 12.75 ms; cost 868.7 ms: within 2% of local on b0, a tie -> local on b0."""
    def recorded(wid: str, model: StepModel, rate: float, push: float) -> WorkerView:
        load = WorkerLoad(num_kv_blocks_total=4096, prefill_tokens_per_s=rate,
                          kv_send_bytes_per_s=push, step_model=model)
        return WorkerView(wid, Role.BOTH, load, max_batched_tokens=2048,
                          kv_bytes_per_token=131_072)

    b0 = recorded("b0", RECORDED_B0, 6117.2, 4363466283.5)
    b1 = recorded("b1", RECORDED_B1, 430.6, 1187310585.7)
    sides = {"b0": WorkerSide(b0.load, RECORDED_B0, 2048, 131_072),
             "b1": WorkerSide(b1.load, RECORDED_B1, 2048, 131_072)}
    on_b0 = predict_local(sides["b0"], 1000, 0, INTERACTIVE)
    on_b1 = predict_local(sides["b1"], 1000, 0, INTERACTIVE)
    split = predict_split(sides["b0"], sides["b1"], 1000, 0, 0, INTERACTIVE)
    assert on_b0.ttft_s == pytest.approx(0.05298, abs=1e-5)
    assert on_b0.cost_s == pytest.approx(0.8666, abs=5e-4)
    assert on_b1.cost_s == pytest.approx(1.0180, abs=5e-4)
    assert split.cost_s == pytest.approx(0.8687, abs=5e-4)
    for seed in range(10):
        plan = route([b0, b1], 1000, seed)
        assert (plan.decode_worker_id, plan.kind) == ("b0", "local")


def test_a_split_onto_a_decode_worker_in_a_long_chunk_waits_for_that_chunk() -> None:
    """Two BOTH workers on a slow host (a 50 ms base step, 4 ms a prompt token): A is in the
    middle of a 5,000-token prompt (512-token chunks), B idle. A 5-token prompt:
    local on B: TTFT 4 ms * 5 + 50 ms = 70 ms;
    B -> A: B's prefill alone would be 70 ms too, but A takes the reservation only after
        its current chunk: step_A(512, 0, 0) = 50 + 2048 ms = 2098 ms, past a 500 ms target;
    A -> B: A's queue puts one full chunk before this prompt: over 2 s too.
    -> the local plan on the idle worker, every time."""
    slow = msgspec.structs.replace(MODEL, base_s=0.05, prefill_token_s=4e-3)
    long = WorkerLoad(num_kv_blocks_total=1000, num_running=1, num_waiting=0,
                      num_queued_prefill_tokens=4500)
    a = WorkerView("a", Role.BOTH, msgspec.structs.replace(long, step_model=slow),
                   max_batched_tokens=512, kv_bytes_per_token=1000)
    b = WorkerView("b", Role.BOTH, msgspec.structs.replace(IDLE, step_model=slow),
                   max_batched_tokens=512, kv_bytes_per_token=1000)
    split = predict_split(side(b), WorkerSide(load_at_routing(a), slow, 512, 1000), 5, 0, 0,
                          INTERACTIVE)
    assert split.ttft_s == pytest.approx(2.098)
    for seed in range(10):
        plan = route([a, b], 5, seed)
        assert (plan.kind, plan.decode_worker_id) == ("local", "b"), plan


def test_a_worker_whose_decode_steps_miss_anyway_still_prefills_a_short_prompt_itself() -> None:
    """A CPU: a decode step takes 54 ms, over the strictest 50 ms TPOT, whatever is planned.
    Two BOTH workers (standard tier, TTFT 2 s, TPOT 100 ms): A decodes one sequence, B
    prefills a 5,000-token prompt (Q 4,000 left, 512-token steps).
    local on A: TTFT step(5, 1, 10) = 101 ms; TPOT step(0, 2, 15) = 108 ms -> 1.08 of 100 ms;
        A's running TPOT 101 ms is not charged (its step alone, 54 ms, misses 50 ms already)
        -> score 1.08
    B -> A:     TTFT on B 5 * 4.5 ms + 512 * 4.5 ms (the chunk in progress) = 2.33 s -> 1.16;
        TPOT the same 108 ms -> score 1.16
    -> the local plan misses least. Charging A's running TPOT (101 / 50 -> 2.02) sent the
    prompt behind B's long prefill: seconds instead of 0.1 s (the head-of-line test)."""
    cpu = StepModel(base_s=0.0, prefill_token_s=0.0095, decode_seq_s=0.054, context_token_s=0.0,
                    num_samples=100, num_prefill_samples=50, num_decode_samples=80)
    fast_prefill = msgspec.structs.replace(cpu, prefill_token_s=0.0045)
    standard = Targets(ttft_s=2.0, tpot_s=0.1, strictest_tpot_s=0.05, max_tokens=6)
    a = WorkerView("a", Role.BOTH, WorkerLoad(num_kv_blocks_total=1000, num_running=1,
                                              num_decoding=1, num_context_tokens=10,
                                              step_model=cpu), max_batched_tokens=512)
    b = WorkerView("b", Role.BOTH, WorkerLoad(num_kv_blocks_total=1000, num_running=1,
                                              num_queued_prefill_tokens=4000,
                                              step_model=fast_prefill), max_batched_tokens=512)
    local = predict_local(WorkerSide(a.load, cpu, 512, 1000), 5, 0, standard)
    assert local.running_tpot_s == pytest.approx(0.1015) and local.score == pytest.approx(1.08)
    split = predict_split(WorkerSide(b.load, fast_prefill, 512, 1000),
                          WorkerSide(a.load, cpu, 512, 1000), 5, 0, 0, standard)
    assert split.score > local.score
    for seed in range(10):
        plan = route([a, b], 5, seed, targets=standard)
        assert (plan.decode_worker_id, plan.kind) == ("a", "local")


def test_a_worker_just_under_the_strictest_tpot_still_prefills_a_short_prompt_itself() -> None:
    """As above, with step models recorded on the 2-core CPU: A's decode step alone takes
    49 ms (27 ms + 22 ms a sequence), just under the strictest 50 ms, so noise decides
    whether it holds it. B computes a long prompt (3,500 tokens left, 512-token steps).
    local on A: TTFT 27 + 22 + 5 * 6.2 = 80 ms; its TPOT step(0, 2, 15) = 71 ms -> 0.71 of
        100 ms; A's running TPOT, that mixed step, 80 ms -> 1.6 of 50 ms if charged
    B -> A:     TTFT 2.40 s (B's chunk in progress, then the prompt) -> 1.20
    Charged, the local plan missed more (1.6 against 1.2) and the prompt waited seconds behind
    B's chunk. A step alone over RUNNING_HEADROOM (80%) of the strictest TPOT holds it by
    chance only: not charged, the local plan scores 0.71 and wins."""
    cpu = StepModel(base_s=0.027, prefill_token_s=0.0062, decode_seq_s=0.022,
                    context_token_s=0.0, num_samples=50, num_prefill_samples=8,
                    num_decode_samples=40)
    busy = StepModel(base_s=0.041, prefill_token_s=0.0023, decode_seq_s=0.0065,
                     context_token_s=0.0, num_samples=21, num_prefill_samples=6,
                     num_decode_samples=15)
    standard = Targets(ttft_s=2.0, tpot_s=0.1, strictest_tpot_s=0.05, max_tokens=6)
    a = WorkerView("a", Role.BOTH, WorkerLoad(num_kv_blocks_total=5000, num_running=1,
                                              num_decoding=1, num_context_tokens=10,
                                              step_model=cpu), max_batched_tokens=512)
    b = WorkerView("b", Role.BOTH, WorkerLoad(num_kv_blocks_total=5000, num_running=1,
                                              num_queued_prefill_tokens=3500,
                                              step_model=busy), max_batched_tokens=512)
    local = predict_local(WorkerSide(a.load, cpu, 512, 1000), 5, 0, standard)
    split = predict_split(WorkerSide(b.load, busy, 512, 1000),
                          WorkerSide(a.load, cpu, 512, 1000), 5, 0, 0, standard)
    assert local.running_tpot_s == pytest.approx(0.080) and local.score == pytest.approx(0.71)
    assert split.ttft_s == pytest.approx(2.396, abs=1e-3) and split.score == pytest.approx(1.198, abs=1e-3)
    for seed in range(10):
        plan = route([a, b], 5, seed, targets=standard)
        assert (plan.decode_worker_id, plan.kind) == ("a", "local")


def test_decoding_behind_a_long_prefill_queue_costs_its_chunks() -> None:
    """A's queue holds a 4,000-token prompt (512-token steps): a 6-token answer decoded there
    shares all 6 steps with 511-token chunks of it, step(511, 1, 5) = 5 + 10.22 + 0.1 ms
    = 15.3 ms each (not 5.1 ms); on the idle B a step is 5.1 ms."""
    a = WorkerView("a", Role.BOTH, WorkerLoad(num_kv_blocks_total=1000, num_running=1,
                                              num_queued_prefill_tokens=4000,
                                              step_model=MODEL), max_batched_tokens=512)
    b = WorkerView("b", Role.BOTH, WorkerLoad(num_kv_blocks_total=1000, step_model=MODEL),
                   max_batched_tokens=512)
    targets = Targets(ttft_s=2.0, tpot_s=0.1, strictest_tpot_s=0.05, max_tokens=6)
    onto_a = predict_split(WorkerSide(b.load, MODEL, 512, 1000),
                           WorkerSide(a.load, MODEL, 512, 1000), 5, 0, 0, targets)
    onto_b = predict_split(WorkerSide(a.load, MODEL, 512, 1000),
                           WorkerSide(b.load, MODEL, 512, 1000), 5, 0, 0, targets)
    assert onto_a.tpot_s == pytest.approx(0.005 + 511 * 20e-6 + 1e-4 + 5e-6, rel=1e-3)
    assert onto_a.tpot_s > 2.9 * onto_b.tpot_s
    for seed in range(10):
        plan = route([a, b], 5, seed, targets=targets)
        assert plan.decode_worker_id == "b", plan


def test_a_host_hit_adds_its_copy_to_the_ttft_and_wins_over_a_miss() -> None:
    """2000 of 2100 tokens in an idle worker's host tier, 1000 bytes a token at 2 GB/s: the
    copy adds 1 ms to the TTFT, against 40 ms to compute them (20 us a token)."""
    fast = msgspec.structs.replace(IDLE, host_reload_bytes_per_s=2e9)
    h, cold = worker("h", Role.DECODE, fast), worker("cold", Role.DECODE)
    miss = predict_local(side(h), 2100, 0, INTERACTIVE)
    device = predict_local(side(h), 2100, 2000, INTERACTIVE)
    host = predict_local(side(h), 2100, 2000, INTERACTIVE, reloaded=2000)
    assert host.ttft_s == pytest.approx(device.ttft_s + 0.001)
    assert device.ttft_s < host.ttft_s < miss.ttft_s
    hashes = list(range(125))  # 2000 tokens of 16-token blocks
    request = RouteRequest(prompt_len=2100, block_hashes=hashes, local_prefill=None,
                           targets=INTERACTIVE)
    snapshot = ClusterSnapshot((cold, h), {}, 16, {x: frozenset({"h"}) for x in hashes})
    plan = plan_route(request, snapshot, random.Random(0))
    assert plan.decode_worker_id == "h" and plan.cached_tokens == 2000
    assert plan.predicted is not None and plan.predicted.ttft_s == pytest.approx(host.ttft_s)
