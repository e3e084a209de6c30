"""The prefill lane on a CUDA device (engine/prefill_lane.py): prompt chunks on one green-
context stream, overlapped decode steps (CUDA graphs) on another, one KV pool written by
both. What can go wrong here and not on the CPU is ordering: a chunk writing blocks a decode
step still writes, or a decode reading a prompt's blocks before the chunk wrote them. Either
gives tokens that are not the model's greedy choice.

The reference is each prompt alone on an engine without a lane. A batch changes the rounding
of a random bf16 model's logits (other matmul shapes), so a token may differ where the
reference's two best tokens were within a hair of each other; from there on the two
sequences are different texts and are not compared. A token that differs where the
reference's best token led by a clear margin fails the test.
"""

from __future__ import annotations

import random

import pytest
import torch
from word_tokenizer import word_tokenizer

from benchmarks.engine_gpu_model import build_random_model
from engine.config import ModelConfig
from engine.lane_streams import lane_streams, shared_lane_streams
from engine.llm_engine import EngineConfig, LLMEngine
from protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 512
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=512,
                     intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2,
                     head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=1024, tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
NEAR_TIE = 0.05  # nats between the reference's two best tokens


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, seed=5, device=torch.device("cuda"), dtype=torch.bfloat16)


def engine_for(model, lane_sms: int, shared: bool = False) -> LLMEngine:
    return LLMEngine.for_model(model, CONFIG, word_tokenizer(VOCAB), EngineConfig(
        num_kv_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=128,
        dtype=torch.bfloat16, device="cuda", prefill_lane_sms=lane_sms,
        prefill_lane_shared=shared))


def test_green_contexts_split_the_device():
    streams = lane_streams(torch.device("cuda"), 40)
    assert streams is not None, "no green contexts on this device"
    total = torch.cuda.get_device_properties(0).multi_processor_count
    assert streams.lane_sms + streams.decode_sms == total and streams.lane_sms == 40


def test_a_shared_lane_runs_on_plain_streams_of_two_priorities():
    streams = shared_lane_streams(torch.device("cuda"))
    assert not streams.contexts and streams.decode.priority < streams.lane.priority


@pytest.mark.parametrize("shared", [False, True], ids=["green", "shared"])
def test_lane_tokens_are_the_models_greedy_choices(model, shared):
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1, VOCAB) for _ in range(rng.randrange(20, 600))]
               for i in range(24)}
    engine = engine_for(model, 40, shared)
    assert engine.lane is not None and engine.lane.streams is not None
    seen: dict[str, list] = {rid: [] for rid in prompts}
    pending = list(prompts.items())
    steps = overlapped_with_lane = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:  # arrivals while others decode: chunks fly beside them
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, GREEDY)
        overlapped_with_lane += engine.lane.flying and engine.scheduler.num_running > 0
        for out in engine.step(overlap=True):
            seen[out.request_id] += list(zip(out.new_token_ids, out.logprobs))
        steps += 1
        engine.check_invariants()
    assert engine.kv_cache.num_used_blocks == 0
    assert overlapped_with_lane > 10, "the lane never ran beside decode steps"
    assert engine.lane.num_steps >= sum(len(p) for p in prompts.values()) // 128
    reference = engine_for(model, 0)
    compared = 0
    for rid, prompt in prompts.items():
        want = reference.generate([prompt], GREEDY)[0]
        got = [token for token, _ in seen[rid]]
        assert len(got) == GREEDY.max_tokens, rid
        for i, (token, expected) in enumerate(zip(got, want.token_ids)):
            if token != expected:
                top = want.logprobs[i]
                gap = top.top_logprobs[0] - top.top_logprobs[1]
                assert gap < NEAR_TIE, (f"{rid} token {i}: {token} where the reference's "
                                        f"{expected} led by {gap:.3f} nats")
                break
            compared += 1
    assert compared >= len(prompts) * GREEDY.max_tokens // 2
