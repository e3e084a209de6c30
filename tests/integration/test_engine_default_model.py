"""The whole engine loop on the real default model (SmolLM2-135M-Instruct, GGUF).

Every greedy run is compared with transformers' greedy output for the same weights, prompt
and chat template (tests/hf_reference.py): run alone, batched, with chunked prefill, under
preemption; token ids, text and finish reason exactly.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from default_engine import PROMPTS, make_engine

from engine.engine_builder import build_engine
from engine.llm_engine import LLMEngine
from protocol.sampling_params import SamplingParams
from protocol.worker_load import StepModel

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(hf_reference) -> dict[str, list[int]]:
    """transformers' greedy tokens for each prompt (GREEDY: 24 tokens, EOS ignored)."""
    return {p: hf_reference.greedy(hf_reference.prompt_ids(p), GREEDY.max_tokens,
                                   ignore_eos=True).token_ids for p in PROMPTS}


def encode_all(engine: LLMEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in PROMPTS]


def test_each_prompt_alone_matches_transformers(loaded, hf_reference, expected):
    engine = make_engine(loaded)
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        assert ids == hf_reference.prompt_ids(prompt)
        tokens, texts = _run(engine, f"r{i}", ids, GREEDY)
        assert tokens == expected[prompt]
        # The text streamed step by step is transformers' decoding of the same tokens.
        assert "".join(texts) == hf_reference.tokenizer.decode(tokens, skip_special_tokens=True)
    assert engine.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("question", ["What is the capital of France?", "Name a colour."])
def test_chat_answer_matches_transformers_and_stops_at_end_of_turn(loaded, hf_reference,
                                                                 question):
    engine = make_engine(loaded)
    messages = [{"role": "user", "content": question}]
    ids = engine.tokenizer.encode_chat(messages)
    assert ids == hf_reference.chat_ids(messages)
    reference = hf_reference.greedy(ids, 64)
    assert reference.finish_reason == "stop"  # both answers end well inside 64 tokens
    result = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0.0))[0]
    # The end-of-turn token is generated and counted, and left out of the text.
    assert result.token_ids == reference.token_ids
    assert result.text == reference.text and "<|im_end|>" not in result.text
    assert result.finish_reason == "stop"
    engine.check_invariants()
    assert engine.kv_cache.num_used_blocks == 0


def test_batched_requests_match_transformers(loaded, expected):
    engine = make_engine(loaded)
    results = engine.generate(encode_all(engine), GREEDY)
    assert {p: r.token_ids for p, r in zip(PROMPTS, results)} == expected
    engine.check_invariants()


def test_chunked_prefill_matches_transformers(loaded, expected):
    # A 5-token per-request chunk and an 8-token step budget split every prompt over steps.
    engine = make_engine(loaded, max_num_seqs=8, max_num_batched_tokens=8, prefill_chunk_tokens=5)
    results = engine.generate(encode_all(engine), GREEDY)
    assert {p: r.token_ids for p, r in zip(PROMPTS, results)} == expected


def test_prefix_cache_hit_matches_and_skips_compute(loaded, hf_reference):
    engine = make_engine(loaded)
    shared = ("You are a careful assistant. Answer briefly and precisely, and never invent "
              "facts you do not know. Question: ")
    first = engine.tokenizer.encode(shared + "What is two plus two?")
    second = engine.tokenizer.encode(shared + "What is the colour of the sky?")
    fresh = hf_reference.greedy(second, GREEDY.max_tokens, ignore_eos=True).token_ids
    engine.generate([first], GREEDY)
    engine.add_request("second", second, GREEDY)
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    assert tokens == fresh
    assert cached is not None and cached >= 16  # at least one whole block came from the cache


def test_preemption_under_memory_pressure_matches_transformers(loaded, expected):
    # 8 blocks of 16 tokens cannot hold five requests growing to ~30 tokens each at once.
    engine = make_engine(loaded, num_kv_blocks=8)
    results = engine.generate(encode_all(engine), GREEDY)
    assert {p: r.token_ids for p, r in zip(PROMPTS, results)} == expected
    assert engine.num_preemptions > 0
    engine.check_invariants()
    assert engine.kv_cache.num_used_blocks == 0


def test_seeded_sampling_same_alone_and_batched(loaded):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    solo = make_engine(loaded)
    ids = solo.tokenizer.encode(PROMPTS[1])
    expected = solo.generate([ids], params)[0].token_ids
    batch = make_engine(loaded)
    others = SamplingParams(max_tokens=16, temperature=1.0)
    results = batch.generate([batch.tokenizer.encode(PROMPTS[0]), ids,
                              batch.tokenizer.encode(PROMPTS[2])], [others, params, others])
    assert results[1].token_ids == expected


