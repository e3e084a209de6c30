"""RMSNorm, alone or fused with the residual add that precedes it in every Llama block.

    add_rms_norm_(x, residual, weight, eps)   in place:
        residual <- x + residual                  (rounded to the model dtype, as torch does)
        x        <- weight * rmsnorm(residual)    (variance in fp32, HF Llama's roundings)

Both paths (Triton and torch) overwrite the same buffers, so a caller that swaps one for
the other sees the same side effects; in place also means no allocation per layer, which a
captured CUDA graph needs. Rows may be strided; the hidden dimension must be contiguous.
"""

from __future__ import annotations

import torch

from engine.kernels.backend import import_triton, next_power_of_2, require_triton, use_triton

triton, tl, _ = import_triton()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, round to the model dtype, then scale."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm_reference_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of `add_rms_norm_`: same in-place contract, returns (x, residual)."""
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))
    return x, residual


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, hidden_size,
                     x_row_stride, residual_row_stride, out_row_stride, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + row * residual_row_stride + cols
        summed = (x.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32))
        # Round the sum to the model dtype before normalising, as the unfused code does.
        summed = summed.to(x_ptr.dtype.element_ty)
        tl.store(res_ptrs, summed, mask=mask)
        h = summed.to(tl.float32)
    else:
        h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden_size
    normed = (h * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols,
             (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    if rows.stride(-1) != 1:
        raise ValueError(f"rms_norm: {name} must have a contiguous last dimension")
    return rows


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, out: torch.Tensor) -> None:
    require_triton()
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous [{hidden_size}]")
    x2, out2 = _as_rows(x, "x"), _as_rows(out, "out")
    res2 = _as_rows(residual, "residual") if residual is not None else x2
    if residual is not None and res2.data_ptr() != residual.data_ptr():
        raise ValueError("rms_norm: residual must be viewable as rows without a copy")
    if out2.data_ptr() != out.data_ptr():
        raise ValueError("rms_norm: out must be viewable as rows without a copy")
    if x2.shape[0] == 0:
        return
    block = next_power_of_2(hidden_size)
    # One row per program: about 16 elements a thread keeps a 4096-wide row in registers.
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out2, hidden_size,
        x2.stride(0), res2.stride(0), out2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=max(1, min(16, block // 512)))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton op for a plain RMSNorm; writes `out` when given."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out)
    return out


def add_rms_norm_triton_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton op for the fused add + RMSNorm, in place; returns (x, residual)."""
    if x.shape != residual.shape:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} and residual "
                         f"{tuple(residual.shape)} differ")
    # Each program reads its row of x before writing it, so out may alias x.
    _launch(x, residual, weight, eps, x)
    return x, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x): Triton on CUDA, the torch reference elsewhere."""
    if use_triton(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- weight * rmsnorm(residual); (x, residual)."""
    if use_triton(x, residual, weight):
        return add_rms_norm_triton_(x, residual, weight, eps)
    return add_rms_norm_reference_(x, residual, weight, eps)
