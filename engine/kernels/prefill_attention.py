"""Chunked-prefill attention: a chunk of new tokens per sequence attends, causally, to the
sequence's cached prefix and to the chunk itself, all read from the paged KV cache.

Packed layout (the chunks of all sequences back to back, as `ScheduleOutput` lists them):

    q rows      [ seq 0 chunk ][ seq 1 chunk ] ...        cu_seqlens_q = [0, n0, n0+n1, ...]
    seq i:  positions [0, start_i) cached earlier, [start_i, context_lens[i]) this chunk,
            start_i = context_lens[i] - (cu_seqlens_q[i+1] - cu_seqlens_q[i])
    the query at position p attends keys at positions [0, p]; with a sliding `window`,
    keys at positions (p - window, p] only

`softcap`, when given, squashes every score s = scale * q.k to softcap * tanh(s / softcap)
before the mask and the softmax (Gemma 2). Both options are compile-time switches of the
kernel (HAS_SOFTCAP, HAS_WINDOW): a model without them runs the kernel it always ran.

The chunk's own K/V must be in the cache first: call `write_kv_cache_` (kv_cache_write.py)
with the chunk's slot mapping, then this. Reading the chunk back from the cache keeps one
code path for prefix and chunk, and costs little next to the matmuls.

    grid = (ceil(max_query_len / BLOCK_M), num_seqs, num_heads)
    a program takes BLOCK_M queries of one head and walks keys up to its last query's
    position (from its first query's window start, with a window); programs past the end
    of a short chunk exit at once.

An FP8 cache is read as in the decode kernel: values times their token's scale, in
registers (engine/kernels/paged_decode_attention.py).
"""

from __future__ import annotations

import torch

from engine.kernels.backend import import_triton, next_power_of_2, require_triton, use_triton
from engine.kernels.paged_decode_attention import gather_context, soft_cap_log2
from engine.kv_quant import CacheView, cache_parts, scale_args

triton, tl, _ = import_triton()

_LOG2E = 1.4426950408889634


