"""Which implementation of a kernel runs: Triton on CUDA tensors, the torch reference elsewhere.

Every op module in this package imports Triton through `import_triton()`, so the package
imports on a CPU-only install without the `gpu` extra (the torch path is the CPU path and
needs no Triton). Triton's interpreter (TRITON_INTERPRET=1, set by whoever starts the
process, before the first import of triton) runs the same kernels on CPU tensors; the
dispatch helpers never pick it on their own because it is orders of magnitude slower than
the torch reference. Tests call the `*_triton` functions directly to exercise it.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch


class _MissingTriton:
    """Stands in for `triton` so kernel definitions still parse when triton is absent."""

    @staticmethod
    def jit(fn: Callable[..., Any] | None = None, **_options: Any) -> Any:
        if fn is None:
            return lambda f: f
        return fn

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())


def import_triton() -> tuple[Any, Any, bool]:
    """(triton, triton.language, available). Without triton, stand-ins that cannot launch."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return _MissingTriton(), types.SimpleNamespace(constexpr=None), False
    return triton, tl, True


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every tensor lives on a CUDA device and triton is installed."""
    if not all(t.is_cuda for t in tensors):
        return False
    return import_triton()[2]


def require_triton() -> None:
    """Raise a clear error where a Triton kernel is asked for without triton installed."""
    if not import_triton()[2]:
        raise RuntimeError("triton is not installed: install pdserve[gpu] to run the "
                           "Triton kernels (the *_reference functions need only torch)")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1); tile sizes in Triton must be powers of two."""
    return 1 << max(0, (n - 1).bit_length())