def test_stop_string_is_not_emitted(loaded, expected):
    engine = make_engine(loaded)
    ids = engine.tokenizer.encode(PROMPTS[0])
    full = engine.tokenizer.decode(expected[PROMPTS[0]])
    stop = full.strip().split()[1]  # a word the greedy output is known to contain
    result = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0,
                                                   stop=(stop,)))[0]
    assert result.finish_reason == "stop"
    assert stop not in result.text
    assert full.startswith(result.text)


def test_abort_frees_blocks(loaded):
    engine = make_engine(loaded)
    ids = engine.tokenizer.encode(PROMPTS[1])
    engine.add_request("a", ids, GREEDY)
    engine.step()
    assert engine.kv_cache.num_used_blocks > 0
    assert engine.abort_request("a")
    engine.check_invariants()
    assert engine.kv_cache.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_steps_held_to_tpot_give_a_prompt_what_the_decodes_target_leaves(loaded, expected):
    """`hold_tpot` (engine/step_budget.py) on the real engine: while a request with a 100 ms
    TPOT target decodes, a 300-token prompt computes in chunks of what that target leaves by
    the step model the worker would hand over (10 ms a step + 10 ms a decoding row + 1 ms a
    prompt token: 0.9 x 100 - 20 = 70 tokens), not in the fixed 256; the decoding answer is
    still transformers' greedy one."""
    engine = make_engine(loaded, hold_tpot=True, max_num_batched_tokens=256)
    engine.scheduler.step_model = StepModel(
        base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.01, context_token_s=0.0,
        num_samples=32, num_prefill_samples=16, num_decode_samples=16)
    engine.add_request("d", engine.tokenizer.encode(PROMPTS[0]), GREEDY, tpot_s=0.1)
    tokens = []
    while not tokens:
        tokens += [t for out in engine.step() if out.request_id == "d" for t in out.new_token_ids]
    long_ids = engine.tokenizer.encode(" ".join(["apple pear plum"] * 200))[:300]
    engine.add_request("long", long_ids, SamplingParams(max_tokens=1, temperature=0.0))
    chunks, computed, long_done = [], 0, False
    while engine.has_unfinished():
        outputs = engine.step()
        tokens += [t for out in outputs if out.request_id == "d" for t in out.new_token_ids]
        long_done = long_done or any(o.request_id == "long" and o.finished for o in outputs)
        request = engine.scheduler.get_request("long")
        done = 300 if request is None else request.num_computed_tokens
        if done > computed:
            chunks.append(done - computed)
            computed = done
    assert chunks == [70, 70, 70, 70, 20] and long_done, chunks
    assert tokens == expected[PROMPTS[0]]
    engine.check_invariants()


def test_generate_cli_streams_only_the_text(hf_reference):
    prompt = "The capital of France is"
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "generate", prompt, "--max-tokens", "12",
         "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = hf_reference.greedy(hf_reference.prompt_ids(prompt), 12)
    assert proc.stdout == expected.text + "\n" and "Paris" in proc.stdout
    assert "loading" not in proc.stdout and "loading weights" in proc.stderr


def test_generate_cli_bad_model_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "generate", "hi", "--model",
         str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "missing.gguf" in proc.stderr and proc.stdout == ""


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
         resumed: list[int] = ()) -> tuple[list[int], list[str]]:
    """Every output token and each step's text for one request, run to its finish."""
    engine.add_request(rid, prompt, params, resumed_token_ids=resumed)
    tokens, texts = [], []
    while True:
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                texts.append(out.new_text)
                if out.finished:
                    engine.check_invariants()
                    return tokens, texts
        engine.check_invariants()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True,
                   presence_penalty=0.5),
], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_exactly_as_the_undisturbed_run(loaded, params):
    engine = make_engine(loaded)
    prompt = engine.tokenizer.encode("Write a haiku about the sea.")
    whole, whole_texts = _run(engine, "whole", prompt, params)
    for cut in (1, 9, 23):
        # Another engine (another worker) picks the request up after `cut` tokens.
        other = make_engine(loaded)
        rest, rest_texts = _run(other, f"resumed-{cut}", prompt, params, resumed=whole[:cut])
        assert whole[:cut] + rest == whole, f"cut after {cut}"
        # The text continues where the first run's text for those tokens ended.
        assert "".join(whole_texts[:cut]) + "".join(rest_texts) == "".join(whole_texts)
        assert other.kv_cache.num_used_blocks == 0
    finished = make_engine(loaded)
    with pytest.raises(ValueError, match="already"):
        finished.add_request("done", prompt, params, resumed_token_ids=whole)
    finished.check_invariants()
    assert not finished.has_unfinished()


