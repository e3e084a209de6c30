"""From detections to actions, within the guard rails: a pure policy.

    detection ─┬─ dead, hung ──────────────> eject, then restart
               ├─ error_spike, slow ───────> eject; a second strike in the same epoch
               │                              (found bad again after its probation):
               │                              eject, then restart
               └─ leaked_kv ───────────────> reclaim (nothing ejected)

Guard rails, all checked here:
  * never act on an epoch older than the registry's for that worker (a newer incarnation
    replaced it: the detection is stale);
  * never eject more than `max_eject_fraction` of a role's pool at once (rounded down, but
    at least one when the pool has two or more): "better to eject wrongly than to miss a
    bad node", but never a whole pool. A dead worker is out whatever the agent does, so it
    is always restarted, and it counts against the limit for the others;
  * never repeat an action of one kind on the same (worker, epoch) within `cooldown_s`
    (a reclaim does not hold back an ejection, nor the reverse; idempotent:
    the executor may be told twice, it acts once).
Nothing here does I/O; the caller passes the registry's epochs and roles, what is already
ejected, and each worker's `Ledger` (when each kind of action last ran on it, how often it
was ejected). A ledger covers one epoch, the newest acted on: an action on another epoch
starts a fresh one (a new incarnation starts clean), so cooldowns and strikes are per epoch.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent.health_rules import Detection, Rule
from protocol.messages import Role


class ActionKind(enum.StrEnum):
    EJECT_AND_RESTART = "eject_and_restart"
    EJECT = "eject"
    RECLAIM_KV = "reclaim_kv"


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    worker_id: str
    epoch: int
    because: Detection


@dataclass(frozen=True, slots=True)
class Held:
    """Why a detection led to no action (recorded in the audit log all the same)."""

    detection: Detection
    reason: str


@dataclass(frozen=True, slots=True)
class Ledger:
    """What the guard rails remember of one worker, all of one epoch (the newest acted on)."""

    epoch: int
    num_strikes: int = 0  # ejections in this epoch
    last_action_s: Mapping[ActionKind, float] = field(default_factory=dict)  # kind -> when

    def strikes_in(self, epoch: int) -> int:
        return self.num_strikes if epoch == self.epoch else 0

    def last_in(self, epoch: int, kind: ActionKind) -> float | None:
        """When an action of `kind` last ran on `epoch`; None: never."""
        return self.last_action_s.get(kind) if epoch == self.epoch else None

    def _of(self, epoch: int) -> Ledger:
        return self if epoch == self.epoch else Ledger(epoch)

    def stamped(self, epoch: int, kind: ActionKind, now_s: float) -> Ledger:
        """An action of `kind` ran on `epoch` at `now_s`."""
        ledger = self._of(epoch)
        return Ledger(epoch, ledger.num_strikes, {**ledger.last_action_s, kind: now_s})

    def struck(self, epoch: int) -> Ledger:
        """`epoch` was ejected once more."""
        ledger = self._of(epoch)
        return Ledger(epoch, ledger.num_strikes + 1, ledger.last_action_s)


@dataclass(frozen=True, slots=True)
class PoolState:
    epochs: Mapping[str, int]  # worker id -> its newest epoch in the registry
    roles: Mapping[str, Role | None]  # worker id -> role (None: lapsed, no registry entry)
    ejected: frozenset[str]  # worker ids out of routing now
    ledgers: Mapping[str, Ledger] = field(default_factory=dict)  # worker id -> its ledger


_ACTIONS = {Rule.DEAD: ActionKind.EJECT_AND_RESTART, Rule.HUNG: ActionKind.EJECT_AND_RESTART,
            Rule.ERROR_SPIKE: ActionKind.EJECT, Rule.SLOW: ActionKind.EJECT,
            Rule.LEAKED_KV: ActionKind.RECLAIM_KV}


def max_ejected(pool_size: int, fraction: float) -> int:
    """How many of a pool of `pool_size` may be out at once."""
    if pool_size <= 1:
        return pool_size  # a lone worker that is dead or hung is out whatever we do
    return max(1, int(pool_size * fraction))


def plan_actions(detections: Sequence[Detection], state: PoolState, now_s: float,
                 max_eject_fraction: float = 0.5, cooldown_s: float = 10.0
                 ) -> tuple[list[Action], list[Held]]:
    if not 0 < max_eject_fraction <= 1:
        raise ValueError("max_eject_fraction must be in (0, 1]")
    actions: list[Action] = []
    held: list[Held] = []
    pool_sizes = Counter(state.roles.values())
    out = Counter(state.roles[w] for w in state.ejected if w in state.roles)
    # The gravest first, so that a dead worker is not held back by a slow one's ejection.
    order = {Rule.DEAD: 0, Rule.HUNG: 1, Rule.ERROR_SPIKE: 2, Rule.SLOW: 3, Rule.LEAKED_KV: 4}
    for detection in sorted(detections, key=lambda d: (order[d.rule], d.worker_id)):
        worker, epoch = detection.worker_id, detection.epoch
        newest = state.epochs.get(worker)
        if newest is not None and newest > epoch:
            held.append(Held(detection, f"epoch {epoch} was replaced by epoch {newest}"))
            continue
        kind = _ACTIONS[detection.rule]
        ledger = state.ledgers.get(worker)
        if kind is ActionKind.EJECT and ledger is not None and ledger.strikes_in(epoch) >= 1:
            kind = ActionKind.EJECT_AND_RESTART
        last = None if ledger is None else ledger.last_in(epoch, kind)
        if last is not None and now_s - last < cooldown_s:
            held.append(Held(detection, f"acted on {now_s - last:.1f} s ago (cooldown "
                                        f"{cooldown_s:g} s)"))
            continue
        if kind is not ActionKind.RECLAIM_KV and worker not in state.ejected:
            role = state.roles.get(worker)
            limit = max_ejected(pool_sizes[role], max_eject_fraction)
            if out[role] >= limit and detection.rule is not Rule.DEAD:
                pool = "lapsed" if role is None else role.value
                held.append(Held(detection, f"{out[role]} of the {pool_sizes[role]} {pool} "
                                            f"worker(s) are out already (at most {limit})"))
                continue
            out[role] += 1
        actions.append(Action(kind, worker, epoch, detection))
    return actions, held
