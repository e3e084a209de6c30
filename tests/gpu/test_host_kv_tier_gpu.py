"""The host KV tier on a CUDA device: pinned host memory, copies on a side stream ordered
against the engine's stream by events (engine/host_copier.py).

A block offloaded and then overwritten by work queued on the engine's stream right after
(as the next step overwrites a block it reused) comes back intact; and an engine with a tiny
pool, running overlapped steps, serves an evicted prefix from the host tier with the same
tokens as an engine whose pool kept it. CUDA only: tests/integration/test_host_kv_tier_engine.py
runs the same on the CPU on the real default model.
"""

from __future__ import annotations

import random

import pytest
import torch
from word_tokenizer import word_tokenizer

from benchmarks.engine_gpu_model import build_random_model
from engine.config import ModelConfig
from engine.host_copier import StreamHostCopier
from engine.kv_storage import KVLayout, KVStorage
from engine.llm_engine import EngineConfig, LLMEngine
from protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 512
# max_position_embeddings = 12 blocks of 16: both runs below then give their graphs the same
# table width (min(pool, longest context)), so the same kernels with the same split counts run
# in both, and any difference in tokens is the tier's, not a change of rounding order.
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=256,
                     intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=192, tie_word_embeddings=False)


def test_an_offload_completes_before_the_engine_stream_overwrites_the_block():
    layout = KVLayout(dtype="bfloat16", num_layers=4, num_blocks=8, block_size=16,
                      num_kv_heads=8, head_dim=128)
    storage = KVStorage(layout, "cuda")
    storage.kv.normal_()
    tier = storage.host_tier(4 * 4 * 2 * 16 * 8 * 128 * 2)
    assert tier is not None and isinstance(tier._copier, StreamHostCopier)
    assert tier._copier.host.is_pinned()
    original = storage.kv[:, :, 2].clone()
    torch.cuda.synchronize()
    # A long kernel queued before the copy (a spin of about 50 ms): the copy must wait for
    # it, not run beside it.
    torch.cuda._sleep(100_000_000)
    storage.kv[:, :, 2].add_(1)  # written by the "step" before the eviction
    expected = original + 1
    assert tier.offer(7, 2)
    storage.kv[:, :, 2].fill_(-3)  # the next step overwrites the evicted block
    tier.pin([7])
    tier.reload([7], [5])
    torch.cuda.synchronize()
    assert torch.equal(storage.kv[:, :, 5], expected)
    stats = tier.stats()
    assert stats.offloaded_bytes == stats.reloaded_bytes == tier.block_bytes


def test_offers_ahead_are_copied_in_one_batch_behind_the_engine_stream():
    """Blocks into slots in runs and out of order (one gather, a copy per run of slots),
    behind a long kernel queued before them, with more blocks than one staging buffer."""
    layout = KVLayout(dtype="bfloat16", num_layers=3, num_blocks=40, block_size=16,
                      num_kv_heads=2, head_dim=64)
    storage = KVStorage(layout, "cuda")
    storage.kv.normal_()
    block_bytes = storage.kv[:, :, 0].numel() * storage.kv.element_size()
    tier = storage.host_tier(20 * block_bytes)
    assert tier is not None
    copier = tier._copier
    assert isinstance(copier, StreamHostCopier)
    for i in range(20):  # every slot held, then four made recent: the LRU order has gaps
        assert tier.offer_ahead(i, 39 - i)
    tier.flush()
    for i in (2, 5, 6, 11):
        assert tier.offer_ahead(i, 39 - i)
    tier.wait_for_copies()
    blocks = [37, 3, 4, 5, 20, 1, 0, 39, 8, 9, 10, 11, 12, 13, 14, 15, 16, 30, 31, 2]
    torch.cuda._sleep(100_000_000)
    for block_id in blocks:  # written by the step before the blocks are freed
        storage.kv[:, :, block_id].mul_(2)
    for i, block_id in enumerate(blocks):  # queued while the kernel above still runs
        assert tier.offer_ahead(1000 + i, block_id)
    slots = [tier._slot_by_hash[1000 + i] for i in range(len(blocks))]
    assert slots[:4] == [0, 1, 3, 4] and slots[-4:] == [2, 5, 6, 11]
    tier.flush()
    expected = storage.kv[:, :, blocks].movedim(2, 0).cpu()  # waits for the engine stream
    tier.wait_for_copies()
    assert torch.equal(copier.host[slots], expected)
    assert tier.stats().offloaded_bytes == 40 * block_bytes
    tier.check_invariants()


def run(model, prompts: list[list[int]], num_kv_blocks: int,
        host_bytes: int) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.for_model(model, CONFIG, word_tokenizer(VOCAB), EngineConfig(
        num_kv_blocks=num_kv_blocks, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
        dtype=torch.bfloat16, device="cuda", kv_host_cache_bytes=host_bytes))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = []
    for i, prompt in enumerate(prompts):  # one at a time: the same batches in both runs
        engine.add_request(f"r{i}", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step(overlap=True):
                tokens += out.new_token_ids
            engine.check_invariants()
        results.append(tokens)
    return results, engine


def test_an_evicted_prefix_comes_back_from_the_host_with_the_same_tokens():
    model = build_random_model(CONFIG, seed=3, device=torch.device("cuda"),
                               dtype=torch.bfloat16)
    rng = random.Random(0)
    shared = [rng.randrange(1, VOCAB) for _ in range(80)]
    fillers = [[rng.randrange(1, VOCAB) for _ in range(150)] for _ in range(2)]
    prompts = [shared + [5, 6, 7], *fillers, shared + [9, 10]]
    tiered, engine = run(model, prompts, 12, 64 << 20)
    # The same prompts on a pool that evicts nothing: the last one finds the shared prefix
    # on the device, so it computes the same two tokens over the same 80 cached ones; a
    # reload is a bit-exact copy, so the tokens must be equal, not merely close.
    kept, reference = run(model, prompts, 64, 0)
    assert reference.kv_cache.find_cached_prefix(prompts[-1]).num_cached_tokens == 80
    assert tiered == kept
    tier = engine.kv_cache.host_tier
    assert tier is not None and tier.stats().num_hit_blocks == 5  # shared's 80 tokens
    assert engine.kv_cache.find_cached_prefix(prompts[-1]).block_ids  # back on the device
    assert engine.kv_cache.num_used_blocks == 0
