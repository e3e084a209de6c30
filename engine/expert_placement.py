"""Where the experts of one mixture-of-experts layer live under expert parallelism (pure).

With `--ep`, the ranks of a tensor-parallel group hold whole experts instead of a slice of
every expert (engine/expert_parallel.py). A placement says, per expert, which ranks hold a
copy; the first is its home, which never changes, so no expert is ever without a copy. A hot
expert may have more copies (engine/expert_balance.py): its tokens are then split between
them, each (token, expert) pair computed by exactly one copy, so the layer's all-reduce of
the ranks' partial sums is the whole output however many copies there are.

    replicas[e] = (home rank, extra ranks...)      e.g. 4 experts on 2 ranks, expert 0 hot:
                                                    ((0, 1), (0,), (1,), (1,))

A rank's load is the tokens of its experts, each shared evenly among its copies; the
imbalance of a placement is the busiest rank's load over the mean (1.0: even).

Invariants (`check`): every expert has at least one copy and its home first; no rank twice
among one expert's copies; every rank in range; a rank holds at most `slots_per_rank`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from protocol.messages import NonNegInt


class ExpertPlacement(msgspec.Struct, frozen=True):
    num_ranks: NonNegInt
    replicas: tuple[tuple[int, ...], ...]  # per expert: its ranks, its home first

    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    def held(self, rank: int) -> tuple[int, ...]:
        """The experts `rank` holds a copy of, in expert order."""
        return tuple(e for e, ranks in enumerate(self.replicas) if rank in ranks)

    def share(self, rank: int, expert: int) -> tuple[int, int] | None:
        """(which copy `rank` is, how many copies) of `expert`; None: not held there."""
        ranks = self.replicas[expert]
        return (ranks.index(rank), len(ranks)) if rank in ranks else None

    def rank_loads(self, tokens: Sequence[float]) -> list[float]:
        """Each rank's tokens: every expert's split evenly among its copies."""
        loads = [0.0] * self.num_ranks
        for count, ranks in zip(tokens, self.replicas):
            for rank in ranks:
                loads[rank] += count / len(ranks)
        return loads

    def imbalance(self, tokens: Sequence[float]) -> float:
        """The busiest rank's load over the mean (1.0 when even or when nothing ran)."""
        loads = self.rank_loads(tokens)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def check(self, slots_per_rank: int | None = None) -> None:
        if self.num_ranks < 1:
            raise ValueError("a placement needs at least one rank")
        for expert, ranks in enumerate(self.replicas):
            if not ranks:
                raise ValueError(f"expert {expert} has no copy")
            if len(set(ranks)) != len(ranks) or not all(0 <= r < self.num_ranks for r in ranks):
                raise ValueError(f"expert {expert}: bad ranks {ranks} of {self.num_ranks}")
        if slots_per_rank is not None:
            for rank in range(self.num_ranks):
                if len(self.held(rank)) > slots_per_rank:
                    raise ValueError(f"rank {rank} holds {len(self.held(rank))} experts, "
                                     f"more than its {slots_per_rank} slots")


def spread(num_experts: int, num_ranks: int) -> ExpertPlacement:
    """One copy of each expert, contiguous runs of experts per rank (rank r holds experts
    [r*E/N, (r+1)*E/N)); N must divide E."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"expert parallel size {num_ranks} does not divide the model's "
                         f"{num_experts} experts")
    per_rank = num_experts // num_ranks
    return ExpertPlacement(num_ranks, tuple((e // per_rank,) for e in range(num_experts)))


def homes(placement: ExpertPlacement) -> ExpertPlacement:
    """The placement with every extra copy dropped (each expert on its home rank only)."""
    return ExpertPlacement(placement.num_ranks, tuple((r[0],) for r in placement.replicas))
