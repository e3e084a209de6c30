"""gemv: the small-batch linear kernel against F.linear (fp32 references of the same inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import gemv as gemv_module
from engine.kernels.gemv import ROWS, GemvConfig, GemvWorkspace, gemv_triton, linear

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


@pytest.mark.parametrize("split_k", [2, 3, 4, 8])
@pytest.mark.parametrize("num_rows,n,k", [(1, 48, 512), (3, 100, 1000), (8, 33, 96)])
def test_split_k_matches_the_reference_and_leaves_the_counters_at_zero(target, split_k,
                                                                       num_rows, n, k):
    """Splits over K meet in one launch: every column written (NaN-poisoned output), the
    same bits on a second run, and each arrival counter back at 0 for the next launch. K of
    96 in 8 splits leaves some splits nothing to read."""
    torch.manual_seed(split_k * 100 + num_rows)
    x, w, b = target.randn(num_rows, k), target.randn(n, k) / k ** 0.5, target.randn(n)
    config = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=split_k)
    workspace = GemvWorkspace(target.device, split_k * ROWS * n, -(-n // 16))
    outs = []
    for _ in range(2):
        out = torch.full((num_rows, n), float("nan"), dtype=target.dtype, device=target.device)
        outs.append(gemv_triton(x, w, b, out=out, config=config, workspace=workspace))
        workspace.check_invariants()
    torch.testing.assert_close(outs[0], _reference(x, w, b), atol=target.atol, rtol=target.rtol)
    assert torch.equal(outs[0], outs[1])


def test_split_k_without_a_workspace_that_fits_is_refused(target):
    x, w = target.randn(2, 64), target.randn(40, 64)
    config = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=4)
    with pytest.raises(ValueError, match="workspace"):
        gemv_triton(x, w, config=config)
    with pytest.raises(ValueError, match="workspace"):
        gemv_triton(x, w, config=config, workspace=GemvWorkspace(target.device, 4 * ROWS * 8, 3))
    with pytest.raises(ValueError, match="bad tile"):
        GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=0)


def test_the_workspace_fits_every_split_layer_of_a_model(monkeypatch):
    """for_shapes sizes the scratch from the shape policy: None when nothing is split."""
    policy = {(64, 32): GemvConfig(16, 32, 4, 2, split_k=4),
              (96, 32): GemvConfig(32, 32, 4, 2, split_k=2)}
    monkeypatch.setattr(gemv_module, "gemv_config", lambda n, k: policy.get((n, k)))
    workspace = GemvWorkspace.for_shapes([(64, 32), (96, 32), (500, 32)], "cpu")
    assert workspace is not None
    assert workspace.partials.numel() == max(4 * ROWS * 64, 2 * ROWS * 96)
    assert workspace.arrivals.numel() == 4 and workspace.fits(96, policy[(96, 32)])
    assert GemvWorkspace.for_shapes([(500, 32)], "cpu") is None


def test_linear_dispatch_keeps_f_linear_off_cuda_and_for_big_batches(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv_module, "gemv_triton", lambda *a, **k: calls.append(a))
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))  # CPU: never the kernel
    assert calls == []


def test_tiles_go_where_they_were_measured_faster():
    """The shape policy (pure): the vocabulary head and a 4096-wide model's q/k/v take the
    kernel; the output and down projections split K; gate-up and a 2048-wide model's
    q/k/v and output projections stay on cuBLAS, and so does every matrix of a small model."""
    from engine.kernels.gemv import gemv_config

    assert gemv_config(128256, 4096) is not None and gemv_config(128256, 2048) is not None
    assert gemv_config(6144, 4096).split_k == 1  # 8B q/k/v
    assert gemv_config(4096, 4096).split_k > 1  # 8B attention output
    assert gemv_config(4096, 14336).split_k > 1  # 8B down
    assert gemv_config(2048, 8192).split_k > 1  # 1B down
    assert gemv_config(28672, 4096) is None and gemv_config(16384, 2048) is None  # gate-up
    assert gemv_config(3072, 2048) is None and gemv_config(2048, 2048) is None  # 1B
    assert gemv_config(576, 1536) is None  # SmolLM2-135M down


def test_a_model_holds_the_workspace_its_split_layers_need():
    """prepare_kernels sizes the scratch from the model's own linear layers."""
    from engine.kernels.gemv import GemvWorkspace, gemv_config
    from engine.models.llama import LlamaForCausalLM
    from testing.shapes import SHAPES

    config = SHAPES["llama3-8b"]
    shapes = LlamaForCausalLM.linear_shapes_of(config)
    workspace = GemvWorkspace.for_shapes(shapes, "cpu")
    assert workspace is not None
    for n, k in shapes:
        tile = gemv_config(n, k)
        assert tile is None or tile.split_k == 1 or workspace.fits(n, tile)
