"""Tensor-parallel sharding (pure): which rank of N holds which slice of every weight.

Megatron-style; rank r of N holds the r-th contiguous slice:

    q/k/v_proj  [heads * head_dim, hidden]   column-parallel: rows of heads  [r*H/N, (r+1)*H/N)
    gate/up     [intermediate, hidden]        column-parallel: rows           [r*I/N, (r+1)*I/N)
    o_proj      [hidden, heads * head_dim]    row-parallel: columns of the same heads, then
    down_proj   [hidden, intermediate]        row-parallel   all-reduce(sum) of the partial outputs
    embeddings, norms, lm_head                replicated

Mixture-of-experts layers (engine/models/moe.py) shard every expert the same way (its
gate/up column-parallel, its down row-parallel: the names end alike) and replicate the
router (`mlp.gate.weight`): every rank routes its identical input to the same experts, and
the layer's one all-reduce sums the partial expert outputs, already weighted.

With expert parallelism (`expert_parallel`, engine/expert_exchange.py) nothing is sliced:
rank 0 holds the whole model but the experts other ranks hold, and the other ranks hold
experts only (whole ones, per engine/expert_parallel.py's placements); `shard_config` is
then the model's own config and only the experts need to split evenly over the ranks.

Query heads of one KV group stay together (head j reads KV head j // (H/KV)), so each rank
attends with its own KV heads only and its KV pool holds num_kv_heads / N heads. A sharded
rank is therefore an ordinary model of its family built from `shard_config()`, with two
all-reduces per layer. N must divide num_kv_heads (hence num_heads) and intermediate_size
(and the experts' intermediate size).

Functions of names, shapes and ranks only: no process group, no I/O, no copies (a shard is
a view of the full tensor). The processes that hold the shards are
engine/tensor_parallel_group.py's.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from engine.config import ModelConfig


def check_shardable(config: ModelConfig, tp_size: int, expert_parallel: bool = False) -> None:
    """Raises ValueError, naming the head counts, unless `tp_size` ranks can split the model
    (its experts whole, with `expert_parallel`)."""
    if tp_size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {tp_size}")
    if expert_parallel:
        if config.moe is None:
            raise ValueError("expert parallelism (--ep) needs a mixture-of-experts model; "
                             "this one is dense (split it with --tp instead)")
        if config.moe.num_experts % tp_size:
            raise ValueError(f"expert parallel size {tp_size} does not divide the model's "
                             f"{config.moe.num_experts} experts")
        return  # attention, dense layers and shared experts stay whole on rank 0
    if config.num_kv_heads % tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} does not divide the model's {config.num_kv_heads} "
            f"KV heads ({config.num_heads} attention heads); use a size that divides "
            f"{config.num_kv_heads}")
    if config.intermediate_size % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide the model's "
                         f"intermediate size {config.intermediate_size}")
    if config.moe is not None and config.moe.shared_intermediate_size % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide the shared "
                         f"expert's intermediate size {config.moe.shared_intermediate_size}")
    if config.moe is not None and config.moe.intermediate_size % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide the model's "
                         f"expert intermediate size {config.moe.intermediate_size}")


def ep_with_tp(ep: int, tp: int) -> str:
    """Why --ep and a different --tp (both above 1) are refused together. (--tp equal to
    --ep names the same processes, as it always did: the group is expert-parallel.)"""
    return (f"--ep {ep} runs {ep} processes that hold the experts, attention and the KV cache "
            f"whole on the first; it does not combine with --tp {tp}: give --tp {ep} (the "
            f"same processes) or leave --tp out")


def shard_config(config: ModelConfig, tp_size: int, expert_parallel: bool = False
                 ) -> ModelConfig:
    """The shape one rank holds: heads and intermediate sizes (the experts' too) divided by
    `tp_size`; with `expert_parallel`, the model's own (rank 0 holds it whole)."""
    check_shardable(config, tp_size, expert_parallel)
    if expert_parallel:
        return config
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(moe,
                                  shared_intermediate_size=moe.shared_intermediate_size // tp_size,
                                  intermediate_size=moe.intermediate_size // tp_size)
    return dataclasses.replace(config, num_heads=config.num_heads // tp_size,
                               num_kv_heads=config.num_kv_heads // tp_size,
                               intermediate_size=config.intermediate_size // tp_size, moe=moe)


class ShardDim(enum.Enum):
    REPLICATED = None
    COLUMN = 0  # split the output features (weight rows, bias)
    ROW = 1  # split the input features (weight columns)


_COLUMN_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias",
                    "k_proj.bias", "v_proj.bias", "gate_proj.weight", "up_proj.weight")
_ROW_SUFFIXES = ("o_proj.weight", "down_proj.weight")


def shard_dim(name: str) -> ShardDim:
    """How the checkpoint tensor `name` is split across ranks (pure)."""
    if name.endswith(_COLUMN_SUFFIXES):
        return ShardDim.COLUMN
    if name.endswith(_ROW_SUFFIXES):
        return ShardDim.ROW
    return ShardDim.REPLICATED


def shard_tensor(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s slice of the full tensor `name` (a view; replicated: the tensor)."""
    dim = shard_dim(name)
    if dim is ShardDim.REPLICATED or tp_size == 1:
        return tensor
    if tensor.shape[dim.value] % tp_size:
        raise ValueError(f"{name}: dimension {dim.value} of shape {list(tensor.shape)} "
                         f"does not split into {tp_size}")
    return tensor.chunk(tp_size, dim=dim.value)[tp_rank]

