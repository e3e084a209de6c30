"""Small-batch linear layers: y = x @ w.T (+ b) for a few rows of x, at the memory's speed.

At decode batch 1..GEMV_MAX_ROWS a linear layer is a matrix-vector product: it reads the
whole weight once and does almost no arithmetic, so its time is the weight's bytes over
the memory bandwidth. cuBLAS picks split-K GEMM tiles for these shapes and reaches the
bandwidth only on the largest matrices (docs/benchmarks.md: 97% on the gate-up projection,
62-75% on the attention's q/k/v and output projections, plus a reduction kernel each).

Here each program owns BLOCK_N output columns and streams their rows of `w` once over the
whole K (no split-K, so no second kernel and no atomics): the weight is read exactly once
in total, x (a few KiB) is re-read from L2. The rows of x are padded to ROWS = 16 inside
the kernel (masked loads), the smallest tile `tl.dot` takes; the padding costs arithmetic
only, which is free at this size.

Numerics: products accumulate in fp32 (IEEE fp32 for fp32 inputs, no TF32), one rounding
to the output dtype at the end, as cuBLAS does; the summation order differs, so results
match F.linear to rounding, not bitwise.

`num_rows` is not specialized on: one compiled kernel per weight shape serves every batch
of 1..ROWS rows (a CUDA worker compiles them while it warms up, before it registers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.backend import import_triton, require_triton

triton, tl, _ = import_triton()

ROWS = 16  # rows of x one launch handles (the dot's smallest M)
# The largest batch sent here rather than to cuBLAS (0: never). Measured on an H200
# (docs/benchmarks.md, "Small-batch linear layers").
GEMV_MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DEFAULT_TILE = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4)


def gemv_config(n: int, k: int) -> GemvConfig | None:
    """The tile for a weight of [n, k], or None where cuBLAS is as fast or faster: a pure
    function of the shape, from a sweep of tiles on an H200 (benchmarks/gemv.py --sweep;
    docs/benchmarks.md, "Small-batch linear layers").

    Measured there: the vocabulary head gains 3-4% at every size; the attention's q/k/v and
    output projections and the down-projection of a 4096-wide model 4-15%; the fused
    gate-up projection loses 5% (cuBLAS already streams it at 95-97% of the copy rate), and
    so do the smaller matrices of a 2048-wide model."""
    if n >= 32768:  # the vocabulary head: many columns, short K steps
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    if min(n, k) < 4096 or n >= 2 * k:
        return None
    if k >= 2 * n or n == k:  # down-projection, attention output: long K steps
        return GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)
    return DEFAULT_TILE  # fused q/k/v


@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, num_rows, N, K,
                 x_row_stride, w_row_stride, y_row_stride,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    col_mask = cols < N
    row_mask = rows < num_rows
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_row_stride
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * y_row_stride + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None,
                config: GemvConfig | None = None) -> torch.Tensor:
    """x [rows <= ROWS, k] @ weight[n, k].T (+ bias[n]) -> [rows, n] in x's dtype; `out`
    (that shape, unit last stride) is written when given."""
    require_triton()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                         "multiply")
    if x.shape[0] > ROWS:
        raise ValueError(f"gemv: {x.shape[0]} rows, at most {ROWS}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv: x and weight need a contiguous last dimension")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError("gemv: x, weight (and bias) must share a dtype and bias be [n]")
    num_rows, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (num_rows, n) or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be [{num_rows}, {n}] with unit last stride")
    if num_rows == 0:
        return out
    cfg = config or gemv_config(n, k) or DEFAULT_TILE
    grid = (triton.cdiv(n, cfg.block_n),)
    _gemv_kernel[grid](x, weight, bias if bias is not None else weight, out, num_rows, n, k,
                       x.stride(0), weight.stride(0), out.stride(0),
                       HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, ROWS=ROWS,
                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `gemv_triton` for a CUDA batch of 1..GEMV_MAX_ROWS rows where the
    weight's shape has a tile (`gemv_config`)."""
    if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS \
            and x.stride(1) == 1 and weight.stride(1) == 1 and import_triton()[2]:
        config = gemv_config(*weight.shape)
        if config is not None:
            return gemv_triton(x, weight, bias, config=config)
    return F.linear(x, weight, bias)
