"""RoPE: the Triton op against the torch reference, and the reference against HF Llama."""

from __future__ import annotations

import pytest
import torch

from engine.config import Llama3RopeScaling
from engine.kernels.rope import (apply_rope_, apply_rope_reference_, apply_rope_triton_,
                                 rope_cos_sin, rope_inv_freq)

pytestmark = pytest.mark.timeout(120)

LLAMA31_SCALING = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_triton_matches_reference_on_views_of_fused_qkv(target, num_heads, num_kv_heads,
                                                        head_dim):
    torch.manual_seed(0)
    num_tokens = 6
    qkv = target.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    positions = torch.tensor([0, 1, 7, 300, 5000, 2], device=target.device)
    cos, sin = rope_cos_sin(head_dim, 8192, 500000.0, LLAMA31_SCALING, target.device)

    def views(t):
        return (t[:, :q_width].view(num_tokens, num_heads, head_dim),
                t[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_dim))

    expected = qkv.clone()
    apply_rope_reference_(*views(expected), positions, cos, sin)
    apply_rope_triton_(*views(qkv), positions, cos, sin)
    torch.testing.assert_close(qkv, expected, atol=target.atol, rtol=target.rtol)
    # v (the last kv_width columns) is not rotated.
    assert torch.equal(qkv[:, q_width + kv_width:], expected[:, q_width + kv_width:])


@pytest.mark.parametrize("scaling", [None, LLAMA31_SCALING], ids=["plain", "llama3"])
def test_reference_matches_transformers_llama(scaling):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    head_dim, num_heads, theta = 64, 4, 500000.0
    rope_parameters = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope_parameters = {"rope_type": "llama3", "rope_theta": theta,
                           "factor": scaling.factor,
                           "low_freq_factor": scaling.low_freq_factor,
                           "high_freq_factor": scaling.high_freq_factor,
                           "original_max_position_embeddings":
                               scaling.original_max_position_embeddings}
    config = LlamaConfig(hidden_size=head_dim * num_heads, num_attention_heads=num_heads,
                         num_key_value_heads=num_heads, max_position_embeddings=131072,
                         rope_parameters=rope_parameters)
    rotary = llama.LlamaRotaryEmbedding(config)
    torch.manual_seed(3)
    positions = torch.tensor([0, 3, 1000, 9000, 60000])
    q = torch.randn(1, num_heads, len(positions), head_dim)
    k = torch.randn(1, num_heads, len(positions), head_dim)
    hf_cos, hf_sin = rotary(q, positions[None, :])
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)

    cos, sin = rope_cos_sin(head_dim, 65536, theta, scaling)
    ours_q, ours_k = q[0].transpose(0, 1).clone(), k[0].transpose(0, 1).clone()
    apply_rope_reference_(ours_q, ours_k, positions, cos, sin)
    # fp32 angles at position 60000 carry ~4e-3 rad of rounding either way.
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), atol=2e-2, rtol=0)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), atol=2e-2, rtol=0)


def test_scaling_changes_only_low_frequencies():
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, LLAMA31_SCALING)
    assert torch.equal(plain[:10], scaled[:10])  # short wavelengths: kept
    torch.testing.assert_close(scaled[-10:], plain[-10:] / 8.0)  # long: slowed by factor


def test_dispatch_uses_the_torch_path_off_cuda():
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    cos, sin = rope_cos_sin(8, 16, 10000.0)
    positions = torch.tensor([0, 5, 9])
    expected_q, expected_k = q.clone(), k.clone()
    apply_rope_reference_(expected_q, expected_k, positions, cos, sin)
    apply_rope_(q, k, positions, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
