"""The torch reference attention: write a step's K/V into the paged cache, then attend.

Every faster kernel is tested against `paged_attention`, and it is the path the model runs
where the Triton kernels are not chosen (the CPU, tensor-parallel ranks). It reads the
torch path's groups of `AttentionMetadata` (engine/attention_metadata.py): a padded SDPA
per `AttentionGroup`, a causal SDPA over its own K/V per `CausalChunk`. A query at
position p attends to the cached keys at positions 0..p of its own sequence, so a chunk
whose first `start_pos` positions were written by an earlier step (an earlier chunk of a
chunked prefill, or a shared prefix) sees them exactly as if it had computed them itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata, CausalChunk


def _attend_causal(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   chunk: CausalChunk, cache_dtype: torch.dtype, scale: float,
                   out: torch.Tensor) -> None:
    """A chunk from position 0: its own K/V (rounded as the cache stores them), causal."""
    a, b = chunk.row_start, chunk.row_end
    qg = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    kg = k_new[a:b].to(cache_dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
    vg = v_new[a:b].to(cache_dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
    og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale,
                                        enable_gqa=qg.shape[1] != kg.shape[1])
    out[a:b] = og[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    kv_layer_k: torch.Tensor, kv_layer_v: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Writes the step's K/V into the paged cache, then attends through the block tables.

    Shapes: q [T, num_heads, head_dim]; k_new, v_new [T, num_kv_heads, head_dim];
    kv_layer_k, kv_layer_v [num_blocks, block_size, num_kv_heads, head_dim] (one layer of
    `KVStorage`, written in place at `meta.slot_mapping` only). Returns [T, num_heads,
    head_dim]. num_heads must be a multiple of num_kv_heads (grouped-query attention).
    This is the reference every faster kernel is tested against.
    """
    num_kv_heads, head_dim = kv_layer_k.shape[2], kv_layer_k.shape[3]
    cache_k = kv_layer_k.view(-1, num_kv_heads, head_dim)
    cache_v = kv_layer_v.view(-1, num_kv_heads, head_dim)
    # index_copy_/index_select over flat slot ids: far less per-call overhead on CPU than
    # advanced-index assignment, which matters with 16+ sequences per decode step.
    cache_k.index_copy_(0, meta.slot_mapping, k_new.to(cache_k.dtype))
    cache_v.index_copy_(0, meta.slot_mapping, v_new.to(cache_v.dtype))
    out = torch.empty_like(q)
    for group in meta.groups:
        if isinstance(group, CausalChunk):
            _attend_causal(q, k_new, v_new, group, cache_k.dtype, scale, out)
            continue
        num_chunks, num_keys = group.key_slots.shape
        keys = group.key_slots.reshape(-1)
        # [C, Q, H, D] -> [C, H, Q, D]; keys [C, L, KVH, D] -> [C, KVH, L, D]
        qg = q.index_select(0, group.query_rows.reshape(-1))
        qg = qg.view(num_chunks, -1, *q.shape[1:]).transpose(1, 2)
        kg = cache_k.index_select(0, keys).view(num_chunks, num_keys, num_kv_heads, head_dim)
        vg = cache_v.index_select(0, keys).view(num_chunks, num_keys, num_kv_heads, head_dim)
        kg, vg = kg.to(q.dtype).transpose(1, 2), vg.to(q.dtype).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=group.mask, scale=scale,
                                            enable_gqa=qg.shape[1] != kg.shape[1])
        out.index_copy_(0, group.out_rows, og.transpose(1, 2)[group.query_valid])
    return out
