"""Pipelined steps (LLMEngine.step with `on_outputs`) on the real default model: the text of
a step's tokens is made during the next step, and nothing a client sees changes.

Each batch runs twice on fresh engines, plain and pipelined, stepping until done; every
request's tokens, streamed text, logprobs and finish reason must be identical, greedy ones
equal to transformers' tokens, and the pipelined run must really have deferred outputs.
"""

from __future__ import annotations

import pytest
from default_engine import PROMPTS, make_engine
from engine_runs import GREEDY, StopCases, check_an_abort_after_step_five, run

from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.timeout(600)


def both(loaded, requests):
    plain, _ = run(make_engine(loaded), requests, "plain")
    piped, num_early = run(make_engine(loaded), requests, "pipelined")
    return plain, piped, num_early


def test_pipelined_greedy_batch_matches_plain_and_transformers(loaded, hf_reference):
    engine = make_engine(loaded)
    requests = {f"r{i}": (engine.tokenizer.encode(p), GREEDY) for i, p in enumerate(PROMPTS)}
    plain, piped, num_early = both(loaded, requests)
    assert piped == plain
    assert num_early >= len(PROMPTS) * (GREEDY.max_tokens - 2)  # all but the last ones
    for rid, (prompt, _) in requests.items():
        expected = hf_reference.greedy(prompt, GREEDY.max_tokens, ignore_eos=True).token_ids
        assert piped[rid].tokens == expected
        assert "".join(piped[rid].texts) == hf_reference.tokenizer.decode(
            expected, skip_special_tokens=True)
        assert piped[rid].finish_reasons[-1] == "length"
        assert piped[rid].finish_reasons.count(None) == len(piped[rid].finish_reasons) - 1


def test_pipelined_stops_sampling_and_logprobs_match_plain(loaded):
    cases = StopCases.build(make_engine(loaded))
    plain, piped, num_early = both(loaded, cases.requests)
    assert piped == plain
    assert num_early > 0
    cases.check(plain)


def test_an_abort_with_a_deferred_token_leaves_nothing_behind(loaded):
    def both_tokens_of_step_five_wait_for_step_six(engine: LLMEngine) -> None:
        assert engine.outputs.num_deferred == 2

    # "gone" got the outputs of steps 1-4: the fifth was deferred, then dropped.
    check_an_abort_after_step_five(loaded, "pipelined",
                                   both_tokens_of_step_five_wait_for_step_six)
