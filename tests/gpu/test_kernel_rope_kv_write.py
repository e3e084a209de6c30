"""rope_write_kv_: the fused kernel against its reference (apply_rope_ then write_kv_cache_),
on strided views of one fused qkv projection, with a padding token that writes nothing."""

from __future__ import annotations

import pytest
import torch

from engine.config import Llama3RopeScaling
from engine.kernels.rope import rope_cos_sin
from engine.kernels.rope_kv_write import (rope_write_kv_, rope_write_kv_reference_,
                                          rope_write_kv_triton_)

pytestmark = pytest.mark.timeout(120)

SCALING = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_triton_matches_rope_then_cache_write(target, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(0)
    num_tokens, block_size, num_blocks = 5, 16, 12
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = target.randn(num_tokens, q_width + 2 * kv_width)
    positions = torch.tensor([0, 7, 300, 5000, 2], device=target.device)
    # Blocks 7, 2 and 11, out of order; token 2 is padding (-1) and must write nothing.
    slots = torch.tensor([7 * 16 + 3, 2 * 16, -1, 11 * 16 + 15, 7 * 16 + 4],
                         device=target.device)
    cos, sin = rope_cos_sin(head_dim, 8192, 500000.0, SCALING, target.device)
    cache = target.randn(2, num_blocks, block_size, num_kv_heads, head_dim)

    def views(t):
        return (t[:, :q_width].view(num_tokens, num_heads, head_dim),
                t[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_dim),
                t[:, q_width + kv_width:].view(num_tokens, num_kv_heads, head_dim))

    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    rope_write_kv_reference_(*views(expected_qkv), positions, cos, sin, *expected_cache, slots)
    rope_write_kv_triton_(*views(qkv), positions, cos, sin, *cache, slots)
    torch.testing.assert_close(qkv, expected_qkv, atol=target.atol, rtol=target.rtol)
    torch.testing.assert_close(cache, expected_cache, atol=target.atol, rtol=target.rtol)
    assert torch.equal(qkv[:, q_width + kv_width:], expected_qkv[:, q_width + kv_width:])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_an_fp8_cache_holds_the_rotated_k_and_v_within_one_fp8_step(target, num_heads,
                                                                     num_kv_heads, head_dim):
    from engine.kv_quant import dequantize
    from engine.kv_storage import KVLayout, KVStorage

    torch.manual_seed(0)
    q = target.randn(5, num_heads, head_dim)
    k, v = target.randn(5, num_kv_heads, head_dim) * 20, target.randn(5, num_kv_heads, head_dim)
    positions = torch.tensor([0, 7, 300, 5000, 2], device=target.device)
    slots = torch.tensor([7 * 16 + 3, 2 * 16, -1, 11 * 16 + 15, 7 * 16 + 4],
                         device=target.device)
    cos, sin = rope_cos_sin(head_dim, 8192, 500000.0, SCALING, target.device)
    layout = KVLayout(dtype="fp8_e4m3", num_layers=1, num_blocks=12, block_size=16,
                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    ours, theirs = KVStorage(layout, target.device), KVStorage(layout, target.device)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    rope_write_kv_triton_(q, k, v, positions, cos, sin, *ours.layer(0), slots)
    rope_write_kv_reference_(q2, k2, v2, positions, cos, sin, *theirs.layer(0), slots)
    torch.testing.assert_close(k, k2, atol=target.atol, rtol=target.rtol)
    live = slots >= 0
    blocks, offsets = slots[live] // 16, slots[live] % 16
    for index, rotated in ((0, k2), (1, v2)):
        mine, ref = ours.layer(0)[index], theirs.layer(0)[index]
        got = dequantize(mine.values[blocks, offsets], mine.scales[blocks, offsets],
                         torch.float32)
        want = dequantize(ref.values[blocks, offsets], ref.scales[blocks, offsets],
                          torch.float32)
        step = rotated[live].float().abs().amax(dim=-1, keepdim=True) / 8  # one e4m3 step
        assert bool(((got - want).abs() <= step + 1e-6).all())
        assert bool(((got - rotated[live].float()).abs() <= step / 2 + 1e-2).all())
    assert int((ours.kv != 0).view(1, 2, 12, -1).any(dim=-1).sum()) == 2 * 3  # blocks 7, 2, 11


def test_only_live_slots_change(target):
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    q = target.randn(3, num_heads, head_dim)
    k = target.randn(3, num_kv_heads, head_dim)
    v = target.randn(3, num_kv_heads, head_dim)
    cache = target.randn(2, 4, 16, num_kv_heads, head_dim)
    before = cache.clone()
    cos, sin = rope_cos_sin(head_dim, 64, 10000.0, None, target.device)
    slots = torch.tensor([17, -1, 63], device=target.device)
    rope_write_kv_triton_(q, k, v, torch.tensor([1, 0, 40], device=target.device), cos, sin,
                          *cache, slots)
    changed = (cache != before).any(dim=(-1, -2))  # [kv, block, slot]
    assert int(changed.sum()) == 2 * 2
    assert changed[0, 1, 1] and changed[1, 3, 15]
    assert torch.equal(cache[1, 3, 15], v[2])  # v is copied, not rotated
    assert torch.equal(cache[0, 3, 15], k[2])  # the cache holds the rotated k


def test_dispatch_uses_the_torch_path_off_cuda():
    q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    cos, sin = rope_cos_sin(8, 16, 10000.0)
    original_k = k.clone()
    rope_write_kv_(q, k, v, torch.tensor([3]), cos, sin, k_cache, v_cache, torch.tensor([5]))
    assert not torch.equal(k, original_k)  # position 3 rotates
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[1, 1], v[0])
