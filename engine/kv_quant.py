"""An FP8 KV cache: one layer's K (or V) as float8 values and their scales, side by side.

Each token's vector of each KV head is stored as `head_dim` float8_e4m3 values and one
float32 scale, computed when the token is written (absmax / 448, the format's largest
finite value):

    scale = max(|x|) / FP8_MAX      values = round_to_fp8(x / scale)      x ≈ values * scale

Why per token and head, at write time, rather than per layer calibrated once: nothing to
calibrate (no sample traffic, no file of scales to ship with a model), no value ever clips
(a per-layer scale fitted on sample prompts clips an outlier token it did not see), and a
prefill worker and a decode worker can never disagree on a scale, because every scale
travels inside its block. The cost is 4 bytes per head per token: a block of head_dim 64
takes 68 bytes per head-token against bf16's 128 (1.88x the blocks in the same memory),
head_dim 128 takes 132 against 256 (1.94x).

Where the scales live: inside the block. One block of one layer's K (or V) is one
contiguous run of bytes, as for every other KV dtype (engine/kv_storage.py), so a KV
transfer, a block copy and the host tier move the scales with the values without knowing
about them:

    block bytes  [ values: block_size x num_kv_heads x head_dim float8 ]
                 [ scales: block_size x num_kv_heads float32 ]

A scale is never 0: an all-zero vector gets scale 1 (its values are 0 either way).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BYTES = 4  # float32


class QuantizedCache(NamedTuple):
    """One layer's K (or V) of an FP8 pool: views into the pool's bytes."""

    values: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] float8_e4m3fn
    scales: torch.Tensor  # [num_blocks, block_size, num_kv_heads] float32


# What a model passes to attention for one layer's K or V: a plain tensor in the model's
# (or a wider) dtype, or FP8 values with their scales.
CacheView = torch.Tensor | QuantizedCache


def check_device(device: torch.device | str) -> None:
    """Refuse, clearly, an FP8 pool on a GPU whose Triton has no e4m3 (compute capability
    below 8.9: before Ada and Hopper)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"an FP8 KV cache (fp8_e4m3) needs a GPU of compute capability 8.9 "
                         f"or later (Ada, Hopper); {name} is {capability[0]}.{capability[1]}: "
                         f"use --kv-cache-dtype auto or bf16")


def cache_parts(cache: CacheView) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scales) of one layer's K or V; scales None for a plain cache."""
    if isinstance(cache, QuantizedCache):
        return cache.values, cache.scales
    return cache, None


def scale_args(k_cache: CacheView, v_cache: CacheView) -> tuple[torch.Tensor, torch.Tensor,
                                                                  int, int, bool]:
    """(k scales, v scales, block stride, slot stride, quantized) for a kernel launch: an
    FP8 layer's scales, or for a plain cache its values again (never read) and 0, 0."""
    k_values, k_scales = cache_parts(k_cache)
    v_values, v_scales = cache_parts(v_cache)
    if k_scales is None or v_scales is None:
        if k_scales is not None or v_scales is not None:
            raise ValueError("one of K and V is FP8 and the other is not")
        return k_values, v_values, 0, 0, False
    if k_scales.stride() != v_scales.stride() or k_scales.stride(-1) != 1:
        raise ValueError("K and V scales must share one layout with unit head stride")
    return k_scales, v_scales, k_scales.stride(0), k_scales.stride(1), True


def fp8_block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer's K (or V) in an FP8 pool: values, then scales."""
    return block_size * num_kv_heads * (head_dim + SCALE_BYTES)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (float8 values [..., head_dim], float32 scales [...])."""
    amax = x.detach().abs().amax(dim=-1).float()
    # Divided by a tensor, not the number: PyTorch on CUDA divides by a Python number as a
    # multiply by its rounded reciprocal, one ulp off the correctly rounded quotient the
    # CPU and the Triton kernels (engine/kernels/fp8_rows.py) compute.
    scales = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    values = (x.float() / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., head_dim], scales [...]) -> [..., head_dim] in `dtype`, computed in
    float32."""
    return (values.float() * scales[..., None]).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as an FP8 pool stores and gives it back, in x's dtype."""
    values, scales = quantize(x)
    return dequantize(values, scales, x.dtype)


def fp8_views(pool: torch.Tensor, block_size: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of a uint8 pool [num_layers, 2, num_blocks, block_bytes]:
    values [L, 2, B, block_size, H, D] float8 and scales [L, 2, B, block_size, H] float32,
    both views of `pool`'s memory."""
    num_layers, two, num_blocks, block_bytes = pool.shape
    value_bytes = block_size * num_kv_heads * head_dim
    if pool.dtype != torch.uint8 or block_bytes != fp8_block_bytes(block_size, num_kv_heads,
                                                                   head_dim):
        raise ValueError(f"not an FP8 pool of blocks [{block_size}, {num_kv_heads}, "
                         f"{head_dim}]: {pool.dtype} {tuple(pool.shape)}")
    if value_bytes % SCALE_BYTES:
        raise ValueError(f"an FP8 block's values ({value_bytes} bytes) must end on a "
                         f"{SCALE_BYTES}-byte boundary for its scales")
    values = pool[..., :value_bytes].view(FP8_DTYPE).unflatten(
        -1, (block_size, num_kv_heads, head_dim))
    scales = pool[..., value_bytes:].view(torch.float32).unflatten(
        -1, (block_size, num_kv_heads))
    return values, scales
