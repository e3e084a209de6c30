"""The torch reference attention: write a step's K/V into the paged cache, then attend.

Every faster kernel is tested against `paged_attention`, and it is the path the model runs
where the Triton kernels are not chosen (the CPU, tensor-parallel ranks). It reads the
torch path's groups of `AttentionMetadata` (engine/attention_metadata.py): a padded SDPA
per `AttentionGroup`, a causal SDPA over its own K/V per `CausalChunk`. A query at
position p attends to the cached keys at positions 0..p of its own sequence, so a chunk
whose first `start_pos` positions were written by an earlier step (an earlier chunk of a
chunked prefill, or a shared prefix) sees them exactly as if it had computed them itself.

Two options some families need (Gemma 2): a sliding `window` (a query at position p sees
the keys at positions (p - window, p] only) and a logit `softcap` (scores squashed by
cap * tanh(s / cap) before the mask and the softmax, which SDPA cannot do, so those
layers attend by explicit matmuls, with the softmax in float32 as transformers does).

An FP8 pool's layer (`QuantizedCache`, engine/kv_quant.py) is written quantized, with each
token's per-head scale, and read back dequantized to the query's dtype; a chunk's own K/V
are rounded the same way, so it sees what a later step reading the cache would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata, CausalChunk
from engine.kv_quant import CacheView, QuantizedCache, dequantize, quantize, round_trip


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None) -> torch.Tensor:
    """q [C, H, Q, D], k and v [C, KVH, L, D], mask [C, 1, Q, L] bool (True: may see; None:
    causal from key 0) -> [C, H, Q, D]."""
    if softcap is None and not _eager_is_faster(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return _attend_eager(q, k, v, mask, scale, softcap)


def _eager_is_faster(q: torch.Tensor) -> bool:
    """Decode rows (one query each) in bfloat16 on the CPU: there PyTorch's SDPA (its CPU
    flash kernel) took 4-13x the time of `_attend_eager`'s two matmuls (batch 1-64, 520-2,048
    keys, one thread; docs/performance.md, "The CPU's decode attention"); for prompts (many
    queries a row) it was as fast or faster, and in float32 the two were even."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[2] == 1


