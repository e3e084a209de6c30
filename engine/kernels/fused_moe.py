"""The fused mixture-of-experts feed-forward: every expert's rows in one launch per projection.

A step's T tokens each pick `top_k` experts: N = T * top_k (token, expert) assignments,
assignment i = (token i // top_k, its (i % top_k)-th expert). They are grouped by expert on
the device, each expert's run padded to a multiple of M rows (`tile_rows`: 16 for the few
rows per expert of a decode step, up to 64 for a prefill's many), so every tile of M rows
belongs to one expert:

    sorted_ids     [P]   assignment ids in expert order; N marks a padding row
    block_experts  [P / M]   the expert of each tile; -1: a tile past the last expert
                             (P is the most padding N can need: shapes depend on T only,
                             so a CUDA graph can hold the whole block)

    gate_up[i] = x[i // top_k] @ w13[e].T       one grouped GEMM over all experts  [N, 2I]
    hidden[i]  = silu(gate_up[i, :I]) * gate_up[i, I:]                              [N, I]
    out[i]     = w[i] * (hidden[i] @ w2[e].T)   one grouped GEMM, the routing weight
                                                applied in its epilogue             [N, H]
    y[t]       = sum_j out[t * top_k + j]

Numerics follow the torch path (engine/models/moe.py): each projection's output is rounded
to the model dtype, the expert's output is rounded before its routing weight (float32, or
already rounded to the model dtype: `round_weights`) scales it in float32, and the
product is rounded again. The top_k terms of a token are summed by one reduction (the
torch path adds them one by one into the model dtype), so bf16 results may differ by one
rounding step.

No host sync: the counts stay on the device (`expert_tokens` adds them up), so a step
with this block can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine.kernels.backend import import_triton, require_triton

triton, tl, _ = import_triton()

def tile_rows(num_assignments: int, num_experts: int) -> int:
    """M, the rows of a tile: about the rows an expert gets on average (16, tl.dot's
    smallest, to 64), so a tile is mostly real rows and a prefill reads each expert's weights
    a few times rather than once per 16 rows. A function of the step's shape only."""
    average = num_assignments / max(1, num_experts)
    return 16 if average <= 16 else 32 if average <= 32 else 64


def padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """P: the rows of `sorted_ids` for N assignments, enough for any routing (each expert's
    run padded up to a whole tile of `block_m` rows), itself a whole number of tiles."""
    most = num_assignments + num_experts * (block_m - 1)
    return -(-most // block_m) * block_m


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [P], block_experts int32 [P / block_m], counts int64 [E]) for the
    routing `expert_ids` [T, top_k]: see the module doc. Stable: an expert's rows keep
    assignment order. Device ops of static shapes only (no host sync)."""
    flat = expert_ids.reshape(-1)
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first_sorted = torch.cumsum(counts, 0) - counts  # each expert's first place in sort order
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    rank = torch.arange(n, device=device) - first_sorted[experts_in_order]
    dest = (ends - padded)[experts_in_order] + rank
    rows = padded_rows(n, num_experts, block_m)
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, rows, block_m, device=device)
    block_experts = torch.searchsorted(ends, tile_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts,
                                torch.full_like(block_experts, -1)).to(torch.int32)
    return sorted_ids, block_experts, counts


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr,
                         weights_ptr, num_assignments, n_cols, k_dim, a_row_div,
                         a_row_stride, w_expert_stride, w_row_stride, out_row_stride,
                         APPLY_WEIGHT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[i, n] = a[i // a_row_div] . w[e, n] for the tile's rows i (expert e); times
    weights[i] (after rounding the dot to out's dtype) when APPLY_WEIGHT."""
    tile = tl.program_id(0)
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_assignments
    a_rows = (ids // a_row_div).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w_base = w_ptr + expert * w_expert_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_dim
        a = tl.load(a_ptr + a_rows[:, None] * a_row_stride + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * w_row_stride + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:  # float32 weights: float32 products (tl.dot takes TF32 otherwise)
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    out = acc.to(out_ptr.dtype.element_ty)
    if APPLY_WEIGHT:
        weight = tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * weight[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ids[:, None].to(tl.int64) * out_row_stride + cols[None, :], out,
             mask=valid[:, None] & col_ok[None, :])


def _tiles(n_cols: int, k_dim: int) -> tuple[int, int]:
    block_n = 64 if n_cols >= 64 else 32 if n_cols >= 32 else 16
    block_k = 64 if k_dim >= 64 else 32 if k_dim >= 32 else 16
    return block_n, block_k


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor,
                 block_experts: torch.Tensor, num_assignments: int, a_row_div: int,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """[N, n] in a's dtype: row i = a[i // a_row_div] @ w[expert of i].T (times weights[i]
    when given), for w [E, n, k] and a [rows, k], both with unit last stride."""
    require_triton()
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("grouped_gemm: the last dimension of a and w must be contiguous")
    num_experts, n_cols, k_dim = w.shape
    if a.shape[-1] != k_dim:
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)} against w {tuple(w.shape)}")
    out = torch.empty(num_assignments, n_cols, dtype=a.dtype, device=a.device)
    if num_assignments == 0:
        return out
    block_m = sorted_ids.numel() // block_experts.numel()
    block_n, block_k = _tiles(n_cols, k_dim)
    grid = (block_experts.numel(), triton.cdiv(n_cols, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, block_experts, sorted_ids if weights is None else weights,
        num_assignments, n_cols, k_dim, a_row_div, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), APPLY_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)
    return out
