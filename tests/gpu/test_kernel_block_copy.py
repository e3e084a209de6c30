"""The single-pass block copy of mapped KV transfers against its two-pass torch oracle."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.block_copy import BlockCopier, copy_blocks_reference, copy_blocks_triton
from kv_transfer.layout import plan_runs
from kv_transfer.mapped_copy import copy_runs


def _pool(num_layers: int, num_blocks: int, device: torch.device, dtype: torch.dtype,
          seed: int | None) -> torch.Tensor:
    shape = (num_layers, 2, num_blocks, 4, 2, 8)  # block: 4 slots x 2 heads x 8 dims
    if seed is None:
        return torch.full(shape, -7.0, dtype=dtype, device=device)  # poison
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device, dtype)


@pytest.mark.parametrize("layers", [range(0, 3), range(1, 2), range(2, 3)])
def test_kernel_copies_exactly_the_spec_blocks(target, layers):
    src = _pool(3, 12, target.device, target.dtype, seed=1)
    dst = _pool(3, 9, target.device, target.dtype, seed=None)  # pools of different sizes
    src_ids, dst_ids = [4, 5, 6, 11, 0], [8, 0, 1, 2, 5]
    want = dst.clone()
    as_tensor = lambda ids: torch.tensor(ids, dtype=torch.int32, device=target.device)
    copy_blocks_reference(src, want, as_tensor(src_ids).long(), as_tensor(dst_ids).long(),
                          layers)
    copy_blocks_triton(src, dst, as_tensor(src_ids), as_tensor(dst_ids), layers)
    assert torch.equal(dst, want)  # every other block and layer still holds the poison
    assert (dst == -7.0).sum() == (want == -7.0).sum() > 0


def test_kernel_handles_a_block_not_a_multiple_of_its_part(target):
    shape = (2, 2, 5, 3, 1, 6)  # 18 elements per block: masked tail of a 32-wide part
    src = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    src = src.to(target.device, target.dtype)
    dst = torch.zeros_like(src)
    ids = torch.tensor([3, 1], dtype=torch.int32, device=target.device)
    copy_blocks_triton(src, dst, ids, ids.flip(0).contiguous(), range(0, 2))
    assert torch.equal(dst[:, :, 1], src[:, :, 3]) and torch.equal(dst[:, :, 3], src[:, :, 1])
    assert torch.count_nonzero(dst[:, :, [0, 2, 4]]) == 0


def test_host_runs_match_the_oracle():
    src = _pool(4, 16, torch.device("cpu"), torch.float32, seed=2)
    dst, want = (_pool(4, 16, torch.device("cpu"), torch.float32, seed=None) for _ in "ab")
    src_ids, dst_ids = [1, 2, 3, 9, 10, 4], [5, 6, 7, 0, 1, 15]
    copy_runs(src, dst, plan_runs(src_ids, dst_ids), range(1, 3))
    copy_blocks_reference(src, want, torch.tensor(src_ids), torch.tensor(dst_ids), range(1, 3))
    assert torch.equal(dst, want)


def test_mismatched_pools_are_refused(target):
    src = _pool(2, 4, target.device, target.dtype, seed=1)
    ids = torch.tensor([0], dtype=torch.int32, device=target.device)
    with pytest.raises(ValueError, match="block layout"):
        copy_blocks_triton(src, _pool(3, 4, target.device, target.dtype, None), ids, ids,
                           range(0, 1))
    with pytest.raises(ValueError, match="outside the pool"):
        copy_blocks_triton(src, src.clone(), ids, ids, range(1, 3))


def test_one_copier_serves_many_copies_between_its_pools(target):
    """A sender keeps one copier per mapped pool: each launch copies its own ids and layers."""
    src = _pool(3, 10, target.device, target.dtype, seed=3)
    dst = _pool(3, 7, target.device, target.dtype, seed=None)
    want = dst.clone()
    copier = BlockCopier(src, dst)
    as_tensor = lambda ids: torch.tensor(ids, dtype=torch.int32, device=target.device)
    for src_ids, dst_ids, layers in (([9, 0], [6, 1], range(0, 3)), ([2], [3], range(1, 2)),
                                     ([5, 6, 7], [0, 2, 4], range(2, 3))):
        copy_blocks_reference(src, want, as_tensor(src_ids).long(), as_tensor(dst_ids).long(),
                              layers)
        copier.launch(as_tensor(src_ids), as_tensor(dst_ids), layers)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="outside the pool"):
        copier.launch(as_tensor([0]), as_tensor([0]), range(2, 4))
    with pytest.raises(ValueError, match="one source and one destination"):
        copier.launch(as_tensor([0, 1]), as_tensor([0]), range(0, 1))
