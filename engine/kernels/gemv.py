"""Small-batch linear layers: y = x @ w.T (+ b) for a few rows of x, at the memory's speed.

At decode batch 1..GEMV_MAX_ROWS a linear layer is a matrix-vector product: it reads the
whole weight once and does almost no arithmetic, so its time is the weight's bytes over
the memory bandwidth. cuBLAS picks split-K GEMM tiles for these shapes and reaches the
bandwidth only on the largest matrices (docs/benchmark_journal.md: 97% on the gate-up projection,
62-75% on the attention's q/k/v and output projections, plus a reduction kernel each).

Program (tile, split) owns BLOCK_N output columns and the split's share of K, and streams
those rows of `w` once: the weight is read exactly once in total, x (a few KiB) is re-read
from L2. The rows of x are padded to ROWS = 16 inside the kernel (masked loads), the
smallest tile `tl.dot` takes; the padding costs arithmetic only, which is free at this size.

Split-K (`split_k` > 1) gives a matrix of few column tiles (4096 columns: 128 tiles of 32,
one wave on an H200) several programs per tile, so more of the weight is in flight at once.
The splits meet in one launch, without a reduction kernel:

    program (t, s): partial sums -> workspace.partials[s, :, tile t]
                    barrier; arrivals[t] += 1 (acq_rel, one thread)
    the program that sees split_k - 1 arrivals before its own (the last of tile t):
                    y[:, tile t] = sum of partials[0..split_k-1] in that order (+ bias)
                    arrivals[t] = 0

The sum's order is fixed, so the result does not depend on which split ends last: the
same inputs give the same bits on every run.

Numerics: products accumulate in fp32 (IEEE fp32 for fp32 inputs, no TF32), one rounding
to the output dtype at the end, as cuBLAS does; the summation order differs, so results
match F.linear to rounding, not bitwise.

`num_rows` is not specialized on: one compiled kernel per weight shape and tile serves
every batch of 1..ROWS rows (a CUDA worker compiles them while it warms up, before it
registers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.backend import import_triton, require_triton

triton, tl, _ = import_triton()

ROWS = 16  # rows of x one launch handles (the dot's smallest M)
# The largest batch sent here rather than to cuBLAS (0: never). Measured on an H200
# (docs/benchmark_journal.md, "Small-batch linear layers").
GEMV_MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs per column tile, each over its share of K

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_k < 16 or self.split_k < 1:
            raise ValueError(f"gemv: bad tile {self}")


DEFAULT_TILE = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4)


def gemv_config(n: int, k: int) -> GemvConfig | None:
    """The tile for a weight of [n, k], or None where cuBLAS is as fast or faster: a pure
    function of the shape, from sweeps of tiles on an H200 (benchmarks/gemv.py --sweep;
    docs/benchmark_journal.md, "Small-batch linear layers").

    Measured there: the vocabulary head gains 3-6% at every size; a 4096-wide model's
    q/k/v 4-11%; the attention output and down projections, whose 2048-4096 columns make
    one wave of column tiles, take 4 splits over K (4096 x 4096: 13.6 -> 12.6 us; 4096 x
    14336 35.2 -> 32.3 us, 2048 x 8192 14.6 -> about 13 us under cuBLAS). The fused gate-up
    projection stays on cuBLAS (it streams at 94-95% of the copy rate), and so do the
    q/k/v and output projections of a 2048-wide model (within 3% of cuBLAS at best)."""
    if n >= 32768:  # the vocabulary head: many columns, short K steps
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    if min(n, k) < 2048 or n >= 2 * k:
        return None
    if k >= 2 * n or (n == k and n >= 4096):  # down-projection, attention output
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=4)
    if min(n, k) >= 4096:
        return DEFAULT_TILE  # fused q/k/v
    return None


class GemvWorkspace:
    """Scratch memory of split-K launches on one device.

        partials  float32 [capacity]   a launch uses [split_k, ROWS, n] of it
        arrivals  int32   [num_tiles]  a launch uses [cdiv(n, block_n)] of it

    Invariants: between launches every arrival counter is 0 (the last program of each
    tile resets its own); launches that share a workspace run one after another (one
    stream, or graphs replayed on one stream), since two at once would mix their counts.
    A workspace is made before any graph capture (it allocates) and lives as long as the
    graphs that captured it."""

    def __init__(self, device: torch.device | str, num_partials: int, num_tiles: int) -> None:
        self.partials = torch.empty(max(1, num_partials), dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(max(1, num_tiles), dtype=torch.int32, device=device)

    @classmethod
    def for_shapes(cls, shapes: Iterable[tuple[int, int]],
                   device: torch.device | str) -> GemvWorkspace | None:
        """Big enough for every weight of `shapes` ([n, k] each) that `gemv_config` splits;
        None when none is split."""
        num_partials = num_tiles = 0
        for n, k in shapes:
            config = gemv_config(n, k)
            if config is not None and config.split_k > 1:
                num_partials = max(num_partials, config.split_k * ROWS * n)
                num_tiles = max(num_tiles, triton.cdiv(n, config.block_n))
        return cls(device, num_partials, num_tiles) if num_tiles else None

    def fits(self, n: int, config: GemvConfig) -> bool:
        return (config.split_k * ROWS * n <= self.partials.numel()
                and triton.cdiv(n, config.block_n) <= self.arrivals.numel())

    def check_invariants(self) -> None:
        """Every counter back at 0 (syncs with the device: for tests)."""
        if int(self.arrivals.abs().sum()) != 0:
            raise AssertionError("gemv workspace: an arrival counter was left non-zero")


@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, partials_ptr, arrivals_ptr, num_rows, N, K,
                 x_row_stride, w_row_stride, y_row_stride,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    col_mask = cols < N
    row_mask = rows < num_rows
    out_mask = row_mask[:, None] & col_mask[None, :]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_row_stride
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    # This split's share of K, whole BLOCK_K steps (the last split may get less or none).
    k_share = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = split * k_share
    k_end = tl.minimum(k_begin + k_share, K)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    y = y_ptr + rows.to(tl.int64)[:, None] * y_row_stride + cols[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = partials_ptr + (rows[:, None] * N + cols[None, :])
        tl.store(part + split * ROWS * N, acc, mask=out_mask)
        # Every thread's partial is stored before the one release below (CUTLASS's
        # split-K semaphore does the same: a CTA barrier, then one release by one thread).
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits every run
                total += tl.load(part + s * ROWS * N, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(arrivals_ptr + tile, 0)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: GemvConfig | None = None,
                workspace: GemvWorkspace | None = None) -> torch.Tensor:
    """x [rows <= ROWS, k] @ weight[n, k].T (+ bias[n]) -> [rows, n] in x's dtype; `out`
    (that shape, unit last stride) is written when given. A split-K tile needs a
    `workspace` that fits it."""
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
    num_rows = x.shape[0]
    n, k = weight.shape
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (num_rows, n) or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be [{num_rows}, {n}] with unit last stride")
    cfg = config or gemv_config(n, k) or DEFAULT_TILE
    if cfg.split_k > 1 and (workspace is None or not workspace.fits(n, cfg)):
        raise ValueError(f"gemv: split_k={cfg.split_k} over {n} columns needs a workspace "
                         "that fits it (GemvWorkspace.for_shapes)")
    if num_rows == 0:
        return out
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    scratch = (workspace.partials, workspace.arrivals) if workspace is not None else (out, out)
    _gemv_kernel[grid](x, weight, bias if bias is not None else weight, out, *scratch,
                       num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
                       HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                       ROWS=ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       SPLIT_K=cfg.split_k, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           workspace: GemvWorkspace | None = None) -> torch.Tensor:
    """F.linear, through `gemv_triton` for a CUDA batch of 1..GEMV_MAX_ROWS rows where the
    weight's shape has a tile (`gemv_config`); `workspace` serves the split-K tiles."""
    if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS \
            and x.stride(1) == 1 and weight.stride(1) == 1 and import_triton()[2]:
        config = gemv_config(*weight.shape)
        if config is not None:
            return gemv_triton(x, weight, bias, config=config, workspace=workspace)
    return F.linear(x, weight, bias)
