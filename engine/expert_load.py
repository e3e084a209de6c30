"""A worker's expert load (mixture-of-experts models): per MoE layer, how unevenly its
experts were used over the last window, and which one was used most.

Each MoE block counts its (token, expert) assignments on the device from the counts its
grouping computes anyway (engine/models/moe.py); the window reads them once every
`window_s` (one small copy per layer), so the step pays nothing more.

    imbalance  the most used expert's assignments over the mean (1.0: even; E: one expert
               took everything), per layer
    hottest    that expert's id, per layer

They travel in the worker's load (protocol/worker_load.py) and its /metrics. With expert
parallelism (`--ep`) the rebalancer reads the counts instead, every so many steps
(engine/expert_parallel.py), and `ExpertParallelLoad` reports its last window, adding

    rank_imbalance   the busiest rank's tokens over the mean, per layer, under the
                     placement that window ran with (what replication brings down)
    num_rebalances   the placements switched so far
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from statistics import fmean
from typing import Any

from torch import nn

from engine.expert_parallel import ExpertRebalancer, moe_blocks

WINDOW_S = 5.0


def per_layer(counts: Sequence[Sequence[int]]) -> tuple[list[float], list[int]]:
    """Each layer's imbalance and hottest expert, from its experts' token counts."""
    return ([imbalance(c) for c in counts],
            [max(range(len(c)), key=c.__getitem__) for c in counts])


def imbalance(counts: Sequence[int]) -> float:
    """The largest count over the mean (1.0 when nothing was counted)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0


class ExpertLoadWindow:
    """Engine thread only. `refresh()` after a step; `imbalance` and `hottest` hold the last
    complete window's figures (empty before the first window ends). Only for a model with
    MoE blocks (`of` gives None for a dense one, so its steps pay nothing)."""

    def __init__(self, model: nn.Module, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.blocks = moe_blocks(model)
        if not self.blocks:
            raise ValueError("an expert load window needs a mixture-of-experts model")
        self.window_s = window_s
        self.clock = clock
        self.started_s = clock()
        self.imbalance: list[float] = []
        self.hottest: list[int] = []
        self.rank_imbalance: list[float] = []  # no ranks: one process holds every expert
        self.num_rebalances = 0
        self.last_switch = (0.0, 0.0)

    @classmethod
    def of(cls, model: nn.Module) -> ExpertLoadWindow | None:
        """The window of `model`'s experts; None for a dense model."""
        return cls(model) if moe_blocks(model) else None

    def refresh(self) -> None:
        now = self.clock()
        if now - self.started_s < self.window_s:
            return
        self.imbalance, self.hottest = per_layer([b.take_expert_tokens() for b in self.blocks])
        self.started_s = now


class ExpertParallelLoad:
    """The expert load of an expert-parallel engine, from its rebalancer's last window (the
    rebalancer reads the blocks' counts; a second reader would split them). Engine thread
    only; the same fields as ExpertLoadWindow."""

    def __init__(self, rebalancer: ExpertRebalancer) -> None:
        self.rebalancer = rebalancer
        self.imbalance: list[float] = []
        self.hottest: list[int] = []
        self.rank_imbalance: list[float] = []
        self.num_rebalances = 0
        self.last_switch = (0.0, 0.0)  # busiest rank over the mean, before / planned after,
        # averaged over the layers

    def refresh(self) -> None:
        self.imbalance, self.hottest = per_layer(self.rebalancer.tokens)
        self.rank_imbalance = list(self.rebalancer.imbalance)
        self.num_rebalances = len(self.rebalancer.rebalances)
        if self.rebalancer.rebalances:
            last = self.rebalancer.rebalances[-1]
            self.last_switch = (fmean(last.imbalance_before), fmean(last.imbalance_after))


def expert_load_of(runner: Any) -> ExpertLoadWindow | ExpertParallelLoad | None:
    """How an engine's runner reports its expert load: through the rebalancer of an
    expert-parallel group, else by reading its model's MoE blocks; None for a dense model."""
    rebalancer = getattr(runner, "rebalancer", None)
    if isinstance(rebalancer, ExpertRebalancer):
        return ExpertParallelLoad(rebalancer)
    model = getattr(runner, "model", None)
    return ExpertLoadWindow.of(model) if model is not None else None