def _attend_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, softcap: float | None) -> torch.Tensor:
    """Attention by explicit matmuls, as transformers' eager attention computes it: scores
    in the inputs' dtype, soft-capped if asked, masked, a softmax in float32, its
    probabilities in the inputs' dtype times V. Grouped-query heads attend through a view
    of their KV head (query head h reads KV head h // (H / KVH)), not a repeated copy."""
    num_chunks, num_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    scores = torch.matmul(q.reshape(num_chunks, num_kv_heads, group * num_queries, head_dim),
                          k.transpose(-1, -2))
    scores = scores.view(num_chunks, num_kv_heads, group, num_queries, num_keys) * scale
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    if mask is None:  # causal, the last query seeing every key
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(
            num_keys - num_queries)
    else:
        mask = mask.unsqueeze(2)  # [C, 1, 1, Q, L]: the same for every head
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(num_chunks, num_kv_heads, group * num_queries, num_keys), v)
    return out.view(num_chunks, num_heads, num_queries, head_dim)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): x squashed smoothly into (-cap, cap)."""
    return torch.tanh(x / cap) * cap


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype | None, dtype: torch.dtype
               ) -> torch.Tensor:
    """x rounded as the cache stores it (None: an FP8 pool), in `dtype`."""
    if cache_dtype is None:
        return round_trip(x).to(dtype)
    return x.to(cache_dtype).to(dtype)


def _attend_causal(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   chunk: CausalChunk, cache_dtype: torch.dtype | None, scale: float,
                   softcap: float | None, window: int | None, out: torch.Tensor) -> None:
    """A chunk from position 0: its own K/V (rounded as the cache stores them), causal."""
    a, b = chunk.row_start, chunk.row_end
    qg = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    kg = _as_cached(k_new[a:b], cache_dtype, q.dtype).transpose(0, 1).unsqueeze(0)
    vg = _as_cached(v_new[a:b], cache_dtype, q.dtype).transpose(0, 1).unsqueeze(0)
    mask = None
    if window is not None and b - a > window:
        pos = torch.arange(b - a, device=q.device)
        offset = pos[:, None] - pos[None, :]  # query position - key position
        mask = ((offset >= 0) & (offset < window))[None, None]
    og = _attend(qg, kg, vg, mask, scale, softcap)
    out[a:b] = og[0].transpose(0, 1)


class _FlatCache:
    """One layer's K (or V) addressed by flat slot id: write a step's rows, gather keys."""

    def __init__(self, cache: CacheView) -> None:
        self.cache = cache
        self.block_size = cache[0].shape[1] if isinstance(cache, QuantizedCache) else \
            cache.shape[1]
        self.flat = None if isinstance(cache, QuantizedCache) else \
            cache.view(-1, cache.shape[2], cache.shape[3])

    @property
    def dtype(self) -> torch.dtype | None:  # None: FP8 values with scales
        return None if self.flat is None else self.flat.dtype

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        if self.flat is not None:
            # index_copy_ over flat slot ids: far less per-call overhead on CPU than
            # advanced-index assignment, which matters with 16+ sequences per decode step.
            self.flat.index_copy_(0, slots, x.to(self.flat.dtype))
            return
        values, scales = self.cache
        blocks, offsets = slots // self.block_size, slots % self.block_size
        values[blocks, offsets], scales[blocks, offsets] = quantize(x)

    def gather(self, key_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The keys (or values) at `key_slots` [C, L] as [C, KVH, L, D] in `dtype`. From a
        pool in the model's dtype each head's rows come contiguous, gathered row by (slot,
        head), so no transposing copy follows; an FP8 pool's are dequantized, then viewed."""
        num_chunks, num_keys = key_slots.shape
        if self.flat is not None:
            num_kv_heads, head_dim = self.flat.shape[1], self.flat.shape[2]
            heads = torch.arange(num_kv_heads, device=key_slots.device)
            index = (key_slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
            rows = self.flat.view(-1, head_dim).index_select(0, index)
            return rows.view(num_chunks, num_kv_heads, num_keys, head_dim).to(dtype)
        values, scales = self.cache
        slots = key_slots.reshape(-1)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        out = dequantize(values[blocks, offsets], scales[blocks, offsets], dtype)
        return out.view(num_chunks, num_keys, *out.shape[1:]).transpose(1, 2)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    kv_layer_k: CacheView, kv_layer_v: CacheView,
                    meta: AttentionMetadata, scale: float, softcap: float | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Writes the step's K/V into the paged cache, then attends through the block tables.

    Shapes: q [T, num_heads, head_dim]; k_new, v_new [T, num_kv_heads, head_dim];
    kv_layer_k, kv_layer_v [num_blocks, block_size, num_kv_heads, head_dim] (one layer of
    `KVStorage`, written in place at `meta.slot_mapping` only; or an FP8 layer's values and
    scales, `QuantizedCache`). Returns [T, num_heads,
    head_dim]. num_heads must be a multiple of num_kv_heads (grouped-query attention).
    `softcap` and `window`: see the module docstring (None: neither).
    This is the reference every faster kernel is tested against.
    """
    num_kv_heads, head_dim = k_new.shape[1], k_new.shape[2]
    cache_k, cache_v = _FlatCache(kv_layer_k), _FlatCache(kv_layer_v)
    cache_k.write(meta.slot_mapping, k_new)
    cache_v.write(meta.slot_mapping, v_new)
    out = torch.empty_like(q)
    for group in meta.groups:
        if isinstance(group, CausalChunk):
            _attend_causal(q, k_new, v_new, group, cache_k.dtype, scale, softcap, window, out)
            continue
        num_chunks, num_keys = group.key_slots.shape
        # [C, Q, H, D] -> [C, H, Q, D]; keys and values [C, KVH, L, D]
        qg = q.index_select(0, group.query_rows.reshape(-1))
        qg = qg.view(num_chunks, -1, *q.shape[1:]).transpose(1, 2)
        kg = cache_k.gather(group.key_slots, q.dtype)
        vg = cache_v.gather(group.key_slots, q.dtype)
        mask = group.mask
        if window is not None:
            # [C, 1, Q, L]: keys at positions (p - window, p] of the query at position p.
            key_pos = torch.arange(num_keys, device=q.device)
            mask = mask & (key_pos > group.query_pos[:, :, None] - window)[:, None]
        og = _attend(qg, kg, vg, mask, scale, softcap)
        out.index_copy_(0, group.out_rows, og.transpose(1, 2)[group.query_valid])
    return out
