"""The prefill lane (engine/prefill_lane.py) on the real default model, on the CPU: prompts
are admitted and computed by the lane's own scheduler over the engine's KV pool, parked after
their first token and handed over, blocks and all, to the engine's scheduler, which decodes
them. On the CPU a lane step runs when it is queued, so nothing overlaps; the scheduling, the
hand-over and the deferred abort are the same code a GPU runs beside its decode steps.

Every request must see exactly what it sees from an engine without a lane (greedy ones:
transformers' tokens), the prompts must really have gone through the lane in chunks, and
nothing may be left behind.
"""

from __future__ import annotations

import pytest
from default_engine import PROMPTS, make_engine
from engine_runs import GREEDY, StopCases, run

from engine.lane_streams import MIN_SMS, split_sms
from engine.request import RequestStatus
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

LANE = {"prefill_lane_sms": 1, "max_num_batched_tokens": 16, "max_num_seqs": 8}


def test_lane_greedy_batch_matches_transformers(loaded, hf_reference):
    engine = make_engine(loaded, **LANE)
    assert engine.lane is not None
    requests = {f"r{i}": (engine.tokenizer.encode(p), GREEDY) for i, p in enumerate(PROMPTS)}
    seen, _ = run(engine, requests, "plain")  # (against no lane: the stop cases' test)
    for rid, (prompt, _) in requests.items():
        expected = hf_reference.greedy(prompt, GREEDY.max_tokens, ignore_eos=True).token_ids
        assert seen[rid].tokens == expected
        assert seen[rid].finish_reasons[-1] == "length"
    # Every prompt went through the lane, in chunks of at most 16 tokens.
    prompt_tokens = sum(len(prompt) for prompt, _ in requests.values())
    assert engine.lane.num_steps >= prompt_tokens // 16
    assert engine.lane.scheduler.num_unfinished == 0 and engine.scheduler.num_unfinished == 0


def test_lane_stops_sampling_and_logprobs_match_no_lane(loaded):
    engine = make_engine(loaded, **LANE)
    cases = StopCases.build(make_engine(loaded))
    seen, _ = run(engine, cases.requests, "plain")
    without, _ = run(make_engine(loaded, max_num_batched_tokens=16, max_num_seqs=8),
                     cases.requests, "plain")
    assert_same_but_rounding(seen, without)
    cases.check(seen)


def assert_same_but_rounding(seen, without) -> None:
    """The same tokens, text and finishes; logprobs equal to rounding (a first token's
    logits come from a lane step of prompt chunks alone, not from a step with decode rows:
    other batches, other rounding)."""
    assert seen.keys() == without.keys()
    for rid, got in seen.items():
        want = without[rid]
        assert (got.tokens, got.texts, got.finish_reasons) == \
            (want.tokens, want.texts, want.finish_reasons), rid
        assert len(got.logprobs) == len(want.logprobs), rid
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a is None) == (b is None), rid
            if a is not None:
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-2)
                assert len(a.top_logprobs) == len(b.top_logprobs)
                assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-2)


def test_an_abort_in_the_flying_lane_step_is_deferred_and_leaves_nothing_behind(loaded):
    engine = make_engine(loaded, prefill_chunk_tokens=8, **LANE)  # 8 tokens each of a step
    prompt = engine.tokenizer.encode(PROMPTS[1] * 3)  # several chunks of 16
    # A request decoding, so that the engine has steps of its own to run beside the lane's
    # (else it waits for the lane's step at once).
    engine.add_request("busy", engine.tokenizer.encode(PROMPTS[0]), GREEDY)
    busy = []
    while engine.scheduler.get_request("busy") is None:
        busy += engine.step()
    engine.add_request("keep", prompt, GREEDY)
    engine.add_request("gone", prompt, GREEDY)
    busy += engine.step()
    lane = engine.lane
    assert lane is not None and lane.flying  # a chunk of "keep" and of "gone"
    assert lane.holds("gone") and engine.kv_cache.holds_blocks("gone")
    assert engine.abort_request("gone")
    assert lane.holds("gone")  # still there: its step has not landed
    engine.check_invariants()
    later = []
    while engine.has_unfinished():  # step to the end
        later += engine.step()
        engine.check_invariants()
    assert "gone" not in {o.request_id for o in later}
    assert not lane.holds("gone") and engine.scheduler.get_request("gone") is None
    alone, _ = run(make_engine(loaded, prefill_chunk_tokens=8, **LANE),
                   {"keep": (prompt, GREEDY)}, "plain")
    assert engine.kv_cache.num_used_blocks == 0
    assert not engine.has_unfinished()
    again, _ = run(engine, {"keep-2": (prompt, GREEDY)}, "plain")
    assert again["keep-2"] == alone["keep"]