def prefill_attention_reference(q: torch.Tensor, k_cache: CacheView, v_cache: CacheView,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                softcap: float | None = None,
                                window: int | None = None) -> torch.Tensor:
    """The torch path, in fp32, one sequence at a time. q [num_tokens, num_heads, head_dim];
    caches [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs,
    max_blocks]; cu_seqlens_q [num_seqs + 1]; context_lens [num_seqs]. Returns
    [num_tokens, num_heads, head_dim] in q's dtype."""
    out = torch.empty_like(q)
    keys_all = gather_context(k_cache, block_tables)
    group = q.shape[1] // keys_all.shape[2]
    values_all = gather_context(v_cache, block_tables)
    bounds = cu_seqlens_q.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        q_lo, q_hi = bounds[i], bounds[i + 1]
        if q_hi == q_lo:
            continue
        start = context_len - (q_hi - q_lo)
        keys = keys_all[i, :context_len].to(torch.float32).repeat_interleave(group, dim=1)
        values = values_all[i, :context_len].to(torch.float32).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].to(torch.float32), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(start, context_len, device=q.device)[:, None]
        k_pos = torch.arange(context_len, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


# table_stride (the step's widest block table) changes from step to step: specialized
# on being 1 or a multiple of 16 it would compile a variant per class mid-traffic.
@triton.jit(do_not_specialize=["table_stride", "window"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                    block_tables_ptr, cu_seqlens_q_ptr,
                    context_lens_ptr, out_ptr, scale_log2, softcap_log2, window,
                    q_token_stride, q_head_stride,
                    cache_block_stride, cache_slot_stride, cache_head_stride,
                    scale_block_stride, scale_slot_stride,
                    table_stride, out_token_stride, out_head_stride,
                    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    QUANT: tl.constexpr):
    m_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_lo = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_lo
    if m_block * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    start_pos = context_len - q_len
    kv_head = head // QUERIES_PER_KV

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    d_mask = d < HEAD_DIM
    q_tokens = (q_lo + rows).to(tl.int64)
    q = tl.load(q_ptr + q_tokens[:, None] * q_token_stride + head * q_head_stride + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = start_pos + rows

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: no query of this tile sees past its last row's position.
    hi = tl.minimum(start_pos + (m_block + 1) * BLOCK_M, context_len)
    lo = 0
    if HAS_WINDOW:
        # No query of this tile sees before its first row's window (tile-aligned).
        lo = tl.maximum(start_pos + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block_ids = tl.load(block_tables_ptr + seq * table_stride + n // PAGE_SIZE,
                            mask=n_mask, other=0).to(tl.int64)
        kv_offsets = (block_ids * cache_block_stride + (n % PAGE_SIZE) * cache_slot_stride
                      + kv_head * cache_head_stride)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:  # FP8 values times their token's scale, in the query's dtype
            scale_at = (block_ids * scale_block_stride + (n % PAGE_SIZE) * scale_slot_stride
                        + kv_head)
            k_scales = tl.load(k_scale_ptr + scale_at, mask=n_mask, other=0.0)
            k = (k.to(tl.float32) * k_scales[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # log2 domain
        if HAS_SOFTCAP:
            s = soft_cap_log2(s, softcap_log2)
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # Without a window key 0 is visible to every row, so after the first tile m is
        # finite for all rows and a later fully masked tile only contributes exp2(-inf) = 0.
        # With one, a row may see nothing in its first tiles: m stays -inf there, and the
        # shift m_safe keeps exp2 away from (-inf) - (-inf).
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = m_new
        if HAS_WINDOW:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            v_scales = tl.load(v_scale_ptr + scale_at, mask=n_mask, other=0.0)
            v = (v.to(tl.float32) * v_scales[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    if HAS_WINDOW:
        # Rows past the chunk's end (never stored) may see no key of a window at all.
        l = tl.where(l == 0.0, 1.0, l)
    out = acc / l[:, None]
    tl.store(out_ptr + q_tokens[:, None] * out_token_stride + head * out_head_stride + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_tiles(max_query_len: int, on_cuda: bool) -> tuple[int, int, int]:
    """Pure policy: (BLOCK_M, BLOCK_N, num_warps). Long chunks get 128-row tiles over 8 warps
    (the flash-attention forward shape for head_dim 128); short ones 64 rows, so a chunk of a
    few tokens wastes less of the tile. The interpreter runs one numpy op per tile, so there
    small tiles waste the least on masked rows and columns."""
    if not on_cuda:
        return 16, 16, 1
    if max_query_len > 64:
        return 128, 64, 8
    return 64, 64, 4


def prefill_attention_triton(q: torch.Tensor, k_cache: CacheView, v_cache: CacheView,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             context_lens: torch.Tensor, scale: float, max_query_len: int,
                             out: torch.Tensor | None = None, softcap: float | None = None,
                             window: int | None = None) -> torch.Tensor:
    """The Triton op; shapes as the reference. `max_query_len` (longest chunk, a host int
    the scheduler knows) sizes the grid without a device sync."""
    require_triton()
    k_scales, v_scales, scale_block, scale_slot, quant = scale_args(k_cache, v_cache)
    k_cache, v_cache = cache_parts(k_cache)[0], cache_parts(v_cache)[0]
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"prefill attention: q {tuple(q.shape)} does not fit cache "
                         f"{tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("prefill attention: k_cache and v_cache must share shape and layout")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("prefill attention: q, caches and block_tables need a unit last stride")
    if cu_seqlens_q.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("prefill attention: cu_seqlens_q/block_tables do not match context_lens")
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    block_m, block_n, num_warps = prefill_tiles(max_query_len, q.is_cuda)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scales, v_scales, block_tables, cu_seqlens_q, context_lens, out,
        scale * _LOG2E, (softcap or 1.0) * _LOG2E, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale_block, scale_slot, block_tables.stride(0), out.stride(0), out.stride(1),
        QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim), PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None, QUANT=quant, num_warps=num_warps)
    return out


def prefill_attention(q: torch.Tensor, k_cache: CacheView, v_cache: CacheView,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float,
                      max_query_len: int) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere (which ignores `max_query_len`)."""
    if use_triton(q, cache_parts(k_cache)[0], cache_parts(v_cache)[0], block_tables,
                  cu_seqlens_q, context_lens):
        return prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                        context_lens, scale, max_query_len)
    return prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                       context_lens, scale)
