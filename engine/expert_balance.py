"""Which hot experts get extra copies on which ranks (pure policy, EPLB-style).

From a window of token counts per expert (engine/models/moe.py counts them), a greedy
planner gives the expert with the most tokens per copy one more copy, on the least loaded
rank that has a free slot and no copy of it, and repeats while that lowers the busiest
rank's load; every expert keeps its home (engine/expert_placement.py), so no expert is ever
without a copy, and a rank never holds more than its slots.

A new placement costs weight copies, so it is taken only when it lowers the imbalance
(busiest rank over the mean) by at least `min_gain` against the current one: an even load,
or one the current placement already balances, moves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.expert_placement import ExpertPlacement, homes

MIN_GAIN = 0.10  # relative imbalance a new placement must remove to be worth its copies


def plan_replicas(tokens: Sequence[float], current: ExpertPlacement, slots_per_rank: int,
                  min_gain: float = MIN_GAIN) -> ExpertPlacement:
    """The placement for the next window: `current` unless a plan beats it by `min_gain`."""
    if len(tokens) != current.num_experts or any(t < 0 for t in tokens):
        raise ValueError(f"one non-negative count per expert ({current.num_experts}) needed")
    base = homes(current)
    base.check(slots_per_rank)
    if sum(tokens) <= 0:
        return current
    replicas = [list(r) for r in base.replicas]
    free = [slots_per_rank - len(base.held(r)) for r in range(base.num_ranks)]
    while True:
        loads = ExpertPlacement(base.num_ranks, tuple(map(tuple, replicas))).rank_loads(tokens)
        candidates = sorted(range(len(tokens)), key=lambda e: -tokens[e] / len(replicas[e]))
        added = False
        for expert in candidates[:max(1, len(candidates) // 4)]:
            targets = [r for r in range(base.num_ranks) if free[r] > 0
                       and r not in replicas[expert]]
            if not targets:
                continue
            target = min(targets, key=lambda r: (loads[r], r))
            trial = [list(r) for r in replicas]
            trial[expert].append(target)
            trial_loads = ExpertPlacement(base.num_ranks, tuple(map(tuple, trial))
                                          ).rank_loads(tokens)
            if max(trial_loads) < max(loads) - 1e-9:
                replicas, added = trial, True
                free[target] -= 1
                break
        if not added:
            break
    plan = ExpertPlacement(base.num_ranks, tuple(map(tuple, replicas)))
    plan.check(slots_per_rank)
    if plan.imbalance(tokens) <= current.imbalance(tokens) * (1 - min_gain):
        return plan
    return current
