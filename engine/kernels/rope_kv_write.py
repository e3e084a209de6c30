"""RoPE and the KV-cache write fused into one kernel: the attention prologue of every layer.

    q, k      <- rope(q, positions), rope(k, positions)        in place (as `apply_rope_`)
    k_cache[slot], v_cache[slot] <- rotated k, v               (as `write_kv_cache_`)

Unfused, a decode step launches two tiny kernels per layer that each read k; fused, one
program per token reads q, k and v once and writes everything. At batch 1 a kernel that
small costs its launch and one memory round trip (~2 us in a CUDA graph on an H200), so
this saves about one such cost per layer. A negative slot is a padding token: its q and k
are still rotated (harmless, never read), nothing is written to the cache. The contract
and the rounding are exactly those of the two ops it replaces (see rope.py and
kv_cache_write.py), which are its reference, FP8 caches included (engine/kernels/fp8_rows.py:
one scale per head over both halves of the rotated vector).
"""

from __future__ import annotations

import torch

from engine.kernels.backend import import_triton, next_power_of_2, require_triton, use_triton
from engine.kernels.fp8_rows import store_fp8_halves
from engine.kernels.kv_cache_write import write_kv_cache_reference_
from engine.kernels.rope import apply_rope_reference_
from engine.kv_quant import FP8_MAX, CacheView, cache_parts, scale_args

triton, tl, _ = import_triton()


def rope_write_kv_reference_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             k_cache: CacheView, v_cache: CacheView,
                             slot_mapping: torch.Tensor) -> None:
    """The torch path: `apply_rope_reference_` then `write_kv_cache_reference_`."""
    apply_rope_reference_(q, k, positions, cos, sin)
    write_kv_cache_reference_(k, v, k_cache, v_cache, slot_mapping)


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr,
                          k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
                          q_token_stride, q_head_stride, k_token_stride, k_head_stride,
                          v_token_stride, v_head_stride, table_stride,
                          cache_block_stride, cache_slot_stride, cache_head_stride,
                          scale_block_stride, scale_slot_stride, num_heads, num_kv_heads,
                          PAGE_SIZE: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr,
                          BLOCK_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr,
                          FP8_LIMIT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = dims < HALF
    cos = tl.load(cos_ptr + pos * table_stride + dims, mask=d_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * table_stride + dims, mask=d_mask, other=0.0)

    q_heads = tl.arange(0, BLOCK_Q_HEADS)[:, None]
    q_mask = (q_heads < num_heads) & d_mask
    q_ptrs = q_ptr + token * q_token_stride + q_heads * q_head_stride + dims
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_ptrs, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_ptrs + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    heads = tl.arange(0, BLOCK_K_HEADS)[:, None]
    kv_mask = (heads < num_kv_heads) & d_mask
    k_ptrs = k_ptr + token * k_token_stride + heads * k_head_stride + dims
    k1 = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptrs + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    # Rounded to the model dtype once, exactly as the unfused rope stores it.
    r1 = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty)
    r2 = (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
    tl.store(k_ptrs, r1, mask=kv_mask)
    tl.store(k_ptrs + HALF, r2, mask=kv_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        cache = ((slot // PAGE_SIZE) * cache_block_stride + (slot % PAGE_SIZE) * cache_slot_stride
                 + heads * cache_head_stride + dims)
        v_ptrs = v_ptr + token * v_token_stride + heads * v_head_stride + dims
        v1 = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        v2 = tl.load(v_ptrs + HALF, mask=kv_mask, other=0.0)
        if QUANT:  # one scale per head over both halves; masked lanes are 0
            row = tl.arange(0, BLOCK_K_HEADS)
            scale_at = ((slot // PAGE_SIZE) * scale_block_stride
                        + (slot % PAGE_SIZE) * scale_slot_stride + row)
            store_fp8_halves(r1, r2, k_cache_ptr, cache, HALF, kv_mask, k_scale_ptr, scale_at,
                             row < num_kv_heads, FP8_LIMIT)
            store_fp8_halves(v1, v2, v_cache_ptr, cache, HALF, kv_mask, v_scale_ptr, scale_at,
                             row < num_kv_heads, FP8_LIMIT)
        else:
            tl.store(k_cache_ptr + cache, r1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(k_cache_ptr + cache + HALF, r2.to(k_cache_ptr.dtype.element_ty),
                     mask=kv_mask)
            tl.store(v_cache_ptr + cache, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_cache_ptr + cache + HALF, v2.to(v_cache_ptr.dtype.element_ty),
                     mask=kv_mask)


def rope_write_kv_triton_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: CacheView, v_cache: CacheView,
                          slot_mapping: torch.Tensor) -> None:
    """The Triton op. q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim] (strided
    views of a fused projection are fine); cos/sin fp32 [max_positions, head_dim / 2];
    caches [num_blocks, block_size, num_kv_heads, head_dim] (or FP8 values and scales);
    slot_mapping [T]."""
    require_triton()
    k_scales, v_scales, scale_block, scale_slot, quant = scale_args(k_cache, v_cache)
    k_cache, v_cache = cache_parts(k_cache)[0], cache_parts(v_cache)[0]
    num_tokens, num_heads, head_dim = q.shape
    if (k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim
            or positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,)):
        raise ValueError(f"rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, positions {tuple(positions.shape)} and "
                         f"slot_mapping {tuple(slot_mapping.shape)} disagree")
    if head_dim % 2 or any(t.stride(-1) != 1 for t in (q, k, v, k_cache)):
        raise ValueError("rope_write_kv: head_dim must be even and contiguous everywhere")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_write_kv: k_cache and v_cache must have one shape and layout")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"rope_write_kv: cache {tuple(k_cache.shape)} does not hold k")
    half = head_dim // 2
    if (cos.shape != sin.shape or cos.shape[1] != half or cos.stride() != sin.stride()
            or cos.dtype != torch.float32 or cos.stride(-1) != 1):
        raise ValueError(f"rope_write_kv: cos/sin must both be fp32 [max_positions, {half}]")
    if num_tokens == 0:
        return
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale_block, scale_slot, num_heads, k.shape[1], PAGE_SIZE=k_cache.shape[1],
        BLOCK_Q_HEADS=next_power_of_2(num_heads), BLOCK_K_HEADS=next_power_of_2(k.shape[1]),
        HALF=half, BLOCK_HALF=next_power_of_2(half), QUANT=quant, FP8_LIMIT=FP8_MAX)


def rope_write_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: CacheView,
                   v_cache: CacheView, slot_mapping: torch.Tensor) -> None:
    """Rotate q, k in place and write k, v to the cache: Triton on CUDA, else the reference."""
    if use_triton(q, k, v, positions, cos, sin, cache_parts(k_cache)[0],
                  cache_parts(v_cache)[0], slot_mapping):
        rope_write_kv_triton_(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    else:
        rope_write_kv_reference_(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
