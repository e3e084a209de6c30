"""The Triton attention path: which kernel attends which rows of a step.

Same contract as the torch reference (engine/attention_reference.py), over
`KernelAttentionMetadata` (engine/attention_metadata.py). A step whose chunks are all
single tokens runs the decode kernel (split-K over the context). A mixed step runs both
when its decode rows carry enough context (engine/mixed_split.py): the scheduler puts the
decodes first, so its leading single-token chunks go to the decode kernel and the rest to
the chunked-prefill kernel (which would give each decode row a whole tile of query rows and
no split over its context):

    token rows  [0, num_decode_chunks)        decode kernel   (one row per chunk)
                [num_decode_chunks, T)        prefill kernel  (`prefill_part`)

Otherwise every row goes to the chunked-prefill kernel. Nothing here allocates apart from
the output, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine.attention_metadata import KernelAttentionMetadata
from engine.kv_quant import CacheView


def paged_attention_kernels(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                            kv_layer_k: CacheView, kv_layer_v: CacheView,
                            meta: KernelAttentionMetadata, scale: float,
                            softcap: float | None = None,
                            window: int | None = None) -> torch.Tensor:
    """The Triton path of `paged_attention`: same shapes, options and side effects (K/V
    written at `meta.slot_mapping`, padding slots skipped), allocation-free apart from its
    output, so it can be captured in a CUDA graph. q, k_new and v_new may be strided views."""
    from engine.kernels.kv_cache_write import write_kv_cache_triton_

    write_kv_cache_triton_(k_new, v_new, kv_layer_k, kv_layer_v, meta.slot_mapping)
    return attend_cached_kernels(q, kv_layer_k, kv_layer_v, meta, scale, softcap, window)


def attend_cached_kernels(q: torch.Tensor, kv_layer_k: CacheView, kv_layer_v: CacheView,
                          meta: KernelAttentionMetadata, scale: float,
                          softcap: float | None = None,
                          window: int | None = None) -> torch.Tensor:
    """`paged_attention_kernels` for a step whose K/V the caller already wrote at
    `meta.slot_mapping` (the model fuses that write into its RoPE kernel)."""
    from engine.kernels.paged_decode_attention import paged_decode_attention_triton
    from engine.kernels.prefill_attention import prefill_attention_triton

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.is_decode:
        return paged_decode_attention_triton(q, kv_layer_k, kv_layer_v, meta.block_tables,
                                             meta.context_lens, scale,
                                             meta.num_decode_splits, out=out,
                                             softcap=softcap, window=window)
    n, rest = meta.num_decode_chunks, meta.prefill_part
    if rest is not None:  # a mixed step (see the module docstring)
        # Decode first: padded decode rows' zeros land on prefill rows, overwritten next.
        paged_decode_attention_triton(q[:n], kv_layer_k, kv_layer_v, meta.block_tables[:n],
                                      meta.context_lens[:n], scale, meta.num_decode_splits,
                                      out=out[:n], softcap=softcap, window=window)
        lo = 0 if meta.prefill_rows_absolute else n
        prefill_attention_triton(q[lo:], kv_layer_k, kv_layer_v, rest.block_tables,
                                 rest.cu_seqlens_q, rest.context_lens, scale,
                                 rest.max_query_len, out=out[lo:], softcap=softcap,
                                 window=window)
        return out
    return prefill_attention_triton(q, kv_layer_k, kv_layer_v, meta.block_tables,
                                    meta.cu_seqlens_q, meta.context_lens, scale,
                                    meta.max_query_len, out=out, softcap=softcap,
                                    window=window)
