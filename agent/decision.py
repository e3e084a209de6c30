"""The agent's decisions, typed: what one audit event says before it becomes JSON.

    Decision(worker, epoch, rule, evidence, action, outcome) ──to_event()──▶ AgentEvent
                                       (state/agent_state.py: the audit file, the Redis
                                        stream, GET /admin/agent/events, all strings)

Inside the agent a decision's rule is a detection `Rule` or one of the agent's own
`Routine`s, its action an `EventAction` or a `RoleSwitch`, its outcome an `Outcome` (a kind
and a detail). `to_event` is the one place they are spelled out, exactly as an operator
reads them in docs/operations.md ("The audit trail"):

    rule      dead | hung | slow | leaked_kv | error_spike | probation | restart | rebalance |
              experts
    action    eject | eject+restart | reclaim | readmit | recovered | hold | restart | wait |
              copy_experts | <from role>-><to role>
    outcome   done | done: <detail> | started | dry_run | held: <why> | failed: <why>

Nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from agent.guard_rails import ActionKind
from agent.health_rules import Rule
from protocol.messages import Role
from state.agent_state import AgentEvent


class Routine(enum.StrEnum):
    """What a decision is recorded under when no detection rule fired: the agent's own
    follow-ups."""

    PROBATION = "probation"  # a re-admission, and the ejection holding a restarted epoch out
    RESTART = "restart"  # a drained worker restarted; a restarted worker back, or not
    REBALANCE = "rebalance"  # a role change
    EXPERTS = "experts"  # a worker's expert placements switched (agent/expert_watch.py)


EventRule = Rule | Routine


def parse_rule(text: str) -> EventRule | None:
    """The rule an ejection in Redis names (written by `Actuator.eject`); None: not one of
    the agent's."""
    for kind in (Rule, Routine):
        try:
            return kind(text)
        except ValueError:
            continue
    return None


class EventAction(enum.StrEnum):
    EJECT = "eject"
    EJECT_AND_RESTART = "eject+restart"
    RECLAIM = "reclaim"
    READMIT = "readmit"
    RECOVERED = "recovered"  # a restarted worker registered a newer epoch
    HOLD = "hold"  # the guard rails held a detection back
    RESTART = "restart"  # a drained worker restarted
    WAIT = "wait"  # a restarted worker not back within the grace
    COPY_EXPERTS = "copy_experts"  # hot experts copied to other ranks, by the worker itself

    @classmethod
    def of(cls, kind: ActionKind) -> EventAction:
        """How the audit trail names what the guard rails decided."""
        return _OF_KIND[kind]


_OF_KIND = {ActionKind.EJECT: EventAction.EJECT,
            ActionKind.EJECT_AND_RESTART: EventAction.EJECT_AND_RESTART,
            ActionKind.RECLAIM_KV: EventAction.RECLAIM}


@dataclass(frozen=True, slots=True)
class RoleSwitch:
    """A role change, as an action of the audit trail: `decode->prefill`."""

    from_role: Role
    to_role: Role

    def __str__(self) -> str:
        return f"{self.from_role.value}->{self.to_role.value}"


class OutcomeKind(enum.StrEnum):
    DONE = "done"
    STARTED = "started"  # a role change under way (its end is a decision of its own)
    DRY_RUN = "dry_run"
    HELD = "held"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    detail: str | None = None  # what happened, or why not

    @classmethod
    def done(cls, detail: str | None = None) -> Outcome:
        return cls(OutcomeKind.DONE, detail)

    @classmethod
    def failed(cls, detail: str) -> Outcome:
        return cls(OutcomeKind.FAILED, detail)

    @classmethod
    def held(cls, reason: str) -> Outcome:
        return cls(OutcomeKind.HELD, reason)

    @classmethod
    def joined(cls, parts: Sequence[Outcome]) -> Outcome:
        """Several steps of one action as one outcome: failed when any step failed; the
        details in order, `; `-separated."""
        failed = any(p.kind is OutcomeKind.FAILED for p in parts)
        return cls(OutcomeKind.FAILED if failed else OutcomeKind.DONE,
                   "; ".join(p.detail for p in parts if p.detail is not None))

    @property
    def label(self) -> str:
        """The `outcome` label of pdserve_agent_decisions_total: done | dry_run | held |
        failed (a role change started counts as done)."""
        return OutcomeKind.DONE.value if self.kind is OutcomeKind.STARTED else self.kind.value

    def __str__(self) -> str:
        return self.kind.value if self.detail is None else f"{self.kind.value}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision of the agent: what it saw, which rule fired, what it did, how it went."""

    at_unix_ms: int
    worker_id: str
    epoch: int
    rule: EventRule
    evidence: str
    action: EventAction | RoleSwitch
    outcome: Outcome

    def to_event(self) -> AgentEvent:
        return AgentEvent(at_unix_ms=self.at_unix_ms, worker_id=self.worker_id,
                          epoch=self.epoch, rule=self.rule.value, evidence=self.evidence,
                          action=str(self.action), outcome=str(self.outcome))
