"""gemv: the small-batch linear kernel against F.linear (fp32 references of the same inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import gemv as gemv_module
from engine.kernels.gemv import ROWS, GemvConfig, gemv_triton, linear

pytestmark = pytest.mark.timeout(120)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64 of the same (rounded) inputs, rounded once to x's dtype."""
    return F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)


@pytest.mark.parametrize("num_rows,n,k", [(1, 48, 64), (3, 100, 1000), (8, 33, 520),
                                          (ROWS, 16, 17)])
def test_matches_the_reference_on_ragged_shapes(target, num_rows, n, k):
    torch.manual_seed(num_rows * 1000 + n)
    x, w = target.randn(num_rows, k), target.randn(n, k) / k ** 0.5
    out = torch.full((num_rows, n), float("nan"), dtype=target.dtype, device=target.device)
    gemv_triton(x, w, out=out)
    torch.testing.assert_close(out, _reference(x, w, None), atol=target.atol, rtol=target.rtol)


def test_bias_and_small_tiles(target):
    """A bias (Qwen2's q/k/v), and tiles smaller than K and N so every loop and mask runs."""
    torch.manual_seed(7)
    x, w, b = target.randn(2, 300), target.randn(70, 300) / 300 ** 0.5, target.randn(70)
    got = gemv_triton(x, w, b, config=GemvConfig(block_n=16, block_k=64, num_warps=4,
                                                 num_stages=2))
    torch.testing.assert_close(got, _reference(x, w, b), atol=target.atol, rtol=target.rtol)


def test_rows_of_a_strided_input(target):
    """x may be a row slice of a wider tensor (rows strided, columns contiguous)."""
    torch.manual_seed(3)
    wide = target.randn(4, 200)
    x, w = wide[:, :128], target.randn(40, 128) / 128 ** 0.5
    torch.testing.assert_close(gemv_triton(x, w), _reference(x, w, None),
                               atol=target.atol, rtol=target.rtol)


def test_bad_shapes_are_refused_with_a_clear_error(target):
    x, w = target.randn(2, 8), target.randn(4, 9)
    with pytest.raises(ValueError, match="do not multiply"):
        gemv_triton(x, w)
    with pytest.raises(ValueError, match="at most"):
        gemv_triton(target.randn(ROWS + 1, 9), w)
    with pytest.raises(ValueError, match="out must be"):
        gemv_triton(target.randn(2, 9), w, out=target.randn(2, 5))


def test_linear_dispatch_keeps_f_linear_off_cuda_and_for_big_batches(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv_module, "gemv_triton", lambda *a, **k: calls.append(a))
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))  # CPU: never the kernel
    assert calls == []


def test_tiles_go_where_they_were_measured_faster():
    """The shape policy (pure): the vocabulary head and a 4096-wide model's q/k/v, output
    and down projections take the kernel; gate-up and smaller matrices stay on cuBLAS."""
    from engine.kernels.gemv import gemv_config

    assert gemv_config(128256, 4096) is not None and gemv_config(128256, 2048) is not None
    assert gemv_config(6144, 4096) is not None  # 8B q/k/v
    assert gemv_config(4096, 4096) is not None  # 8B attention output
    assert gemv_config(4096, 14336) is not None  # 8B down
    assert gemv_config(28672, 4096) is None  # 8B gate-up
    assert gemv_config(3072, 2048) is None and gemv_config(2048, 8192) is None  # 1B
