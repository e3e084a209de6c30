"""The agent's record of one worker, and the pure functions that move it along.

Lifecycle (one `WorkerCase` per worker id the agent has acted on; `hold.epoch` is the
incarnation it holds out of routing):

    adopted (an ejection a previous agent left) ─▶ EJECTED
    struck (from HEALTHY, EJECTED or HELD_OUT; never while DRAINING or RESTARTING):
      to be ejected only (slow, error spike: a first strike) ─▶ EJECTED
      to be restarted, alive (slow, error spike)             ─▶ DRAINING
      to be restarted, dead or hung                          ─▶ HELD_OUT, restarted at once
      to be restarted, its registry entry never seen         ─▶ HELD_OUT
    EJECTED     ─ probation over, health checks pass: readmitted ─▶ HEALTHY
                ─ its epoch gone, or replaced by one not ours: dropped ─▶ HEALTHY
                ─ slow, and its own step model still says so ─▶ struck again, to be restarted
    DRAINING    ─ runs nothing, or its drain time is up ─▶ HELD_OUT, restarted at once
                ─ gone or replaced meanwhile ─▶ HELD_OUT
    HELD_OUT    ─ its restart asked for (restart_begun) ─▶ RESTARTING
    RESTARTING  ─ a newer epoch registered: recovered ─▶ EJECTED under `probation` (the new
                  epoch; when its pool can spare it), else HEALTHY
                ─ none within restart_grace_s ─▶ HELD_OUT

  HEALTHY     in routing; the case keeps its ledger (cooldowns, strikes) for its epoch
  EJECTED     out until `readmit_after_s`, then re-admitted once its health checks have
              passed for min(probation_s, 3 s) (a slow one: unless its own step model still
              says slow, which strikes it again)
  DRAINING    out, finishing what it runs (alive and answering), then restarted
  RESTARTING  out, its restart asked for: waits for a newer epoch to register
  HELD_OUT    out with nothing under way: a restart failed or was impossible, a drained
              worker went or was replaced, or a restart brought no newer epoch; a new
              detection strikes it again once its cooldown is over

Time and what the agent sees move a case through `advance(case, sighting, now, timing)`,
which returns the follow-up the control loop must carry out (`Restart`, `Recover`,
`ReportLost`, `Drop`, `Readmit`, `Restrike`) or None; what the agent does to a worker moves
it through the case's own transitions (`struck`, `restart_begun`, `recovered`, `released`,
`stamped`, `renewed`). All are pure: a new case comes back, nothing does I/O or reads a
clock.

Invariants (`check_invariants`):
  * `hold` is None exactly while HEALTHY: every other state holds one epoch out, for a rule;
  * `readmit_after_s` is set exactly while EJECTED; `healthy_since_s` only then, and never
    before the hold began;
  * `drain_reason` is set exactly while DRAINING, and only a live, answering worker
    (slow, error spike) is drained;
  * only EJECTED is held under the `probation` routine; a worker draining or restarting
    was struck by a detection rule;
  * the ledger counts no negative number of strikes.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from agent.decision import EventRule, Routine
from agent.guard_rails import ActionKind, Ledger
from agent.health_rules import Detection, Rule, WorkerSample

# Rules that find a worker alive and answering, only bad at its work: it is ejected on
# probation first (judged again when that ends), and drained before a restart.
ALIVE_RULES = frozenset({Rule.SLOW, Rule.ERROR_SPIKE})
READMIT_HEALTHY_S = 3.0  # passing health checks this long at least (or the probation, if less)


class CaseState(enum.Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    DRAINING = "draining"
    RESTARTING = "restarting"
    HELD_OUT = "held_out"


@dataclass(frozen=True, slots=True)
class Timing:
    """The loop's periods a case is judged by."""

    probation_s: float
    drain_timeout_s: float
    restart_grace_s: float  # a restarted worker not back by then is reported
    lease_margin_s: float  # a lease with less than this left fails the health check


@dataclass(frozen=True, slots=True)
class Hold:
    """The ejection the agent holds (and renews in Redis) while the case is not HEALTHY."""

    epoch: int
    rule: EventRule  # why: the detection rule that struck, or the probation routine
    since_s: float  # when the case entered its state (ejected, held out, drain or restart)
    renewed_s: float  # when the ejection was last written to Redis


@dataclass(frozen=True, slots=True)
class Sighting:
    """What the agent sees of one worker at one tick, as its case needs it."""

    last: WorkerSample | None  # its newest sample; None: none in the window
    known_epoch: int | None  # epoch of the registry entry the agent last saw (None: none)
    live_epoch: int | None  # its epoch holding a live lease now (None: not live)
    still_slow: Detection | None = None  # its own step model's verdict (when asked)


@dataclass(frozen=True, slots=True)
class Restart:
    """DRAINING is over: restart the worker now (`restart_begun` once asked)."""

    epoch: int
    how: str  # "drained", or how long the drain ran before it was cut
    reason: str  # the evidence that struck it


@dataclass(frozen=True, slots=True)
class Recover:
    """RESTARTING: a newer epoch registered. Drop the old ejection, then `recovered`."""

    epoch: int


