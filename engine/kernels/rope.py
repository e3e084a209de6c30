"""Rotary position embedding applied in place to q and k (HF Llama's rotate-half convention).

    head_dim = [ x1 (first half) | x2 (second half) ]      i in [0, head_dim / 2)
    x1[i] <- x1[i] * cos[p, i] - x2[i] * sin[p, i]
    x2[i] <- x2[i] * cos[p, i] + x1[i] * sin[p, i]          p = the token's position

`cos` and `sin` are tables [max_positions, head_dim / 2] in fp32 built once by
`rope_cos_sin(...)` (with Llama-3 frequency scaling when the model has it), so a step only
gathers rows by position: no host work, the same kernel for every batch (CUDA-graph safe).
Both paths rotate in fp32 and round once to the model dtype. q and k may be views into one
fused qkv projection: tokens and heads may be strided, head_dim must be contiguous.
"""

from __future__ import annotations

import math

import torch

from engine.config import Llama3RopeScaling
from engine.kernels.backend import import_triton, next_power_of_2, require_triton, use_triton

triton, tl, _ = import_triton()


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, Llama-3 scaled when `scaling` is given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    # Llama-3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated, so the model extends past its original context length.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(head_dim: int, max_positions: int, theta: float,
                 scaling: Llama3RopeScaling | None = None,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim / 2] fp32 on `device`."""
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)[:, None] * inv_freq
    return angles.cos().to(device), angles.sin().to(device)


def _rotate_reference_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    x32 = x.to(torch.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x.copy_(rotated.to(x.dtype))


def apply_rope_reference_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The torch path. q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads,
    head_dim], positions [num_tokens] (int); rotates q and k in place."""
    c = cos.index_select(0, positions.long())[:, None, :]
    s = sin.index_select(0, positions.long())[:, None, :]
    _rotate_reference_(q, c, s)
    _rotate_reference_(k, c, s)


@triton.jit
def _rotate_heads(x_ptr, token, token_stride, head_stride, num_heads, cos, sin,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    ptrs = x_ptr + token * token_stride + heads * head_stride + dims
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
                 q_token_stride, q_head_stride, k_token_stride, k_head_stride,
                 num_heads, num_kv_heads, table_stride,
                 BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * table_stride + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * table_stride + dims, mask=dims < HALF, other=0.0)
    _rotate_heads(q_ptr, token, q_token_stride, q_head_stride, num_heads, cos, sin,
                  BLOCK_Q_HEADS, HALF, BLOCK_HALF)
    _rotate_heads(k_ptr, token, k_token_stride, k_head_stride, num_kv_heads, cos, sin,
                  BLOCK_K_HEADS, HALF, BLOCK_HALF)


def apply_rope_triton_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The Triton op; same shapes and in-place contract as `apply_rope_reference_`."""
    require_triton()
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)} and positions "
                         f"{tuple(positions.shape)} disagree")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope: head_dim of q and k must be contiguous")
    half = head_dim // 2
    if cos.shape != sin.shape or cos.shape[1] != half or cos.stride() != sin.stride():
        raise ValueError(f"rope: cos/sin must both be [max_positions, {half}]")
    if cos.dtype != torch.float32 or cos.stride(-1) != 1:
        raise ValueError("rope: cos/sin must be fp32 with a contiguous last dimension")
    if num_tokens == 0:
        return
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_heads, k.shape[1], cos.stride(0),
        BLOCK_Q_HEADS=next_power_of_2(num_heads), BLOCK_K_HEADS=next_power_of_2(k.shape[1]),
        HALF=half, BLOCK_HALF=next_power_of_2(half))


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k in place: Triton on CUDA, the torch reference elsewhere."""
    if use_triton(q, k, positions, cos, sin):
        apply_rope_triton_(q, k, positions, cos, sin)
    else:
        apply_rope_reference_(q, k, positions, cos, sin)
