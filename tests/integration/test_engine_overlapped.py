"""Overlapped steps (LLMEngine.step with `overlap=True`) on the real default model: step N+1
is planned and queued before step N's tokens reach the host, and nothing a client sees
changes.

Each batch runs on fresh engines, plain and overlapped, stepping until done: every
request's tokens, streamed text, logprobs and finish reason must be identical, greedy ones
equal to transformers' tokens. On the CPU the model runs inside `execute`, so this checks
the bookkeeping (placeholders, a stop found one step late, aborts and preemption between
steps), the same code a CUDA worker runs with the device computing meanwhile.
"""

from __future__ import annotations

import pytest
from default_engine import PROMPTS, make_engine
from engine_runs import GREEDY, StopCases, check_an_abort_after_step_five, run

from engine.llm_engine import LLMEngine
from engine.request import PLACEHOLDER, RequestMode
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


def test_overlapped_greedy_batch_matches_plain_and_transformers(loaded, hf_reference):
    engine = make_engine(loaded)
    requests = {f"r{i}": (engine.tokenizer.encode(p), GREEDY) for i, p in enumerate(PROMPTS)}
    plain, _ = run(make_engine(loaded), requests, "plain")
    over, _ = run(engine, requests, "overlapped")
    assert over == plain
    for rid, (prompt, _) in requests.items():
        expected = hf_reference.greedy(prompt, GREEDY.max_tokens, ignore_eos=True).token_ids
        assert over[rid].tokens == expected
        assert over[rid].finish_reasons[-1] == "length"
    assert not engine.has_unfinished() and engine.kv_cache.num_used_blocks == 0


def test_overlapped_stops_sampling_and_logprobs_match_plain(loaded):
    cases = StopCases.build(make_engine(loaded))
    plain, _ = run(make_engine(loaded), cases.requests, "plain")
    over, _ = run(make_engine(loaded), cases.requests, "overlapped")
    assert over == plain
    cases.check(plain)


def test_a_stop_is_found_one_step_late_and_its_extra_row_is_dropped(loaded):
    engine = make_engine(loaded)
    word = engine.tokenizer.encode(PROMPTS[0])
    greedy = engine.generate([word], GREEDY)[0]
    stop_at = greedy.token_ids[4]  # the fifth token stops it
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_at,))
    engine.add_request("s", word, params)
    steps_before = engine.num_steps
    steps_seen: list[int] = []
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step(overlap=True)
        steps_seen.append(len(engine.last_schedule.chunks) if engine.last_schedule else 0)
        engine.check_invariants()
    assert [t for o in outputs for t in o.new_token_ids] == greedy.token_ids[:5]
    assert outputs[-1].finish_reason == "stop"
    # Five steps sampled its five tokens; the sixth computed a row for it before the stop
    # was known and, once it was, sampled nothing from it: no seventh step.
    assert engine.num_steps - steps_before == 6 and steps_seen == [1] * 6
    assert engine.kv_cache.num_used_blocks == 0


def test_an_abort_while_in_flight_leaves_nothing_behind(loaded):
    def its_fifth_token_is_in_flight(engine: LLMEngine) -> None:
        request = engine.scheduler.get_request("gone")
        assert request is not None and request.output_token_ids[-1] == PLACEHOLDER

    # Step k's outputs are step k-1's tokens: "gone" saw 4, the fifth was in flight.
    check_an_abort_after_step_five(loaded, "overlapped", its_fifth_token_is_in_flight)


def test_preemption_and_switching_modes_keep_the_tokens(loaded):
    # 5 blocks of 16 tokens for 4 requests that grow to 2 blocks each: some are preempted
    # (and recomputed), among them ones with a token in flight.
    engine = make_engine(loaded, num_kv_blocks=5)
    requests = {f"r{i}": (engine.tokenizer.encode(p), GREEDY) for i, p in enumerate(PROMPTS[:4])}
    reference = {rid: engine.generate([prompt], GREEDY)[0].token_ids
                 for rid, (prompt, _) in requests.items()}
    preempted_in_flight: list[str] = []
    in_flight: set[str] = set()

    def watch(engine: LLMEngine, step: int) -> None:
        # Preempted by this step's schedule while the step before had its token in flight.
        assert engine.last_schedule is not None
        preempted_in_flight.extend(set(engine.last_schedule.preempted_request_ids) & in_flight)
        in_flight.clear()
        if engine._inflight is not None:
            in_flight.update(t.request.request_id for t in engine._inflight.tracked)

    over, _ = run(engine, requests, "overlapped", between_steps=watch)
    assert engine.num_preemptions > 0 and preempted_in_flight
    assert {rid: s.tokens for rid, s in over.items()} == reference

    switched = make_engine(loaded)
    modes = ["overlapped", "plain", "overlapped", "pipelined"]
    for rid, (prompt, params) in requests.items():
        switched.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    step = 0
    while switched.has_unfinished():
        mode = modes[(step // 3) % len(modes)]
        early: list = []
        outputs = switched.step(on_outputs=early.extend if mode == "pipelined" else None,
                                overlap=mode == "overlapped")
        for out in early + outputs:  # early ones were handed out mid-step
            tokens[out.request_id] += out.new_token_ids
        switched.check_invariants()
        step += 1
    assert tokens == reference


def test_a_prefill_only_request_parks_with_its_first_token(loaded):
    engine = make_engine(loaded)
    prompt = engine.tokenizer.encode(PROMPTS[2])
    first = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    engine.add_request("p", prompt, SamplingParams(max_tokens=8, temperature=0.0),
                       mode=RequestMode.PREFILL_ONLY)
    engine.add_request("d", prompt, GREEDY)
    parked = []
    while engine.has_unfinished():
        parked += [o for o in engine.step(overlap=True) if o.request_id == "p"]
        engine.check_invariants()
    assert len(parked) == 1 and parked[0].prefilled and parked[0].finish_reason is None
    assert parked[0].new_token_ids == first.token_ids
    assert engine.kv_cache.num_used_blocks > 0  # the parked prompt's blocks
    engine.release_prefilled("p")
    assert engine.kv_cache.num_used_blocks == 0
