"""Write the K/V of this step's tokens into the paged cache at a slot mapping.

    slot_mapping[t] = block_id * block_size + slot      (the flat slot of token t)
    k_cache[block_id, slot] <- k[t]; v_cache[block_id, slot] <- v[t]

Prefill chunks and decode steps both call it before attention, so the attention kernels read
every key, the prefix and this step's own, from one place. A negative slot marks a padding
token of a fixed-size (CUDA-graph) batch: it is skipped, so padding never touches a block
that belongs to a live sequence. The caches are one layer's views of `KVStorage`
([num_blocks, block_size, num_kv_heads, head_dim]; any block/slot strides, unit head_dim),
or an FP8 pool's values and scales (`QuantizedCache`): each token's vector of each head is
then stored as `quantize` (engine/kv_quant.py) stores it, bit for bit, scale included.
"""

from __future__ import annotations

import torch

from engine.kernels.backend import import_triton, next_power_of_2, require_triton, use_triton
from engine.kernels.fp8_rows import store_fp8_rows
from engine.kv_quant import FP8_MAX, CacheView, cache_parts, quantize, scale_args

triton, tl, _ = import_triton()


def write_kv_cache_reference_(k: torch.Tensor, v: torch.Tensor, k_cache: CacheView,
                              v_cache: CacheView, slot_mapping: torch.Tensor) -> None:
    """The torch path. k, v [num_tokens, num_kv_heads, head_dim]; slot_mapping [num_tokens]."""
    slots = slot_mapping.long()
    live = slots >= 0
    for x, cache in ((k, k_cache), (v, v_cache)):
        values, scales = cache_parts(cache)
        block_ids, offsets = slots[live] // values.shape[1], slots[live] % values.shape[1]
        if scales is None:
            values[block_ids, offsets] = x[live].to(values.dtype)
        else:
            values[block_ids, offsets], scales[block_ids, offsets] = quantize(x[live])


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                     slot_mapping_ptr,
                     k_token_stride, k_head_stride, v_token_stride, v_head_stride,
                     cache_block_stride, cache_slot_stride, cache_head_stride,
                     scale_block_stride, scale_slot_stride, num_kv_heads,
                     PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                     FP8_LIMIT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    cache_offsets = ((slot // PAGE_SIZE) * cache_block_stride
                     + (slot % PAGE_SIZE) * cache_slot_stride + heads * cache_head_stride + dims)
    k = tl.load(k_ptr + token * k_token_stride + heads * k_head_stride + dims, mask=mask,
                other=0.0)
    v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + dims, mask=mask,
                other=0.0)
    if QUANT:
        row = tl.arange(0, BLOCK_H)
        scale_offsets = ((slot // PAGE_SIZE) * scale_block_stride
                         + (slot % PAGE_SIZE) * scale_slot_stride + row)
        store_fp8_rows(k, k_cache_ptr, cache_offsets, mask, k_scale_ptr, scale_offsets,
                       row < num_kv_heads, FP8_LIMIT)
        store_fp8_rows(v, v_cache_ptr, cache_offsets, mask, v_scale_ptr, scale_offsets,
                       row < num_kv_heads, FP8_LIMIT)
    else:
        tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton_(k: torch.Tensor, v: torch.Tensor, k_cache: CacheView,
                           v_cache: CacheView, slot_mapping: torch.Tensor) -> None:
    """The Triton op; same contract as `write_kv_cache_reference_`."""
    require_triton()
    k_scales, v_scales, scale_block, scale_slot, quant = scale_args(k_cache, v_cache)
    k_cache, v_cache = cache_parts(k_cache)[0], cache_parts(v_cache)[0]
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"write_kv_cache: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)} disagree")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("write_kv_cache: k_cache and v_cache must have one shape and layout")
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"write_kv_cache: cache {tuple(k_cache.shape)} does not hold "
                         f"[.., .., {num_kv_heads}, {head_dim}]")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache: head_dim must be contiguous everywhere")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale_block, scale_slot,
        num_kv_heads, PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        QUANT=quant, FP8_LIMIT=FP8_MAX)


def write_kv_cache_(k: torch.Tensor, v: torch.Tensor, k_cache: CacheView,
                    v_cache: CacheView, slot_mapping: torch.Tensor) -> None:
    """Scatter k, v into the caches: Triton on CUDA, the torch reference elsewhere."""
    if use_triton(k, v, cache_parts(k_cache)[0], cache_parts(v_cache)[0], slot_mapping):
        write_kv_cache_triton_(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_reference_(k, v, k_cache, v_cache, slot_mapping)
