"""Writing FP8 KV rows from Triton kernels: the device side of engine/kv_quant.py.

Each row (one token's vector of one KV head) gets scale = max|x| / 448 (1 for a zero row)
and values x / scale rounded to e4m3, ties to even: bit for bit what `quantize` stores, so
a block written by a CUDA worker and one written by a CPU worker are alike. Divisions are
correctly rounded (`div_rn`), not Triton's default approximate ones.
"""

from __future__ import annotations

from engine.kernels.backend import import_triton

triton, tl, _ = import_triton()


@triton.jit
def round_to_e4m3(q):
    """q (float32, |q| <= 448) rounded to the nearest e4m3 value, ties to even, as a
    float32 that converts to FP8 exactly. Done in float32 because Triton's interpreter
    rounds a conversion that carries into the next power of two wrongly (125.6 -> 64).
    Normal range: keep 3 mantissa bits by integer rounding of the bit pattern (a carry
    moves into the exponent by itself); below 2^-6 the step is a fixed 2^-9."""
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = ((tl.abs(q) * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5 * 2^23: to an int
    # q's sign bit, -0 included, set by bits: a negation compiles to 0 - x on the GPU, which
    # gives +0 for a tiny negative q rounded to zero (the interpreter gave -0).
    subnormal = (tiny.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32,
                                                                          bitcast=True)
    return tl.where(tl.abs(q) < 0.015625, subnormal, normal)


@triton.jit
def fp8_scales(amax, FP8_LIMIT: tl.constexpr):
    """Each row's scale from its largest magnitude: amax / 448, or 1 for a zero row."""
    return tl.where(amax > 0, tl.div_rn(amax, FP8_LIMIT), 1.0)


@triton.jit
def fp8_values(x, scales, FP8_LIMIT: tl.constexpr):
    """x [R, D] float32 over its rows' scales [R], clamped and rounded to e4m3 (float32)."""
    q = tl.div_rn(x, scales[:, None])
    return round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_LIMIT), FP8_LIMIT))


@triton.jit
def store_fp8_halves(x1, x2, values_ptr, offsets, HALF: tl.constexpr, mask, scales_ptr,
                     scale_offsets, scale_mask, FP8_LIMIT: tl.constexpr):
    """`store_fp8_rows` for rows held as two halves [R, D/2] (a rotated vector's): one
    scale per row over both, the halves at `offsets` and `offsets + HALF`."""
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    scales = fp8_scales(tl.maximum(tl.max(tl.abs(a1), axis=1), tl.max(tl.abs(a2), axis=1)),
                        FP8_LIMIT)
    tl.store(values_ptr + offsets, fp8_values(a1, scales, FP8_LIMIT).to(
        values_ptr.dtype.element_ty), mask=mask)
    tl.store(values_ptr + offsets + HALF, fp8_values(a2, scales, FP8_LIMIT).to(
        values_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + scale_offsets, scales, mask=scale_mask)


@triton.jit
def store_fp8_rows(x, values_ptr, offsets, mask, scales_ptr, scale_offsets, scale_mask,
                   FP8_LIMIT: tl.constexpr):
    """Store rows x [R, D] (zeros where masked) as FP8 values with one scale per row,
    exactly as engine/kv_quant.py's `quantize` (correctly rounded division, clamp)."""
    x = x.to(tl.float32)
    scales = fp8_scales(tl.max(tl.abs(x), axis=1), FP8_LIMIT)
    tl.store(values_ptr + offsets, fp8_values(x, scales, FP8_LIMIT).to(
        values_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + scale_offsets, scales, mask=scale_mask)
