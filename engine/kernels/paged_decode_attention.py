"""Decode attention over the paged KV cache: one new query token per sequence.

Each sequence's keys live in blocks named by its row of `block_tables`:

    position p  ->  block_tables[seq, p // block_size], slot p % block_size
    positions [0, context_lens[seq])  are attended; the current token's K/V is already in
    the cache (written by `write_kv_cache_` before this call); table entries past the
    context are never read.

Grouped-query heads: one program serves all `num_heads / num_kv_heads` query heads of a KV
head, so each K/V byte is read once per step. Split-K (flash-decoding): a sequence's
context is cut into `num_splits` ranges handled by separate programs, each leaving a
partial output and its log-sum-exp; a second kernel merges them. That keeps the GPU busy
when the batch is small and the context long:

    grid = (num_seqs, num_kv_heads, num_splits)
    split s of a context of n tokens covers [s * t, min((s + 1) * t, n)),
    t = ceil(ceil(n / num_splits) / BLOCK_N) * BLOCK_N        (empty splits weigh 0)

A sequence with context length 0 (a padding row of a fixed-size batch) gets zeros.

Gemma 2's options, compile-time switches of the kernel (a model without them runs the
kernel it always ran): a sliding `window` (the query, at position n - 1, sees positions
[max(0, n - window), n), and the splits cut that range instead of [0, n)), and a `softcap`
(scores s = scale * q.k become softcap * tanh(s / softcap) before the softmax).

An FP8 cache (`QuantizedCache`, engine/kv_quant.py): each key and value is read as its
FP8 values times its token's scale, in registers, in the query's dtype; nothing else
changes (QUANT, a compile-time switch).
"""

from __future__ import annotations

import math

import torch

from engine.kernels.backend import import_triton, next_power_of_2, require_triton, use_triton
from engine.kv_quant import CacheView, QuantizedCache, cache_parts, dequantize, scale_args

triton, tl, _ = import_triton()

_LOG2E = 1.4426950408889634
# A split shorter than this costs more in the merge than its parallelism gains.
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 32


