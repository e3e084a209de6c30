"""The expert placements a worker switched, as the agent records them (pure)."""

from __future__ import annotations

from agent.decision import EventAction, OutcomeKind, Routine
from agent.expert_watch import expert_switches, switch_decisions
from protocol.worker_load import WorkerLoad


def load(switches: int, before: float = 2.0, planned: float = 1.5) -> WorkerLoad:
    return WorkerLoad(num_waiting=0, num_running=0, num_kv_blocks_used=0,
                      num_kv_blocks_total=8, moe_rank_imbalance=[1.4, 1.2],
                      num_expert_rebalances=switches, last_switch_imbalance=before,
                      last_switch_planned=planned)


def test_no_switch_no_entry() -> None:
    assert expert_switches("w", 1, load(2), load(2)) is None
    assert expert_switches("w", 1, None, load(0)) is None


def test_switches_since_the_last_look_are_one_entry_with_their_figures() -> None:
    seen = expert_switches("w", 3, load(1), load(3))
    assert seen is not None and (seen.worker_id, seen.epoch) == ("w", 3)
    assert seen.evidence.startswith("2 expert placement switch(es) since the last look, 3 in")
    assert "took 2.00x the mean" in seen.evidence and "1.50x for its tokens" in seen.evidence
    assert "1.30x in the latest window" in seen.evidence  # the layers' mean


def test_an_epoch_first_seen_counts_from_zero() -> None:
    seen = expert_switches("w", 1, None, load(2))
    assert seen is not None and "since the worker started" in seen.evidence


def test_entries_are_done_by_the_worker() -> None:
    seen = expert_switches("w", 1, load(0), load(1))
    assert seen is not None
    (decision,) = switch_decisions([seen], at_unix_ms=5)
    assert (decision.rule, decision.action) == (Routine.EXPERTS, EventAction.COPY_EXPERTS)
    assert decision.outcome.kind is OutcomeKind.DONE and decision.at_unix_ms == 5
    event = decision.to_event()
    assert (event.rule, event.action) == ("experts", "copy_experts")
