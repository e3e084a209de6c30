"""Overlapped engine steps on a CUDA device: the next step reads the previous step's tokens
on the device (decode CUDA graphs, and mixed steps from their graphs or eager), the host
gets them through pinned copies and events, and every token, logprob and finish equals a
plain run's.

CUDA only: on the CPU the same bookkeeping runs in tests/integration/test_engine_overlapped.py
on the real default model (the model runs inside `execute` there, so nothing overlaps).
Every request ends at its max_tokens, so both runs give the model the same batches and its
deterministic kernels the same inputs: the tokens must be identical, not merely close.
"""

from __future__ import annotations

import random

import pytest
import torch
from word_tokenizer import word_tokenizer

from benchmarks.engine_gpu_model import build_random_model
from engine.config import ModelConfig
from engine.llm_engine import EngineConfig, LLMEngine
from protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 512
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=256,
                     intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=512, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, seed=3, device=torch.device("cuda"), dtype=torch.bfloat16)


def run(model, overlap: bool, mixed_graphs: bool) -> dict[str, tuple]:
    engine = LLMEngine.for_model(model, CONFIG, word_tokenizer(VOCAB), EngineConfig(
        num_kv_blocks=128, block_size=16, max_num_seqs=16, max_num_batched_tokens=64,
        dtype=torch.bfloat16, device="cuda", mixed_cuda_graphs=mixed_graphs))
    rng = random.Random(0)
    requests = {}
    for i in range(12):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 90))]
        if i % 4 == 3:
            params = SamplingParams(max_tokens=10 + i, temperature=0.8, top_k=50, seed=i,
                                    logprobs=3, ignore_eos=True, frequency_penalty=0.3)
        else:
            params = SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True,
                                    logprobs=1 if i % 2 else None)
        requests[f"r{i}"] = (prompt, params)
    seen: dict[str, list] = {rid: [[], [], []] for rid in requests}
    added = 0
    while added < len(requests) or engine.has_unfinished():
        if added < len(requests):  # arrivals while others decode: mixed steps
            rid = f"r{added}"
            engine.add_request(rid, *requests[rid])
            added += 1
        for out in engine.step(overlap=overlap):
            tokens, logprobs, finishes = seen[out.request_id]
            tokens += out.new_token_ids
            logprobs += [None if lp is None else (lp.token_id, round(lp.logprob, 4),
                                                  lp.top_token_ids) for lp in out.logprobs]
            finishes.append(out.finish_reason)
        engine.check_invariants()
    assert engine.kv_cache.num_used_blocks == 0
    assert engine.runner.graphs is not None  # the decode steps replayed graphs
    mixed = engine.runner.mixed_graphs
    # With mixed graphs the prefill and mixed steps replayed them (their decode rows
    # reading the previous step's tokens on the device when overlapped).
    assert (mixed is not None and mixed.num_runs > 0) == mixed_graphs
    return {rid: (tuple(t), tuple(lp), f[-1]) for rid, (t, lp, f) in seen.items()}


@pytest.mark.parametrize("mixed_graphs", [True, False], ids=["mixed-graphs", "mixed-eager"])
def test_overlapped_steps_on_cuda_give_the_plain_steps_tokens(model, mixed_graphs):
    plain = run(model, overlap=False, mixed_graphs=mixed_graphs)
    overlapped = run(model, overlap=True, mixed_graphs=mixed_graphs)
    assert overlapped == plain
    for rid, (tokens, _, finish) in plain.items():
        assert finish == "length" and len(tokens) > 0


def test_overlapped_steps_are_timed_on_the_device_with_their_own_shapes(model):
    """A chunked prompt beside decodes: every launched step is timed once, in order, with
    its own shape, although the chunks that sample nothing are never waited for."""
    from engine.step_shape import step_shape
    from engine.step_timer import StepTimer

    engine = LLMEngine.for_model(model, CONFIG, word_tokenizer(VOCAB), EngineConfig(
        num_kv_blocks=128, block_size=16, max_num_seqs=16, max_num_batched_tokens=64,
        dtype=torch.bfloat16, device="cuda"))
    engine.step_timer = StepTimer()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params)
    engine.add_request("long", [(3 * i) % VOCAB + 1 for i in range(300)], params)
    launched, timed = [], []
    while engine.has_unfinished():
        engine.step(overlap=True)
        if engine.last_schedule is not None and not engine.last_schedule.is_empty:
            launched.append(step_shape(engine.last_schedule))
        timed += engine.step_timer.drain()
    torch.cuda.synchronize()
    timed += engine.step_timer.drain()
    assert [t.shape for t in timed] == launched
    assert sum(1 for s in launched if s.prefill_tokens >= 60) >= 4  # the prompt's chunks
    assert all(t.seconds > 0 for t in timed)
