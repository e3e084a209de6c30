"""plan_kv_pool: the KV pool takes what the budget leaves after weights, activations and
graphs, never more than is free, and fails loudly when not one block fits."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.memory_plan import SAFETY_MARGIN_BYTES, kv_block_bytes, plan_kv_pool

GIB = 1 << 30
# Llama-3-8B: 32 layers, 8 KV heads of 128; a 16-token block in bf16 is 2 MiB.
LLAMA3_8B = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=False)
BLOCK = kv_block_bytes(LLAMA3_8B, 16, torch.bfloat16)


def test_block_bytes_of_the_8b_shape():
    assert BLOCK == 2 * 32 * 16 * 8 * 128 * 2 == 2 << 20


def test_budget_after_weights_activations_and_graphs():
    plan = plan_kv_pool(total_bytes=140 * GIB, free_bytes=123 * GIB, in_use_bytes=17 * GIB,
                        activation_bytes=2 * GIB, cuda_graph_bytes=GIB,
                        gpu_memory_fraction=0.9, block_bytes=BLOCK)
    expected = int(140 * GIB * 0.9) - 20 * GIB
    assert plan.limited_by == "budget"
    assert plan.num_kv_blocks == expected // BLOCK
    assert plan.kv_cache_bytes == plan.num_kv_blocks * BLOCK <= expected
    assert expected - plan.kv_cache_bytes < BLOCK  # rounded down by less than one block
    assert f"{plan.num_kv_blocks} blocks" in plan.report()


def test_another_process_on_the_device_caps_the_pool_at_free_memory():
    plan = plan_kv_pool(total_bytes=140 * GIB, free_bytes=40 * GIB, in_use_bytes=17 * GIB,
                        activation_bytes=2 * GIB, cuda_graph_bytes=GIB,
                        gpu_memory_fraction=0.9, block_bytes=BLOCK)
    assert plan.limited_by == "free memory"
    assert plan.kv_cache_bytes <= 40 * GIB - 3 * GIB - SAFETY_MARGIN_BYTES
    assert plan.num_kv_blocks == (37 * GIB - SAFETY_MARGIN_BYTES) // BLOCK


def test_a_lower_fraction_gives_fewer_blocks():
    sizes = [plan_kv_pool(140 * GIB, 123 * GIB, 17 * GIB, 2 * GIB, GIB, f, BLOCK).num_kv_blocks
             for f in (0.5, 0.7, 0.9)]
    assert sizes[0] < sizes[1] < sizes[2]


def test_no_room_for_one_block_is_an_error_that_says_why():
    with pytest.raises(ValueError, match="no room for the KV pool.*Raise gpu_memory_fraction"):
        plan_kv_pool(total_bytes=24 * GIB, free_bytes=7 * GIB, in_use_bytes=17 * GIB,
                     activation_bytes=2 * GIB, cuda_graph_bytes=GIB,
                     gpu_memory_fraction=0.8, block_bytes=BLOCK)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fraction_outside_zero_to_one_is_rejected(fraction):
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        plan_kv_pool(140 * GIB, 123 * GIB, 17 * GIB, 0, 0, fraction, BLOCK)


def test_mixed_graphs_reserve_an_eager_step_and_their_logits():
    from engine.memory_plan import graph_reserve_bytes

    assert graph_reserve_bytes(100, 1000, 0, 50) == 100
    assert graph_reserve_bytes(100, 1000, 264, 128256) == 100 + 1000 + 264 * 128256 * 4
