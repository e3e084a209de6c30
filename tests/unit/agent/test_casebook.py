"""What the agent remembers between ticks (agent/casebook.py) and how its typed decisions
are spelled in the audit trail (agent/decision.py)."""

from __future__ import annotations

import msgspec
import pytest

from agent.casebook import Casebook
from agent.decision import (Decision, EventAction, Outcome, OutcomeKind, RoleSwitch, Routine,
                            parse_rule)
from agent.guard_rails import ActionKind
from agent.health_rules import Detection, Rule, Thresholds, WorkerSample
from agent.observer import Lapsed
from agent.worker_case import CaseState
from protocol.messages import Role, WorkerInfo
from state.redis_state import Registry


def info(worker_id: str, epoch: int, role: Role = Role.DECODE) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, model="tiny", control_url="http://x",
                      num_kv_blocks=8, block_size=16, epoch=epoch)


def live(at_s: float, worker_id: str, epoch: int, role: Role = Role.DECODE) -> WorkerSample:
    return WorkerSample(at_s=at_s, worker_id=worker_id, epoch=epoch, role=role,
                        lease_left_s=2.0, process_alive=None, control_ok=True)


def registry(registered: list[str], *live_infos: WorkerInfo) -> Registry:
    return Registry(registered_ids=registered, workers={i.worker_id: i for i in live_infos},
                    loads={})


def test_a_lapsed_worker_is_remembered_by_what_is_known_of_its_epoch() -> None:
    book = Casebook(window_s=30.0, thresholds=Thresholds())
    book.remember([live(0.0, "d-0", 3, Role.DECODE), live(0.0, "p-0", 5, Role.PREFILL)],
                  registry(["d-0", "p-0"], info("d-0", 3), info("p-0", 5, Role.PREFILL)), 0.0)
    lapsed = [Lapsed(1.0, "d-0", None),  # never scraped: its newest sample's epoch and role
              Lapsed(1.0, "p-0", 4),  # its last scrape was of epoch 4; no role any more
              Lapsed(1.0, "x-0", None)]  # never seen with an epoch: nothing to act on
    book.remember(lapsed, registry(["d-0", "p-0", "x-0"]), 1.0)
    assert (book.windows["d-0"][-1].epoch, book.windows["d-0"][-1].role) == (3, Role.DECODE)
    assert book.windows["d-0"][-1].lease_left_s is None
    assert (book.windows["p-0"][-1].epoch, book.windows["p-0"][-1].role) == (4, None)
    assert "x-0" not in book.windows
    state = book.pool_state(registry(["d-0", "p-0", "x-0"]))
    assert state.roles == {"d-0": Role.DECODE, "p-0": None}
    assert state.epochs == {"d-0": 3, "p-0": 4}


def test_what_is_no_longer_registered_is_forgotten_unless_held_out() -> None:
    book = Casebook(window_s=30.0, thresholds=Thresholds())
    both = registry(["d-0", "d-1"], info("d-0", 1), info("d-1", 1))
    book.remember([live(0.0, "d-0", 1), live(0.0, "d-1", 1)], both, 0.0)
    book.stamp("d-0", 1, ActionKind.RECLAIM_KV, 0.0)  # HEALTHY, with a ledger
    restarting = book.case("d-1", 1).struck(Detection("d-1", 1, Rule.DEAD, "gone"), True,
                                            True, 0.0, 10.0).restart_begun(0.0)
    book.file(restarting)
    book.check_invariants()
    assert book.out_ids == {"d-1"} and book.in_state(CaseState.RESTARTING) == [restarting]
    book.remember([], registry([]), 1.0)
    assert book.windows == {} and set(book.cases) == {"d-1"}
    assert set(book.infos) == {"d-1"}  # how a lapsed worker is restarted


def test_unhandled_leaves_out_what_a_case_handles() -> None:
    book = Casebook(window_s=30.0, thresholds=Thresholds())
    slow = Detection("d-0", 1, Rule.SLOW, "slow")
    book.file(book.case("d-0", 1).struck(slow, False, True, 0.0, 10.0))
    dead, other = Detection("d-0", 1, Rule.DEAD, "gone"), Detection("d-1", 1, Rule.SLOW, "x")
    assert book.unhandled([slow, dead, other]) == [dead, other]


def test_a_decision_is_spelled_as_the_audit_trail_always_spelled_it() -> None:
    steps = [Outcome.done("ejected"), Outcome.failed("not restarted (gone)")]
    decision = Decision(7, "d-0", 3, Rule.HUNG, "no step", EventAction.EJECT_AND_RESTART,
                        Outcome.joined(steps))
    assert msgspec.json.decode(msgspec.json.encode(decision.to_event())) == {
        "at_unix_ms": 7, "worker_id": "d-0", "epoch": 3, "rule": "hung", "evidence": "no step",
        "action": "eject+restart", "outcome": "failed: ejected; not restarted (gone)"}
    move = Decision(8, "d-1", 2, Routine.REBALANCE, "queue", RoleSwitch(Role.DECODE,
                                                                        Role.PREFILL),
                    Outcome(OutcomeKind.STARTED))
    event = move.to_event()
    assert (event.rule, event.action, event.outcome) == ("rebalance", "decode->prefill",
                                                         "started")
    assert move.outcome.label == "done"  # the counter's label for a change under way
    assert str(Outcome.done()) == "done" and str(Outcome.held("why")) == "held: why"
    assert EventAction.of(ActionKind.RECLAIM_KV).value == "reclaim"


@pytest.mark.parametrize("text, rule", [("slow", Rule.SLOW), ("probation", Routine.PROBATION),
                                        ("operator", None), ("", None)])
def test_parse_rule(text: str, rule: Rule | Routine | None) -> None:
    assert parse_rule(text) is rule
