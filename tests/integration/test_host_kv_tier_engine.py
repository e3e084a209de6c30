"""The host KV tier on the real default model: a prefix evicted from a tiny device pool is
served from host memory to a later request, token-identical to a cold run and to
transformers; and random traffic with aborts under a tiny pool and a tiny tier keeps every
invariant after every step and leaks nothing."""

from __future__ import annotations

import random

import pytest
from default_engine import make_engine

from engine.engine_load import engine_load
from engine.llm_engine import LLMEngine
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = ("You are a careful assistant. Answer briefly and precisely, and never invent facts "
          "you do not know. When a question is ambiguous, say which reading you answer and "
          "why. Question: ")
HOST_BYTES = 24 << 20  # ~34 blocks of the default model's float32 KV


def _run(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request(request_id, prompt, GREEDY)
    tokens, cached = [], -1
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request_id
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
        engine.check_invariants()
    return tokens, cached


def test_an_evicted_prefix_is_served_from_the_host_tier(loaded, hf_reference):
    engine = make_engine(loaded, num_kv_blocks=8, kv_host_cache_bytes=HOST_BYTES)
    tier = engine.kv_cache.host_tier
    assert tier is not None
    encode = engine.tokenizer.encode
    a = encode(SHARED + "What is two plus two?")
    b = encode(SHARED + "What is the colour of the sky?")
    num_shared_blocks = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) // 16
    assert num_shared_blocks >= 2
    _run(engine, "a", a)
    fillers = ("List three colours: red, green, and then a story about each of them, in order,",
               "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number, computed iteratively.\"\"\"\n")
    for i, filler in enumerate(fillers):
        _run(engine, f"filler{i}", encode(filler * 3))  # evicts a's blocks from the device
    assert engine.kv_cache.find_cached_prefix(b).block_ids == ()  # none left on the device
    assert tier.num_leading_held(engine.kv_cache.find_cached_prefix(b).host_block_hashes) \
        == num_shared_blocks
    hits_before = tier.stats().num_hit_blocks
    tokens, cached = _run(engine, "b", b)
    assert cached == 16 * num_shared_blocks  # the whole shared prefix, none recomputed
    assert tier.stats().num_hit_blocks - hits_before == num_shared_blocks
    assert tier.stats().reloaded_bytes > 0 and tier.stats().offloaded_bytes > 0
    cold_tokens, cold_cached = _run(make_engine(loaded, num_kv_blocks=8), "b", b)
    assert cold_cached == 0
    assert tokens == cold_tokens
    assert tokens == hf_reference.greedy(b, GREEDY.max_tokens, ignore_eos=True).token_ids
    assert engine.kv_cache.num_used_blocks == 0
    load = engine_load(engine)  # what the worker publishes, and the cluster page shows
    assert (load.num_host_blocks_used, load.num_host_blocks_total) == \
        (tier.num_held_blocks, tier.num_host_blocks)


def test_random_traffic_with_aborts_keeps_invariants_and_leaks_nothing(loaded):
    engine = make_engine(loaded, num_kv_blocks=6, max_num_seqs=3,
                         kv_host_cache_bytes=6 * 30 * 2 * 16 * 3 * 64 * 4)  # 6 blocks
    tier = engine.kv_cache.host_tier
    assert tier is not None and tier.num_host_blocks == 6
    rng = random.Random(7)
    stems = [[rng.randrange(1000, 9000) for _ in range(40)] for _ in range(5)]
    live: list[str] = []
    for i in range(16):
        prompt = rng.choice(stems)[:rng.randrange(17, 40)] + \
            [rng.randrange(1000, 9000) for _ in range(rng.randrange(1, 12))]
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=rng.randrange(1, 5), temperature=0.0, ignore_eos=True))
        live.append(f"r{i}")
        for _ in range(rng.randrange(1, 4)):
            if rng.random() < 0.15 and live:
                engine.abort_request(live.pop(rng.randrange(len(live))))
            for out in engine.step():
                if out.finish_reason is not None and out.request_id in live:
                    live.remove(out.request_id)
            engine.check_invariants()
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert engine.kv_cache.num_used_blocks == 0 and engine.kv_cache.num_tables == 0
    assert tier.stats().num_hit_blocks > 0  # the tier served some prefix
