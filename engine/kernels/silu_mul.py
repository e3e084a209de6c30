"""Fused SiLU-and-multiply, the activation of a Llama MLP: out = silu(gate) * up.

Numerics follow the unfused torch code (`F.silu(gate) * up` in the model dtype): SiLU is
computed in fp32 and rounded to the model dtype before the product, so a bf16 model sees the
same two roundings as the reference.

`gate` and `up` may be column slices of one fused [num_tokens, 2 * intermediate] projection:
only the last dimension needs unit stride.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.backend import import_triton, require_triton, use_triton

triton, tl, _ = import_triton()

_BLOCK_COLS = 1024


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The torch path: silu(gate) * up in the inputs' dtype."""
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, num_cols,
                     gate_row_stride, up_row_stride, out_row_stride,
                     BLOCK_COLS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = cols < num_cols
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # Round the activation to the model dtype first, as the unfused reference does.
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (act * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton op; `out` (same shape, unit last stride) is written when given."""
    require_triton()
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_mul: the last dimension of gate and up must be contiguous")
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    num_cols = gate.shape[-1]
    gate2, up2, out2 = (t.reshape(-1, num_cols) for t in (gate, up, out))
    if out2.data_ptr() != out.data_ptr() or out2.stride(-1) != 1:
        raise ValueError("silu_mul: out must be viewable as [rows, cols] with unit last stride")
    num_rows = gate2.shape[0]
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(num_cols, _BLOCK_COLS))
    _silu_mul_kernel[grid](gate2, up2, out2, num_cols,
                           gate2.stride(0), up2.stride(0), out2.stride(0),
                           BLOCK_COLS=_BLOCK_COLS)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: Triton on CUDA, the torch reference elsewhere."""
    if use_triton(gate, up):
        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)
