"""silu_mul: Triton op against the torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.silu_mul import silu_mul, silu_mul_reference, silu_mul_triton

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_tokens,intermediate", [(1, 96), (7, 1500), (3, 2304)])
def test_matches_reference_on_slices_of_a_fused_projection(target, num_tokens, intermediate):
    torch.manual_seed(0)
    gate_up = target.randn(num_tokens, 2 * intermediate) * 4
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    out = torch.full((num_tokens, intermediate), float("nan"), dtype=target.dtype,
                     device=target.device)
    silu_mul_triton(gate, up, out=out)
    torch.testing.assert_close(out, silu_mul_reference(gate, up),
                               atol=target.atol, rtol=target.rtol)


def test_reference_is_silu_times_up():
    gate = torch.tensor([[-2.0, 0.0, 3.0]])
    up = torch.tensor([[1.0, 5.0, -2.0]])
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_mul_reference(gate, up), expected)


def test_three_dimensional_input(target):
    torch.manual_seed(1)
    gate, up = target.randn(2, 3, 40), target.randn(2, 3, 40)
    torch.testing.assert_close(silu_mul_triton(gate, up), silu_mul_reference(gate, up),
                               atol=target.atol, rtol=target.rtol)


def test_dispatch_uses_the_torch_path_off_cuda():
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    assert torch.equal(silu_mul(gate, up), silu_mul_reference(gate, up))


def test_mismatched_shapes_are_rejected(target):
    with pytest.raises(ValueError, match="differ"):
        silu_mul_triton(target.randn(2, 8), target.randn(2, 9))