def test_a_prompt_finds_the_prefix_a_lane_request_cached(loaded):
    engine = make_engine(loaded, **LANE)
    prompt = engine.tokenizer.encode(PROMPTS[4] * 4)
    first, _ = run(engine, {"first": (prompt, GREEDY)}, "plain")
    prefix = engine.kv_cache.find_cached_prefix(prompt)
    assert prefix.num_cached_tokens >= len(prompt) - engine.config.block_size
    second, _ = run(engine, {"second": (prompt, GREEDY)}, "plain")
    assert second["second"] == first["first"]


def test_a_prompt_too_long_for_the_pool_ends_with_an_error_from_the_lane(loaded):
    engine = make_engine(loaded, num_kv_blocks=4, block_size=16, **LANE)
    engine.add_request("huge", list(range(1, 200)), GREEDY)
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["huge"]
    assert outputs[0].finish_reason is not None
    assert not engine.has_unfinished()


def test_split_sms_keeps_both_sides_at_least_the_minimum():
    assert split_sms(132, 66) == (66, 66)
    assert split_sms(132, 1) == (MIN_SMS, 132 - MIN_SMS)
    assert split_sms(132, 500) == (132 - MIN_SMS, MIN_SMS)
    with pytest.raises(ValueError):
        split_sms(MIN_SMS, 4)


def test_parked_requests_hand_over_with_their_blocks(loaded):
    engine = make_engine(loaded, **LANE)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    engine.add_request("r", prompt, GREEDY)
    outputs = engine.step()  # one chunk: the prompt fits 16 tokens
    request = engine.scheduler.get_request("r")
    assert request is not None and request.status is RequestStatus.RUNNING
    assert [o.new_token_ids for o in outputs if o.request_id == "r"] != []
    assert request.block_ids == engine.kv_cache.block_table("r")
    assert not engine.lane.holds("r")
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_cache.num_used_blocks == 0


def test_the_lane_admits_no_prompt_the_decode_batch_has_no_seat_for(loaded):
    """A prompt prefilled with no seat to decode in would wait between its first and second
    token, where its TPOT target is: the lane admits only into the decode batch's free seats,
    so the waiting stays before the first token."""
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = make_engine(loaded, **{**LANE, "max_num_seqs": 2})
    requests = {f"r{i}": (engine.tokenizer.encode(p), short) for i, p in enumerate(PROMPTS[:6])}
    full_while_queued = 0

    def seats_held(engine, step: int) -> None:
        nonlocal full_while_queued
        main, lane = engine.scheduler, engine.lane.scheduler
        assert main.num_running + main.num_waiting + lane.num_running <= 2, step
        full_while_queued += main.num_running == 2 and lane.num_waiting > 0

    seen, _ = run(engine, requests, "plain", seats_held)
    assert full_while_queued > 0, "the decode batch was never full with prompts queued"
    without, _ = run(make_engine(loaded, max_num_batched_tokens=16, max_num_seqs=2), requests,
                     "plain")
    assert {rid: s.tokens for rid, s in seen.items()} == \
        {rid: s.tokens for rid, s in without.items()}
