"""The agent's control loop: observe, detect, decide within the guard rails, act, record.

One tick (every `period_s`, about 1 s):

    observe (agent/observer.py) ─▶ windows of samples per worker (the last `window_s`,
      agent/casebook.py) ─▶ drains end, restarts come back (cases DRAINING, RESTARTING)
      ─▶ detect (agent/health_rules.py) ─▶ plan_actions (agent/guard_rails.py)
      ─▶ act through the actuator (agent/actuator.py) ─▶ audit (agent/audit.py)
    then: probation and re-admission (cases EJECTED), renewal of held ejections, and every
    `rebalance_period_s` one rebalancing decision (agent/rebalance.py); last, the capacity
    plan, root-cause reports and workers' expert switches (agent/capacity_plan.py,
    agent/root_cause_watch.py, agent/expert_watch.py).

What happens to a worker the rules find bad (its case: agent/worker_case.py has the states
and the pure transitions; this loop does the I/O they call for):

    slow, error spike ─▶ EJECTED ──(probation_s, and healthy)──▶ readmitted: HEALTHY
                             └── found bad again in the same epoch (slow: by its own step
                                 model at the probation's end) ─▶ ejected, DRAINING
                                 (until it runs nothing, at most role_drain_timeout_s)
                                 ─▶ RESTARTING
    dead, hung ────────▶ ejected, RESTARTING ──(a newer epoch registers)──▶ EJECTED under
                             probation ──(probation_s of passing health checks)──▶ readmitted
    leaked KV ─────────▶ its old reservations reclaimed (nothing ejected)

A restarted worker's new epoch is held out of routing for its probation only when its
role has another routable worker (else it is admitted at once: an ejection must never
leave a pool empty). Only the agent holding the leader lease in Redis acts; the others
observe. With `dry_run` every decision is recorded with outcome "dry_run" and nothing is
done (nor is the lease taken). Invariants: an action of one kind on one (worker, epoch) runs
at most once per `cooldown_s` (guard_rails, from each case's ledger); every case not
HEALTHY holds one epoch's ejection, renewed in Redis before it lapses; each case is filed
under its worker id and keeps its own invariants (`check_invariants`); at most one role
change runs at a time, as an owned task that stop() cancels.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

from agent.actuator import ActionError, Actuator
from agent.audit import Audit
from agent.capacity_plan import CapacityPlanner, PlanConfig, PoolSizes
from agent.casebook import Casebook
from agent.decision import (Decision, EventAction, EventRule, Outcome, OutcomeKind, RoleSwitch,
                            Routine, parse_rule)
from agent.expert_watch import switch_decisions
from agent.guard_rails import ActionKind, plan_actions
from agent.health_rules import Detection, Thresholds, detect
from agent.observer import Observer
from agent.rebalance import RebalanceConfig
from agent.role_mover import RoleMover, role_views
from agent.root_cause_window import RootCauseConfig
from agent.root_cause_watch import RootCauseWatch
from agent.worker_case import (CaseState, Drop, FollowUp, Readmit, Recover, ReportLost, Restart,
                               Restrike, Timing, WorkerCase, advance)
from protocol.messages import WorkerInfo
from state.agent_state import now_unix_ms
from telemetry.metrics import MetricsRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    period_s: float = 1.0
    window_s: float = 30.0
    thresholds: Thresholds = Thresholds()
    max_eject_fraction: float = 0.5
    cooldown_s: float = 10.0
    probation_s: float = 10.0
    dry_run: bool = False
    rebalance: RebalanceConfig | None = field(default_factory=RebalanceConfig)  # None: off
    rebalance_period_s: float = 10.0
    role_drain_timeout_s: float = 30.0
    restart_grace_s: float = 180.0  # a restarted worker not back by then is reported
    plan: PlanConfig | None = field(default_factory=PlanConfig)  # None: no capacity plan
    root_cause: RootCauseConfig | None = field(default_factory=RootCauseConfig)  # None: off

    def __post_init__(self) -> None:
        if min(self.period_s, self.window_s, self.cooldown_s, self.probation_s,
               self.rebalance_period_s, self.role_drain_timeout_s) <= 0:
            raise ValueError("periods, windows and timeouts must be > 0")
        if self.window_s < 2 * self.period_s:
            raise ValueError("the window must hold at least two periods")

    @property
    def timing(self) -> Timing:
        return Timing(probation_s=self.probation_s, drain_timeout_s=self.role_drain_timeout_s,
                      restart_grace_s=self.restart_grace_s,
                      lease_margin_s=self.thresholds.lease_margin_s)


class ControlLoop:
    def __init__(self, observer: Observer, actuator: Actuator, audit: Audit,
                 config: AgentConfig, metrics: MetricsRegistry,
                 watch: RootCauseWatch | None = None) -> None:
        self.observer = observer
        self.actuator = actuator
        self.audit = audit
        self.config = config
        self.timing = config.timing
        self.agent_id = uuid.uuid4().hex[:12]
        self.casebook = Casebook(config.window_s, config.thresholds)
        self.planner = None if config.plan is None else CapacityPlanner(config.plan)
        self.mover = None if config.rebalance is None else RoleMover(
            actuator, self._record_one, config.rebalance, config.rebalance_period_s,
            config.role_drain_timeout_s, config.dry_run, self.planner)
        self.is_leader = False
        self.ticks = metrics.counter("pdserve_agent_ticks_total", "control loop ticks, by result",
                                     ("result",))
        self.num_ejected = metrics.gauge("pdserve_agent_ejected_workers",
                                         "workers the agent keeps out of routing now")
        self.leader = metrics.gauge("pdserve_agent_leader", "1 while this agent acts")
        self.tick_seconds = metrics.histogram("pdserve_agent_tick_seconds",
                                              "one control loop tick")
        self.watch = watch  # root-cause reports (None: none)
        self.desired_workers = metrics.gauge(
            "pdserve_agent_desired_workers",
            "workers the forecast demand needs, by role (prefill, decode; total: workers "
            "that do both); what an autoscaler scales on (agent/capacity_plan.py)", ("role",))
        self.demand_forecast = metrics.gauge(
            "pdserve_agent_demand_forecast",
            "the demand forecast one plan horizon ahead, by signal", ("signal",))

    @property
    def out_ids(self) -> frozenset[str]:
        """The workers the agent holds out of routing now."""
        return self.casebook.out_ids

    def check_invariants(self) -> None:
        self.casebook.check_invariants()
        if self.watch is not None:
            self.watch.check_invariants()

    async def adopt(self) -> None:
        """Take over the ejections a previous agent left (after a restart of the agent)."""
        now = time.monotonic()
        for worker_id, entry in (await self.actuator.agent_state.read_ejected()).items():
            rule = parse_rule(entry.rule)
            if rule is None:  # not written by an agent: it lapses by itself, unrenewed
                log.warning("not adopting the ejection of %s: rule %r is not the agent's",
                            worker_id, entry.rule)
                continue
            self.casebook.file(WorkerCase.adopted(worker_id, entry.epoch, rule, now,
                                                  self.config.probation_s))

    async def stop(self) -> None:
        if self.mover is not None:
            await self.mover.stop()

    async def tick(self) -> list[Decision]:
        started = time.perf_counter()
        observed = await self.observer.observe()
        now = time.monotonic()
        self.casebook.remember(observed, self.observer.registry, now)
        # A dry run acts on nothing, so it never needs (nor takes) the leader lease.
        self.is_leader = self.config.dry_run or await self.actuator.agent_state.lead(
            self.agent_id, int(max(5.0, 5 * self.config.period_s) * 1000))
        self.leader.set(1 if self.is_leader else 0)
        decisions: list[Decision] = []
        if self.is_leader:
            decisions += await self._finish_drains(now)
            decisions += await self._follow_restarts(now)
            decisions += await self._act(now)
            decisions += await self._probation(now)
            await self._renew(now)
            decisions += await self._record(switch_decisions(self.observer.expert_switches))
            if self.mover is not None:
                await self.mover.tick(self.observer.registry, self.out_ids, now,
                                      self.config.window_s)
        if self.planner is not None:
            self._plan(now)
        reports = [] if self.watch is None else await self.watch.tick(
            now, observed, self.observer.reports, self.casebook.held_rules)
        for report in reports if self.is_leader else []:  # every agent keeps the windows
            await self.audit.report(report)
        self.num_ejected.set(len(self.out_ids))
        self.tick_seconds.observe(time.perf_counter() - started)
        self.ticks.inc(result="leader" if self.is_leader else "standby")
        return decisions

    def _plan(self, now: float) -> None:
        """The capacity plan after this tick's loads, published as gauges (every agent
        publishes it, leader or not: it acts on nothing)."""
        assert self.planner is not None
        before = self.planner.desired
        desired = self.planner.observe(role_views(self.observer.registry, self.out_ids), now)
        ahead = self.planner.ahead
        if ahead is not None:
            for signal in ("prefill_tokens_per_s", "num_decoding", "num_kv_blocks"):
                self.demand_forecast.set(getattr(ahead, signal), signal=signal)
        for role in ("prefill", "decode", "total"):
            self.desired_workers.set(getattr(desired, role), role=role)
        if before is None or _counts(before) != _counts(desired):
            log.info("capacity plan: %d prefill, %d decode (or %d doing both) workers "
                     "needed; %s", desired.prefill, desired.decode, desired.total,
                     desired.reason)

    def _decision(self, worker_id: str, epoch: int, rule: EventRule, evidence: str,
                  action: EventAction | RoleSwitch, outcome: Outcome) -> Decision:
        return Decision(now_unix_ms(), worker_id, epoch, rule, evidence, action,
                        self._dry(outcome))

    def _dry(self, outcome: Outcome) -> Outcome:
        """What a dry run records instead: everything it would have done is `dry_run`."""
        if self.config.dry_run and outcome.kind is not OutcomeKind.HELD:
            return Outcome(OutcomeKind.DRY_RUN)
        return outcome

    async def _record(self, decisions: list[Decision]) -> list[Decision]:
        return [d for d in decisions if await self.audit.record(d)]

    async def _record_one(self, decision: Decision) -> None:
        await self.audit.record(dataclasses.replace(decision,
                                                    outcome=self._dry(decision.outcome)))

    async def _act(self, now: float) -> list[Decision]:
        detections = detect(self.casebook.windows, now, self.config.thresholds)
        state = self.casebook.pool_state(self.observer.registry)
        unhandled = self.casebook.unhandled(detections)
        actions, held = plan_actions(unhandled, state, now, self.config.max_eject_fraction,
                                     self.config.cooldown_s)
        decisions = [self._decision(h.detection.worker_id, h.detection.epoch, h.detection.rule,
                                    h.detection.evidence, EventAction.HOLD,
                                    Outcome.held(h.reason)) for h in held]
        for action in actions:
            self.casebook.stamp(action.worker_id, action.epoch, action.kind, now)
            decisions.append(await self._do(action.kind, action.because, now))
        return await self._record(decisions)

    async def _do(self, kind: ActionKind, found: Detection, now: float) -> Decision:
        worker, epoch = found.worker_id, found.epoch
        info = self.casebook.infos.get(worker)

        def decided(outcome: Outcome) -> Decision:
            return self._decision(worker, epoch, found.rule, found.evidence,
                                  EventAction.of(kind), outcome)

        if kind is ActionKind.RECLAIM_KV:
            if self.config.dry_run or info is None:
                return decided(Outcome.done() if info else
                               Outcome.failed("no control URL known"))
            try:
                num = await self.actuator.reclaim(info, self.config.thresholds.leak_after_s)
            except ActionError as exc:
                return decided(Outcome.failed(str(exc)))
            return decided(Outcome.done(f"{num} reservation(s) freed"))
        if self.config.dry_run:
            return decided(Outcome(OutcomeKind.DRY_RUN))
        restart = kind is ActionKind.EJECT_AND_RESTART
        steps = []
        try:
            await self.actuator.eject(worker, epoch, found.rule, found.evidence)
            steps.append(Outcome.done("ejected"))
        except ActionError as exc:
            steps.append(Outcome.failed(f"not ejected ({exc})"))
        case = self.casebook.case(worker, epoch).struck(found, restart, info is not None, now,
                                                        self.config.probation_s)
        self.casebook.file(case)
        if case.state is CaseState.DRAINING:
            steps.append(Outcome.done(f"draining before its restart (at most "
                                      f"{self.config.role_drain_timeout_s:g} s)"))
        elif restart and info is not None:
            steps.append(await self._restart(info, found.evidence, now))
        elif restart:
            steps.append(Outcome.failed("not restarted (no pid or control URL known)"))
        return decided(Outcome.joined(steps))

    async def _restart(self, info: WorkerInfo, reason: str, now: float) -> Outcome:
        try:
            done = await self.actuator.restart(info, reason)
        except ActionError as exc:
            return Outcome.failed(f"not restarted ({exc})")
        self.casebook.file(self.casebook.cases[info.worker_id].restart_begun(now))
        return Outcome.done(done)

    def _advance(self, case: WorkerCase, now: float) -> tuple[WorkerCase, FollowUp | None]:
        """The case as time and the latest sighting leave it (filed), and what to do now."""
        case, follow = advance(case, self.casebook.sighting(case, self.observer.registry), now,
                               self.timing)
        self.casebook.file(case)
        return case, follow

    async def _finish_drains(self, now: float) -> list[Decision]:
        """Restart each draining worker once it runs nothing, or its drain time is up."""
        decisions = []
        for case in self.casebook.in_state(CaseState.DRAINING):
            case, follow = self._advance(case, now)
            if isinstance(follow, Restart):  # its registry entry is of the drained epoch
                info = self.casebook.infos[case.worker_id]
                outcome = await self._restart(info, follow.reason, now)
                decisions.append(self._decision(case.worker_id, follow.epoch, Routine.RESTART,
                                                f"{follow.how}; {follow.reason}",
                                                EventAction.RESTART, outcome))
        return await self._record(decisions)

    async def _follow_restarts(self, now: float) -> list[Decision]:
        """A restarted worker that registered a newer epoch: its old ejection goes, and the
        new epoch starts its probation (held out of routing if its pool can spare it)."""
        decisions = []
        for case in self.casebook.in_state(CaseState.RESTARTING):
            worker_id, old_epoch = case.worker_id, case.held().epoch
            case, follow = self._advance(case, now)
            if isinstance(follow, ReportLost):
                decisions.append(self._decision(worker_id, old_epoch, Routine.RESTART,
                                                follow.evidence, EventAction.WAIT,
                                                Outcome.failed("not back; see its log")))
            elif isinstance(follow, Recover):
                info = self.observer.registry.workers[worker_id]
                decisions.append(await self._recover(case, old_epoch, info, now))
        return await self._record(decisions)

    async def _recover(self, case: WorkerCase, old_epoch: int, info: WorkerInfo,
                       now: float) -> Decision:
        probation_s = self.config.probation_s
        try:
            await self.actuator.readmit(info.worker_id, old_epoch)
        except ActionError as exc:
            log.warning("could not drop the old ejection of %s: %s", info.worker_id, exc)
        on_probation = False
        if self._pool_can_spare(info):
            try:
                await self.actuator.eject(info.worker_id, info.epoch, Routine.PROBATION,
                                          f"restarted; on probation for {probation_s:g} s")
                on_probation = True
                outcome = Outcome.done(f"on probation for {probation_s:g} s")
            except ActionError as exc:
                outcome = Outcome.done(f"admitted at once ({exc})")
        else:
            outcome = Outcome.done("admitted at once (no other routable worker of its role)")
        self.casebook.file(case.recovered(info.epoch, on_probation, now, probation_s))
        return self._decision(info.worker_id, info.epoch, Routine.RESTART,
                              f"epoch {old_epoch} replaced by epoch {info.epoch} "
                              f"(pid {info.pid})", EventAction.RECOVERED, outcome)

    def _pool_can_spare(self, info: WorkerInfo) -> bool:
        out = self.out_ids
        routable = [w for w in self.observer.registry.workers.values()
                    if w.role == info.role and w.worker_id != info.worker_id
                    and not w.draining and w.worker_id not in out]
        return bool(routable)

    async def _probation(self, now: float) -> list[Decision]:
        """Re-admit ejected workers whose probation is over and whose health checks pass."""
        decisions = []
        for case in self.casebook.in_state(CaseState.EJECTED):
            worker_id, epoch = case.worker_id, case.held().epoch
            case, follow = self._advance(case, now)
            if isinstance(follow, Drop):
                try:
                    await self.actuator.readmit(worker_id, epoch)
                except ActionError:
                    continue  # tried again next tick
                self.casebook.file(case.released())
            elif isinstance(follow, Restrike):
                self.casebook.stamp(worker_id, epoch, ActionKind.EJECT_AND_RESTART, now)
                decisions.append(await self._do(ActionKind.EJECT_AND_RESTART, follow.found,
                                                now))
            elif isinstance(follow, Readmit):
                decisions.append(await self._readmit(case, epoch, follow.evidence))
        return await self._record(decisions)

    async def _readmit(self, case: WorkerCase, epoch: int, evidence: str) -> Decision:
        try:
            if not self.config.dry_run:
                await self.actuator.readmit(case.worker_id, epoch)
        except ActionError as exc:
            return self._decision(case.worker_id, epoch, Routine.PROBATION,
                                  "health checks pass", EventAction.READMIT,
                                  Outcome.failed(str(exc)))
        self.casebook.file(case.released())
        return self._decision(case.worker_id, epoch, Routine.PROBATION, evidence,
                              EventAction.READMIT, Outcome.done())

    async def _renew(self, now: float) -> None:
        """Keep each ejection this agent holds from lapsing in Redis."""
        every = self.actuator.eject_hold_s / 3
        for case in list(self.casebook.cases.values()):
            hold = case.hold
            if hold is None or now - hold.renewed_s < every or self.config.dry_run:
                continue
            try:
                await self.actuator.eject(case.worker_id, hold.epoch, hold.rule, "renewed")
                self.casebook.file(case.renewed(now))
            except ActionError as exc:
                log.warning("could not renew the ejection of %s: %s", case.worker_id, exc)


def _counts(sizes: PoolSizes) -> tuple[int, int, int]:
    return sizes.prefill, sizes.decode, sizes.total
