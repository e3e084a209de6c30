"""The fused mixture-of-experts kernels (engine/kernels/fused_moe.py): the grouping by
expert against its definition, and the block's kernel path against its torch path
(engine/models/moe.py), which test_moe.py and the reference tests hold to transformers.
On the CPU under Triton's interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import Activation, MoEConfig
from engine.kernels.fused_moe import align_by_expert, padded_rows, tile_rows
from engine.models.moe import MoEBlock


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 8), (5, 2, 8), (37, 3, 8),
                                                  (64, 8, 128), (3, 1, 4), (300, 2, 8)])
def test_grouping_holds_each_assignment_once_in_tiles_of_one_expert(tokens, top_k, experts):
    generator = torch.Generator().manual_seed(tokens)
    # Skewed: expert 0 is picked often, most experts never.
    scores = torch.rand(tokens, experts, generator=generator)
    scores[:, 0] += 0.5
    ids = scores.topk(top_k, dim=-1).indices
    n, flat = ids.numel(), ids.reshape(-1)
    block_m = tile_rows(n, experts)
    sorted_ids, block_experts, counts = align_by_expert(ids, experts, block_m)
    assert sorted_ids.numel() == padded_rows(n, experts, block_m) == \
        block_experts.numel() * block_m
    assert torch.equal(counts, torch.bincount(flat, minlength=experts))
    real = sorted_ids[sorted_ids < n].tolist()
    assert sorted(real) == list(range(n))  # each assignment once; the rest padding (n)
    assert bool((sorted_ids <= n).all())
    tiles = sorted_ids.view(-1, block_m).tolist()
    seen_experts = []
    for tile, expert in zip(tiles, block_experts.tolist()):
        rows = [i for i in tile if i < n]
        if expert < 0:
            assert not rows  # past the last expert: no work
            continue
        assert rows and all(int(flat[i]) == expert for i in rows)
        assert rows == sorted(rows)  # stable: assignment order within an expert
        seen_experts.append(expert)
    assert seen_experts == sorted(seen_experts)
    # Each expert used gets ceil(count / block_m) tiles, each with its rows packed first.
    for expert, count in enumerate(counts.tolist()):
        assert seen_experts.count(expert) == -(-count // block_m)


def test_tiles_grow_with_the_rows_per_expert():
    assert [tile_rows(n, 128) for n in (8, 512, 2048, 4096, 16384)] == [16, 16, 16, 32, 64]


def make_block(hidden: int, experts: int, top_k: int, width: int, *, round_weights: bool,
               renormalize: bool, shared: int, target) -> MoEBlock:
    torch.manual_seed(hidden + experts + top_k + shared)
    moe = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=width,
                    renormalize=renormalize, layers=(0,), shared_intermediate_size=shared)
    block = MoEBlock(hidden, moe, Activation.SILU, round_weights=round_weights)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=hidden ** -0.5)
    return block.to(target.device, target.dtype).eval()


@pytest.mark.parametrize("round_weights,renormalize,shared", [(True, True, 0),
                                                               (False, False, 0),
                                                               (True, False, 40)])
def test_kernel_path_equals_the_torch_path(target, round_weights, renormalize, shared):
    block = make_block(64, 8, 2, 48, round_weights=round_weights, renormalize=renormalize,
                       shared=shared, target=target)
    with torch.no_grad():
        for tokens in (1, 6, 37, 200):
            x = target.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
            expected = block(x)
            block.fuse_experts()
            ours = block.forward_kernels(x, None)
            torch.testing.assert_close(ours, expected, atol=target.atol, rtol=target.rtol)


def test_fused_weights_alias_the_experts_and_counts_stay_in_one_tensor(target):
    block = make_block(64, 8, 2, 48, round_weights=True, renormalize=True, shared=0,
                       target=target)
    with torch.no_grad():
        before = [e.down_proj.weight.clone() for e in block.experts]
        block.fuse_experts()
        w13 = block.w13
        block.fuse_experts()  # idempotent: the views still alias the stacks
        assert block.w13 is w13
        assert all(torch.equal(e.down_proj.weight, b) for e, b in zip(block.experts, before))
        assert block.experts[3].up_proj.weight.data_ptr() == \
            block.w13[3, 48:].data_ptr()
        x = target.randn(9, 64, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            block.forward_kernels(x, None)
            counts = block.expert_tokens
            block.forward_kernels(x, None)
        _, ids = block.route(x)
        expected = (2 * torch.bincount(ids.reshape(-1).cpu(), minlength=8)).tolist()
        assert block.take_expert_tokens() == expected
        assert block.expert_tokens is counts and int(counts.sum()) == 0  # zeroed in place


def test_an_expert_parallel_block_refuses_the_fused_path(target):
    block = make_block(64, 4, 2, 32, round_weights=True, renormalize=True, shared=0,
                       target=target)
    block.shares = {0: (0, 1), 1: (0, 1)}
    with pytest.raises(ValueError, match="expert-parallel"):
        block.fuse_experts()
