"""rms_norm / add_rms_norm_: Triton ops against the torch reference, in place as promised."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.rmsnorm import (add_rms_norm_, add_rms_norm_reference_, add_rms_norm_triton_,
                                    rms_norm_reference, rms_norm_triton)

pytestmark = pytest.mark.timeout(60)
EPS = 1e-5


@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (5, 4096), (3, 100)])
def test_rms_norm_matches_reference(target, num_tokens, hidden):
    torch.manual_seed(0)
    x, weight = target.randn(num_tokens, hidden) * 3, target.randn(hidden)
    out = torch.full_like(x, float("nan"))
    rms_norm_triton(x, weight, EPS, out=out)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS),
                               atol=target.atol, rtol=target.rtol)


def test_reference_normalises_to_unit_rms():
    x = torch.randn(4, 64) * 7
    out = rms_norm_reference(x, torch.ones(64), 0.0)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(4))


@pytest.mark.parametrize("hidden", [576, 4096])
def test_fused_add_updates_both_buffers_in_place(target, hidden):
    torch.manual_seed(1)
    x, residual, weight = target.randn(4, hidden), target.randn(4, hidden), target.randn(hidden)
    expected_x, expected_residual = add_rms_norm_reference_(x.clone(), residual.clone(),
                                                            weight, EPS)
    returned = add_rms_norm_triton_(x, residual, weight, EPS)
    assert returned[0] is x and returned[1] is residual
    torch.testing.assert_close(residual, expected_residual, atol=target.atol, rtol=target.rtol)
    torch.testing.assert_close(x, expected_x, atol=target.atol, rtol=target.rtol)


def test_strided_rows_leave_neighbouring_columns_alone(target):
    torch.manual_seed(2)
    hidden = 96
    wide_x, wide_res = target.randn(3, 2 * hidden), target.randn(3, 2 * hidden)
    before_x, before_res = wide_x.clone(), wide_res.clone()
    weight = target.randn(hidden)
    x, residual = wide_x[:, :hidden], wide_res[:, hidden:]
    add_rms_norm_triton_(x, residual, weight, EPS)
    assert torch.equal(wide_x[:, hidden:], before_x[:, hidden:])
    assert torch.equal(wide_res[:, :hidden], before_res[:, :hidden])
    expected_x, _ = add_rms_norm_reference_(before_x[:, :hidden].clone(),
                                            before_res[:, hidden:].clone(), weight, EPS)
    torch.testing.assert_close(x, expected_x, atol=target.atol, rtol=target.rtol)


def test_dispatch_uses_the_torch_path_off_cuda():
    x, residual, weight = torch.randn(2, 16), torch.randn(2, 16), torch.randn(16)
    expected_x, expected_res = add_rms_norm_reference_(x.clone(), residual.clone(), weight, EPS)
    add_rms_norm_(x, residual, weight, EPS)
    assert torch.equal(x, expected_x) and torch.equal(residual, expected_res)
