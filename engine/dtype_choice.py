"""`--dtype auto`: the precision a worker runs in, chosen from what this machine measures.

    auto on CUDA  -> bfloat16 (every GPU the kernels support has bf16 tensor cores)
    auto on a CPU -> bfloat16 when a bf16 matmul of a model-like shape runs at least
                     `BF16_MIN_SPEEDUP` times as fast as a float32 one here, else float32

A CPU with native bf16 instructions (AVX-512 BF16, AMX) runs bf16 matmuls faster than
float32; one without them (AVX2 only) emulates bf16 and runs it several times slower, so
the flags alone would be a guess and the measurement decides. `choose_dtype` is the policy
(pure); `measure_matmul_gflops` the probe (about a tenth of a second).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

AUTO = "auto"
BF16_MIN_SPEEDUP = 1.2
_SHAPE = (256, 1024, 1024)  # rows x inner x out: a prefill chunk through a small model's layer


def choose_dtype(device: str, gflops: Mapping[str, float] | None) -> str:
    """The dtype `auto` stands for on `device`, given measured float32 / bfloat16 matmul
    rates (GFLOP/s; ignored on CUDA)."""
    if device.startswith("cuda"):
        return "bfloat16"
    if not gflops or gflops.get("float32", 0.0) <= 0:
        return "float32"
    return ("bfloat16" if gflops.get("bfloat16", 0.0) >= BF16_MIN_SPEEDUP * gflops["float32"]
            else "float32")


def measure_matmul_gflops(dtype: torch.dtype, repeats: int = 3) -> float:
    """Best-of-`repeats` rate of one matmul of `_SHAPE` on the CPU, in GFLOP/s."""
    rows, inner, out = _SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=generator).to(dtype)
    w = torch.randn(out, inner, generator=generator).to(dtype)
    torch.nn.functional.linear(a, w)  # first call: allocation, library dispatch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(a, w)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * inner * out / max(best, 1e-9) / 1e9


def resolve_dtype(requested: str, device: str) -> tuple[str, str]:
    """(dtype name, why) for a worker's `--dtype`; `auto` is measured on a CPU."""
    if requested != AUTO:
        return requested, "as given"
    if device.startswith("cuda"):
        return choose_dtype(device, None), "auto on CUDA"
    rates = {name: measure_matmul_gflops(getattr(torch, name)) for name in ("float32", "bfloat16")}
    chosen = choose_dtype(device, rates)
    return chosen, (f"auto: matmul float32 {rates['float32']:.0f} GFLOP/s, bfloat16 "
                    f"{rates['bfloat16']:.0f} GFLOP/s on this CPU")