def test_a_warmed_up_engine_answers_exactly_as_a_fresh_one(loaded, expected) -> None:
    from engine.warm_up import warm_up

    engine = make_engine(loaded, max_num_batched_tokens=64, max_num_seqs=8)
    lines: list[str] = []
    threshold = engine.runner.mixed_split_min_tokens
    report = warm_up(engine, lines.append)
    assert report.num_requests >= 15 and report.num_steps > 20 and report.seconds > 0
    assert lines[0].startswith("warming up: prefill of 1 token")
    # Mixed steps both ways, and the split threshold it lowered for the second is back.
    assert "warming up: prefills joining running decodes, split" in lines
    assert engine.runner.mixed_split_min_tokens == threshold
    # Nothing held, nothing for the registry's index, nothing left in the scheduler.
    assert engine.kv_cache.num_used_blocks == 0 and engine.kv_cache.drain_events() == []
    assert not engine.has_unfinished()
    engine.check_invariants()
    results = engine.generate(encode_all(engine), GREEDY)
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]
    with pytest.raises(RuntimeError):
        engine.add_request("busy", [1, 2, 3], GREEDY)
        warm_up(engine)


def test_kv_ready_comes_once_from_the_step_of_the_final_prompt_chunk(loaded) -> None:
    from engine.kv_ready import KVReady
    from engine.request import RequestMode

    engine = make_engine(loaded, prefill_chunk_tokens=8)  # a prompt of 4+ chunks
    ids = engine.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[4])
    assert len(ids) >= 24
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("p", ids, params, mode=RequestMode.PREFILL_ONLY, notify_kv_ready=True)
    engine.add_request("q", ids[:9], params, mode=RequestMode.PREFILL_ONLY)  # asks for none
    seen: list[tuple[int, KVReady]] = []
    first_token_step = None
    for n in range(1, 20):
        outputs = engine.step(lambda ready, n=n: seen.append((n, ready)))
        if any(o.request_id == "p" for o in outputs):
            first_token_step = n
            break
    assert first_token_step is not None and first_token_step > 1  # chunked
    assert [(n, r.request_id) for n, r in seen] == [(first_token_step, "p")]
    ready = seen[0][1]
    assert ready.num_prompt_tokens == len(ids) and ready.layer_events is None  # CPU
    assert tuple(ready.block_ids) == tuple(engine.kv_cache.block_table("p"))
    # The named blocks hold what a from-scratch prefill of the same prompt writes.
    fresh = make_engine(loaded)
    fresh.add_request("r", ids, params, mode=RequestMode.PREFILL_ONLY)
    while not fresh.step():
        pass
    num_full = len(ids) // engine.kv_storage.layout.block_size
    assert num_full >= 1
    got = engine.kv_storage.kv[:, :, list(ready.block_ids)[:num_full]]
    want = fresh.kv_storage.kv[:, :, fresh.kv_cache.block_table("r")[:num_full]]
    # Chunks of 8 sum attention in another order than one pass: over 30 fp32 layers the
    # same block differs by up to a few 1e-5 (values near 1); a wrong block by more than 1.
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    engine.check_invariants()
    with pytest.raises(ValueError, match="PREFILL_ONLY"):
        engine.add_request("d", ids, params, notify_kv_ready=True)


def test_an_aborted_request_owes_no_kv_ready_and_its_id_starts_clean(loaded) -> None:
    from engine.request import RequestMode

    engine = make_engine(loaded, prefill_chunk_tokens=8)
    ids = engine.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[4])
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("p", ids, params, mode=RequestMode.PREFILL_ONLY, notify_kv_ready=True)
    seen: list[str] = []
    engine.step(lambda ready: seen.append(ready.request_id))  # its first chunk only
    assert engine.abort_request("p")
    engine.check_invariants()
    engine.add_request("p", ids, params, mode=RequestMode.PREFILL_ONLY)  # the id, reused
    while not any(o.request_id == "p" for o in engine.step(
            lambda ready: seen.append(ready.request_id))):
        pass
    assert seen == []
    engine.check_invariants()

