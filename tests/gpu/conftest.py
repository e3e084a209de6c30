"""Kernel tests: on a CUDA device in bf16, otherwise under Triton's interpreter in fp32.

The interpreter computes bf16 arithmetic wrongly, so CPU runs use fp32; it must be chosen
before triton is first imported, which is why this is set here, at collection time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@dataclass(frozen=True)
class KernelTarget:
    device: torch.device
    dtype: torch.dtype
    atol: float
    rtol: float

    def randn(self, *shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(self.device, self.dtype)


def _target() -> KernelTarget:
    if torch.cuda.is_available():
        # bf16 keeps 8 bits of mantissa: one rounding step is ~0.4% of the value.
        return KernelTarget(torch.device("cuda"), torch.bfloat16, atol=2e-2, rtol=2e-2)
    return KernelTarget(torch.device("cpu"), torch.float32, atol=2e-5, rtol=2e-5)


@pytest.fixture
def target() -> KernelTarget:
    return _target()


@pytest.fixture
def on_cuda() -> bool:
    return torch.cuda.is_available()
