"""Expert placements a worker switched, as entries of the agent's audit trail (pure, but
for `switch_decisions`' default time stamp).

A worker that spreads a mixture-of-experts model over ranks (`--ep`) copies its hot experts
to other ranks on its own, every so many steps (engine/expert_parallel.py), and counts the
switches in its load (`num_expert_rebalances`, protocol/worker_load.py). The agent acts on
nothing here: it records each switch it sees between two health reports of one epoch, so an
operator reading the trail finds the expert moves beside the agent's own actions:

    rule experts, action copy_experts, outcome done: by the worker's rebalancer

A worker restarted (a new epoch) starts its count again. The first report the agent gets of
an epoch counts from zero: a switch made before the agent's first look is recorded too (an
agent that starts late, or takes over, records the epoch's earlier switches once more).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

from agent.decision import Decision, EventAction, Outcome, Routine
from protocol.worker_load import WorkerLoad
from state.agent_state import now_unix_ms


@dataclass(frozen=True, slots=True)
class ExpertSwitches:
    """What one worker's rebalancer did between two of its reports."""

    worker_id: str
    epoch: int
    evidence: str


def expert_switches(worker_id: str, epoch: int, then: WorkerLoad | None,
                    now: WorkerLoad) -> ExpertSwitches | None:
    """The switches between two loads of one epoch (`then` None: the epoch's first report);
    None when there were none."""
    switched = now.num_expert_rebalances - (then.num_expert_rebalances if then else 0)
    if switched <= 0:
        return None
    since = "the last look" if then else "the worker started"
    latest = fmean(now.moe_rank_imbalance) if now.moe_rank_imbalance else 1.0
    return ExpertSwitches(worker_id, epoch, (
        f"{switched} expert placement switch(es) since {since}, "
        f"{now.num_expert_rebalances} in all; the last: the busiest rank took "
        f"{now.last_switch_imbalance:.2f}x the mean in the window that decided it (averaged "
        f"over MoE layers), {now.last_switch_planned:.2f}x for its tokens under the new "
        f"placement; {latest:.2f}x in the latest window"))


def switch_decisions(switches: Sequence[ExpertSwitches],
                     at_unix_ms: int | None = None) -> list[Decision]:
    """The audit entries of `switches` (done, also in a dry run: the worker made them),
    stamped `at_unix_ms` (default: now)."""
    at = now_unix_ms() if at_unix_ms is None else at_unix_ms
    return [Decision(at, s.worker_id, s.epoch, Routine.EXPERTS, s.evidence,
                     EventAction.COPY_EXPERTS, Outcome.done("by the worker's rebalancer"))
            for s in switches]