@dataclass(frozen=True, slots=True)
class ReportLost:
    """RESTARTING gave no newer epoch within the grace (the case is HELD_OUT now)."""

    evidence: str


@dataclass(frozen=True, slots=True)
class Drop:
    """EJECTED, but its epoch is gone or replaced: drop the ejection, then `released`."""


@dataclass(frozen=True, slots=True)
class Readmit:
    """EJECTED, its probation over and its health checks passing: `released` once done."""

    evidence: str


@dataclass(frozen=True, slots=True)
class Restrike:
    """EJECTED for slow, and its own step model still says slow: strike it again."""

    found: Detection


FollowUp = Restart | Recover | ReportLost | Drop | Readmit | Restrike


@dataclass(frozen=True, slots=True)
class WorkerCase:
    worker_id: str
    ledger: Ledger  # the guard rails' memory of it (cooldowns, strikes) for one epoch
    state: CaseState = CaseState.HEALTHY
    hold: Hold | None = None  # None exactly while HEALTHY
    readmit_after_s: float | None = None  # EJECTED: not re-admitted before this
    healthy_since_s: float | None = None  # EJECTED: passing health checks since
    drain_reason: str | None = None  # DRAINING: the evidence it is restarted for

    @classmethod
    def adopted(cls, worker_id: str, epoch: int, rule: EventRule, now_s: float,
                probation_s: float) -> WorkerCase:
        """An ejection a previous agent left: on probation from now."""
        return cls(worker_id, Ledger(epoch), CaseState.EJECTED, Hold(epoch, rule, now_s, now_s),
                   readmit_after_s=now_s + probation_s)

    @property
    def out(self) -> bool:
        """Held out of routing by the agent."""
        return self.hold is not None

    def held(self) -> Hold:
        """Its hold; ValueError while HEALTHY (holding nothing)."""
        if self.hold is None:
            raise ValueError(f"{self.worker_id} is healthy: it holds nothing")
        return self.hold

    def handling(self, found: Detection) -> bool:
        """Does the case handle `found` already (nothing new to decide)? A worker draining or
        restarting does; one on probation for this very kind of badness is judged when its
        probation ends."""
        if self.state in (CaseState.DRAINING, CaseState.RESTARTING):
            return True
        return self.state is CaseState.EJECTED and self.hold is not None and \
            self.hold.epoch == found.epoch and found.rule in ALIVE_RULES

    # ------------------------------------------------------------ what the agent does

    def stamped(self, epoch: int, kind: ActionKind, now_s: float) -> WorkerCase:
        """An action of `kind` on `epoch` was decided at `now_s` (its cooldown starts)."""
        return dataclasses.replace(self, ledger=self.ledger.stamped(epoch, kind, now_s))

    def struck(self, found: Detection, restart: bool, restartable: bool, now_s: float,
               probation_s: float) -> WorkerCase:
        """Ejected for `found` (whether Redis took it or not): EJECTED on probation, or, to be
        restarted, DRAINING first (a live worker: `restartable` and slow or failing) or
        HELD_OUT (the caller restarts it now when `restartable`, then `restart_begun`)."""
        if self.state in (CaseState.DRAINING, CaseState.RESTARTING):
            raise ValueError(f"{self.worker_id} is {self.state.value}: not struck again")
        base = WorkerCase(self.worker_id, self.ledger.struck(found.epoch),
                          hold=Hold(found.epoch, found.rule, now_s, now_s))
        if not restart:
            return dataclasses.replace(base, state=CaseState.EJECTED,
                                       readmit_after_s=now_s + probation_s)
        if restartable and found.rule in ALIVE_RULES:
            return dataclasses.replace(base, state=CaseState.DRAINING,
                                       drain_reason=found.evidence)
        return dataclasses.replace(base, state=CaseState.HELD_OUT)

    def restart_begun(self, now_s: float) -> WorkerCase:
        """Its restart was asked for at `now_s`: wait for a newer epoch."""
        if self.state is not CaseState.HELD_OUT or self.hold is None:
            raise ValueError(f"{self.worker_id} is {self.state.value}: no restart to begin")
        return dataclasses.replace(self, state=CaseState.RESTARTING,
                                   hold=dataclasses.replace(self.hold, since_s=now_s))

    def recovered(self, epoch: int, on_probation: bool, now_s: float,
                  probation_s: float) -> WorkerCase:
        """Its restart brought `epoch`: admitted at once, or on probation (held out)."""
        if self.state is not CaseState.RESTARTING:
            raise ValueError(f"{self.worker_id} is {self.state.value}: not restarting")
        if not on_probation:
            return self.released()
        return WorkerCase(self.worker_id, self.ledger, CaseState.EJECTED,
                          Hold(epoch, Routine.PROBATION, now_s, now_s),
                          readmit_after_s=now_s + probation_s)

    def released(self) -> WorkerCase:
        """Its ejection is gone: back in routing (its ledger stays)."""
        return WorkerCase(self.worker_id, self.ledger)

    def renewed(self, now_s: float) -> WorkerCase:
        """Its ejection was written to Redis again at `now_s`."""
        if self.hold is None:
            raise ValueError(f"{self.worker_id} is healthy: no ejection to renew")
        return dataclasses.replace(self, hold=dataclasses.replace(self.hold, renewed_s=now_s))

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        healthy = self.state is CaseState.HEALTHY
        ejected = self.state is CaseState.EJECTED
        draining = self.state is CaseState.DRAINING
        if (self.hold is None) != healthy:
            raise AssertionError(f"{self}: a hold exactly while out")
        if (self.readmit_after_s is not None) != ejected:
            raise AssertionError(f"{self}: a re-admission time exactly while ejected")
        if self.healthy_since_s is not None and (not ejected or self.hold is None
                                                 or self.healthy_since_s < self.hold.since_s):
            raise AssertionError(f"{self}: healthy since before it was ejected")
        if (self.drain_reason is not None) != draining:
            raise AssertionError(f"{self}: a drain reason exactly while draining")
        if self.hold is not None:
            if self.hold.rule is Routine.PROBATION and not ejected:
                raise AssertionError(f"{self}: only an ejection is a probation")
            if self.state in (CaseState.DRAINING, CaseState.RESTARTING) and \
                    not isinstance(self.hold.rule, Rule):
                raise AssertionError(f"{self}: restarted for no detection rule")
            if draining and self.hold.rule not in ALIVE_RULES:
                raise AssertionError(f"{self}: drained for {self.hold.rule}")
        if self.ledger.num_strikes < 0:
            raise AssertionError(f"{self}: a negative number of strikes")


