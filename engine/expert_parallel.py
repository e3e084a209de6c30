"""Expert parallelism (`--ep N`): N processes hold whole experts, hot experts get extra copies.

    attention      whole, on rank 0 only, with the KV cache (engine/expert_exchange.py)
    router         replicated: every rank routes every token exactly as the others do
    experts        per engine/expert_placement.py: rank r computes the rows of the experts
                   it holds (of a k-copy expert, its share of the rows), zero elsewhere
    combine        an all-reduce of the partial sums: every (token, expert) pair is computed
                   by exactly one rank

Rank 0 broadcasts each MoE block's tokens to the other ranks, so no all-to-all is needed to
bring tokens to their experts: the broadcast and the all-reduce that combines the rows are
the exchange (engine/expert_exchange.py).

Rebalancing (`ExpertRebalancer`, on rank 0, which drives): every `interval_steps` steps it
reads each MoE layer's token counts (identical on every rank: the router is replicated) and
plans new placements (engine/expert_balance.py). A changed placement goes to every rank
before the next step and every rank applies it before computing that step (`place_experts`):
a new copy is filled from the rank's `ExpertBank` (every expert's weights on the host) before
any copy is dropped, and a home copy never moves, so the stream never stops and no expert is
ever without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.expert_balance import MIN_GAIN, plan_replicas
from engine.expert_placement import ExpertPlacement, spread
from engine.models.moe import MoEBlock

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
REBALANCE_INTERVAL_STEPS = 64


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's mixture-of-experts blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def spare_slots(num_experts: int, num_ranks: int) -> int:
    """Extra expert copies each rank has room for: a quarter of its own experts, at least one."""
    return max(1, num_experts // num_ranks // 4)


@dataclass
class ExpertBank:
    """Every expert's weights of every MoE block, in host memory: (block, expert) ->
    gate, up, down. A rank copies an expert it is newly given from here."""

    weights: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, full: nn.Module) -> "ExpertBank":
        """The bank of an unsharded model's experts (views of its weights, no copy)."""
        return cls({(b, e): tuple(getattr(expert, n).weight.detach() for n in EXPERT_WEIGHTS)
                    for b, block in enumerate(moe_blocks(full))
                    for e, expert in enumerate(block.experts)})


def initial_placements(model: nn.Module, num_ranks: int) -> tuple[ExpertPlacement, ...]:
    """One copy of each expert, spread evenly (engine/expert_placement.py), per block."""
    return tuple(spread(block.num_experts, num_ranks) for block in moe_blocks(model))


@dataclass
class ExpertParallelRank:
    """What a rank's model needs to change its experts between steps: its rank, the bank
    it copies new experts from and the device they go to."""

    rank: int
    bank: ExpertBank
    device: torch.device | str
    placements: tuple[ExpertPlacement, ...] = ()

    def place(self, model: nn.Module, placements: Sequence[ExpertPlacement]) -> None:
        """Switch `model` to `placements` (filled from the bank once it holds weights)."""
        place_experts(model, placements, self.rank, self.bank if self.placements else None,
                      self.device)
        self.placements = tuple(placements)


def place_experts(model: nn.Module, placements: Sequence[ExpertPlacement], rank: int,
                  bank: ExpertBank | None, device: torch.device | str) -> None:
    """Make `model` hold the experts `placements` give `rank` (one placement per MoE block):
    new copies filled from `bank` first, then the experts it no longer holds released.
    Without a bank (start-up, before the weights are copied in) nothing is filled."""
    blocks = moe_blocks(model)
    if len(blocks) != len(placements):
        raise ValueError(f"{len(placements)} placements for {len(blocks)} MoE blocks")
    for b, (block, placement) in enumerate(zip(blocks, placements)):
        if placement.num_experts != block.num_experts:
            raise ValueError(f"a placement of {placement.num_experts} experts for a block of "
                             f"{block.num_experts}")
        held = set(placement.held(rank))
        for e in sorted(held):
            expert = block.experts[e]
            if bank is not None and expert.gate_proj.weight.numel() == 0:
                for name, weight in zip(EXPERT_WEIGHTS, bank.weights[(b, e)]):
                    getattr(expert, name).weight = nn.Parameter(
                        weight.to(device, copy=True), requires_grad=False)
        block.shares = {e: share for e in held
                        if (share := placement.share(rank, e)) is not None}
        for e, expert in enumerate(block.experts):
            if e not in held:
                for name in EXPERT_WEIGHTS:
                    getattr(expert, name).weight = nn.Parameter(
                        torch.empty(0, device=device), requires_grad=False)


class ExpertRebalancer:
    """Rank 0's replication loop: reads the blocks' counts every `interval_steps` steps and
    returns new placements when the planner finds a better one (None: keep them)."""

    def __init__(self, model: nn.Module, num_ranks: int,
                 interval_steps: int = REBALANCE_INTERVAL_STEPS, min_gain: float = MIN_GAIN
                 ) -> None:
        self.blocks = moe_blocks(model)
        if not self.blocks:
            raise ValueError("expert parallelism needs a mixture-of-experts model")
        num_experts = self.blocks[0].num_experts
        self.placements = initial_placements(model, num_ranks)
        self.slots_per_rank = num_experts // num_ranks + spare_slots(num_experts, num_ranks)
        self.interval_steps = interval_steps
        self.min_gain = min_gain
        self.num_steps = 0
        # Per block, the busiest rank over the mean in the last window, under the placement
        # it ran with (`imbalance`), and every switch made: its step and, per block, that
        # window's imbalance under the old placement and under the new.
        self.imbalance: list[float] = []
        self.tokens: list[list[int]] = []  # per block, each expert's tokens in that window
        self.rebalances: list[Rebalance] = []

    def step(self) -> tuple[ExpertPlacement, ...] | None:
        """Called once per step, before it is sent: the placements to switch to, or None."""
        self.num_steps += 1
        if self.num_steps % self.interval_steps:
            return None
        self.tokens = tokens = [block.take_expert_tokens() for block in self.blocks]
        plans = tuple(plan_replicas(t, p, self.slots_per_rank, self.min_gain)
                      for t, p in zip(tokens, self.placements))
        self.imbalance = [p.imbalance(t) for t, p in zip(tokens, self.placements)]
        if plans == self.placements:
            return None
        self.rebalances.append(Rebalance(self.num_steps, self.imbalance,
                                         [p.imbalance(t) for t, p in zip(tokens, plans)]))
        self.placements = plans
        return plans


@dataclass(frozen=True)
class Rebalance:
    """One switch of placements: before step `step`, with each block's imbalance in the
    window that decided it, under the old placements and under the new."""

    step: int
    imbalance_before: list[float]
    imbalance_after: list[float]