def gather_context(cache: CacheView, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_seqs, max_blocks * block_size, num_kv_heads, head_dim]: every sequence's keys
    (or values) in position order (an FP8 cache's dequantized to float32); positions past a
    context hold whatever the table names."""
    num_seqs, max_blocks = block_tables.shape
    if isinstance(cache, QuantizedCache):
        safe_ids = block_tables.long().clamp(0, cache.values.shape[0] - 1)
        cache = dequantize(cache.values[safe_ids], cache.scales[safe_ids], torch.float32)
        return cache.reshape(num_seqs, -1, *cache.shape[3:])
    safe_ids = block_tables.long().clamp(0, cache.shape[0] - 1)
    gathered = cache[safe_ids]  # [num_seqs, max_blocks, block_size, kv_heads, head_dim]
    return gathered.reshape(num_seqs, max_blocks * cache.shape[1], *cache.shape[2:])


def paged_decode_attention_reference(q: torch.Tensor, k_cache: CacheView,
                                     v_cache: CacheView, block_tables: torch.Tensor,
                                     context_lens: torch.Tensor, scale: float,
                                     softcap: float | None = None,
                                     window: int | None = None) -> torch.Tensor:
    """The torch path, in fp32. q [num_seqs, num_heads, head_dim]; caches [num_blocks,
    block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int;
    context_lens [num_seqs] int. Returns [num_seqs, num_heads, head_dim] in q's dtype."""
    num_seqs, num_heads, _ = q.shape
    keys = gather_context(k_cache, block_tables).to(torch.float32)
    group = num_heads // keys.shape[2]
    values = gather_context(v_cache, block_tables).to(torch.float32)
    keys = keys.repeat_interleave(group, dim=2)  # [seqs, positions, heads, dim]
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("shd,sphd->shp", q.to(torch.float32), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(keys.shape[1], device=q.device)
    lens = context_lens.to(q.device).long()[:, None]
    live = positions[None, :] < lens  # [seqs, positions]
    if window is not None:
        live &= positions[None, :] >= lens - window
    scores = scores.masked_fill(~live[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty context -> zeros
    return torch.einsum("shp,sphd->shd", probs, values).to(q.dtype)


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int,
                      num_sms: int) -> int:
    """Pure policy: enough programs for about two waves over `num_sms`, but no split
    shorter than MIN_TOKENS_PER_SPLIT tokens of the longest possible context; a power of
    two (rounded down), so the kernel has few variants (`SPLIT_COUNTS`), all compiled at
    start-up (`compile_split_variants`) rather than one per new count mid-traffic."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = math.ceil(2 * num_sms / programs)
    longest = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, longest, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


SPLIT_COUNTS = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))  # 1, 2, 4, ... MAX


def compile_split_variants(q_like: torch.Tensor, k_cache: CacheView,
                           v_cache: CacheView, softcap: float | None = None,
                           windows: tuple[int | None, ...] = (None,)) -> None:
    """Run the kernel once per split count on a one-sequence decode over block 0 (its
    output discarded), so that no variant compiles while a worker serves. `q_like`:
    [any, num_heads, head_dim] in the model's dtype, on the cache's device; `softcap` and
    `windows`: the model's (one variant per distinct window, None for global layers)."""
    q = q_like[:1]
    tables = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    lens = torch.ones(1, dtype=torch.int32, device=q.device)
    for window in windows:
        for splits in SPLIT_COUNTS:
            paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 1.0, splits,
                                          softcap=softcap, window=window)


@triton.jit
def soft_cap_log2(s, cap_log2):
    """cap * tanh(x / cap) in the log2 domain (s = x * log2(e), cap_log2 = cap * log2(e)),
    with tanh(|y|) = (1 - e) / (1 + e), e = exp(-2|y|) in (0, 1]: no overflow anywhere."""
    y = s / cap_log2
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t) * cap_log2


# table_stride (the step's widest block table) changes from step to step: specialized
# on being 1 or a multiple of 16 it would compile a variant per class mid-traffic.
@triton.jit(do_not_specialize=["table_stride", "window"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                         block_tables_ptr, context_lens_ptr,
                         out_ptr, part_out_ptr, part_lse_ptr, scale_log2, softcap_log2, window,
                         q_seq_stride, q_head_stride,
                         cache_block_stride, cache_slot_stride, cache_head_stride,
                         scale_block_stride, scale_slot_stride,
                         table_stride, out_seq_stride, out_head_stride, num_heads,
                         QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)
    tokens_per_split = tl.cdiv(tl.cdiv(context_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERIES_PER_KV + g
    g_mask = g < QUERIES_PER_KV
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
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
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_G, BLOCK_N], log2 domain
        if HAS_SOFTCAP:
            s = soft_cap_log2(s, softcap_log2)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one live key, so m_new is finite and alpha well defined.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            v_scales = tl.load(v_scale_ptr + scale_at, mask=n_mask, other=0.0)
            v = (v.to(tl.float32) * v_scales[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # part_out [num_seqs, num_heads, NUM_SPLITS, BLOCK_D], part_lse [.., .., NUM_SPLITS]
        row = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=out_mask)
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, out_seq_stride, out_head_stride,
                         num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = splits < NUM_SPLITS
    row = (seq * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # All splits empty (context length 0): weights 0, output 0, never NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    parts = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :],
                    mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * out_seq_stride + head * out_head_stride + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: CacheView, v_cache: CacheView,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, num_splits: int = 1,
                                  out: torch.Tensor | None = None, softcap: float | None = None,
                                  window: int | None = None) -> torch.Tensor:
    """The Triton op; shapes as the reference. `num_splits` is a host int (see
    `num_decode_splits`) so a captured graph never syncs to choose it."""
    require_triton()
    k_scales, v_scales, scale_block, scale_slot, quant = scale_args(k_cache, v_cache)
    k_cache, v_cache = cache_parts(k_cache)[0], cache_parts(v_cache)[0]
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"decode attention: q {tuple(q.shape)} does not fit cache "
                         f"{tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("decode attention: k_cache and v_cache must share shape and layout")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("decode attention: q, caches and block_tables need a unit last stride")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError("decode attention: block_tables/context_lens do not match q")
    if num_splits < 1:
        raise ValueError(f"decode attention: num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    # tl.dot needs every tile dimension >= 16; padded query rows are masked out.
    block_g = max(16, next_power_of_2(group))
    block_n = 64 if q.is_cuda else 16
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out  # never touched when NUM_SPLITS == 1
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, out, part_out,
        part_lse, scale * _LOG2E, (softcap or 1.0) * _LOG2E, window or 0, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale_block,
        scale_slot, block_tables.stride(0), out.stride(0), out.stride(1), num_heads,
        QUERIES_PER_KV=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None, QUANT=quant)
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits))
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: CacheView, v_cache: CacheView,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Triton on CUDA (splits chosen from the table's capacity when not given), the torch
    reference elsewhere."""
    k_values = cache_parts(k_cache)[0]
    if not use_triton(q, k_values, cache_parts(v_cache)[0], block_tables, context_lens):
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables,
                                                context_lens, scale)
    if num_splits is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = num_decode_splits(q.shape[0], k_values.shape[2],
                                       block_tables.shape[1] * k_values.shape[1], num_sms)
    return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                         scale, num_splits)