# ---------------------------------------------------------------- time and sightings


def advance(case: WorkerCase, seen: Sighting, now_s: float, timing: Timing
            ) -> tuple[WorkerCase, FollowUp | None]:
    """What time and the latest sighting do to `case`, and what the loop must do about it;
    side-effect free. HEALTHY and HELD_OUT cases move only when the agent acts."""
    if case.state is CaseState.DRAINING:
        return _draining(case, seen, now_s, timing)
    if case.state is CaseState.RESTARTING:
        return _restarting(case, seen, now_s, timing)
    if case.state is CaseState.EJECTED:
        return _ejected(case, seen, now_s, timing)
    return case, None


def _draining(case: WorkerCase, seen: Sighting, now_s: float, timing: Timing
              ) -> tuple[WorkerCase, FollowUp | None]:
    """Restarted once it runs nothing, or its drain time is up; not when it went away or was
    replaced meanwhile (nothing left to restart)."""
    hold, last = case.held(), seen.last
    idle = last is not None and last.num_running == 0 and last.num_waiting == 0
    ran_s = now_s - hold.since_s
    if last is not None and last.epoch == hold.epoch and seen.known_epoch is not None \
            and not idle and ran_s < timing.drain_timeout_s:
        return case, None
    held_out = dataclasses.replace(case, state=CaseState.HELD_OUT, drain_reason=None,
                                   hold=dataclasses.replace(hold, since_s=now_s))
    if seen.known_epoch != hold.epoch:
        return held_out, None
    how = "drained" if idle else f"drain cut after {ran_s:.0f} s"
    return held_out, Restart(hold.epoch, how, case.drain_reason or "")


def _restarting(case: WorkerCase, seen: Sighting, now_s: float, timing: Timing
                ) -> tuple[WorkerCase, FollowUp | None]:
    hold = case.held()
    if seen.live_epoch is not None and seen.live_epoch > hold.epoch:
        return case, Recover(seen.live_epoch)
    if now_s - hold.since_s > timing.restart_grace_s:
        held_out = dataclasses.replace(case, state=CaseState.HELD_OUT,
                                       hold=dataclasses.replace(hold, since_s=now_s))
        return held_out, ReportLost(f"no new epoch within {timing.restart_grace_s:g} s")
    return case, None


def _ejected(case: WorkerCase, seen: Sighting, now_s: float, timing: Timing
             ) -> tuple[WorkerCase, FollowUp | None]:
    """Re-admitted once its probation is over and its health checks have passed long
    enough; dropped when its epoch is gone (replaced by a newer one the agent did not
    restart, or gone from the registry): there is nothing left to hold out."""
    hold, last = case.held(), seen.last
    healthy = (last is not None and last.epoch == hold.epoch and last.control_ok
               and last.lease_left_s is not None and last.lease_left_s >= timing.lease_margin_s
               and last.process_alive is not False)
    if not healthy:
        case = dataclasses.replace(case, healthy_since_s=None)
        if last is None or last.epoch != hold.epoch:
            return case, Drop()
        return case, None
    since = now_s if case.healthy_since_s is None else case.healthy_since_s
    case = dataclasses.replace(case, healthy_since_s=since)
    assert case.readmit_after_s is not None  # EJECTED (check_invariants)
    if now_s < case.readmit_after_s or \
            now_s - since < min(timing.probation_s, READMIT_HEALTHY_S):
        return case, None
    if hold.rule is Rule.SLOW and seen.still_slow is not None:
        # Re-admitted, it would get nothing to prove it recovered: its model decides.
        return case, Restrike(seen.still_slow)
    return case, Readmit(f"ejected for {hold.rule.value}; healthy for {now_s - since:.0f} s")

