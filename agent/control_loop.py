"""The agent's control loop: observe, detect, decide within the guard rails, act, record.

One tick (every `period_s`, about 1 s):

    observe (agent/observer.py) ─▶ windows of samples per worker (the last `window_s`)
      ─▶ detect (agent/health_rules.py) ─▶ plan_actions (agent/guard_rails.py)
      ─▶ act through the actuator (agent/actuator.py) ─▶ audit (agent/audit.py)
    then: probation and re-admission, renewal of held ejections, and every
    `rebalance_period_s` one rebalancing decision (agent/rebalance.py).

What happens to a worker the rules find bad:

    slow, error spike ─▶ EJECTED ──(probation_s, and healthy)──▶ readmitted
                             └── found bad again in the same epoch (slow: by its own step
                                 model at the probation's end) ─▶ ejected, DRAINING
                                 (until it runs nothing, at most role_drain_timeout_s)
                                 ─▶ restarted
    dead, hung ────────▶ EJECTED + restarted ──(a newer epoch registers)──▶ ON PROBATION
                             ──(probation_s of passing health checks)──▶ readmitted
    leaked KV ─────────▶ its old reservations reclaimed (nothing ejected)

A restarted worker's new epoch is held out of routing for its probation only when its
role has another routable worker (else it is admitted at once: an ejection must never
leave a pool empty). Only the agent holding the leader lease in Redis acts; the others
observe. With `dry_run` every decision is recorded with outcome "dry_run" and nothing is
done (nor is the lease taken). Invariants: an action of one kind on one (worker, epoch) runs
at most once per `cooldown_s` (guard_rails); the agent's own ejections (`ejected`) are all of
live-or-lapsed epochs it saw, each renewed in Redis before it lapses; at most one role
change runs at a time, as an owned task that stop() cancels.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from agent.actuator import ActionError, Actuator
from agent.audit import Audit
from agent.guard_rails import ActionKind, PoolState, plan_actions
from agent.health_rules import (Detection, Rule, Thresholds, WorkerSample, detect, latest_tick,
                                still_slow)
from agent.observer import Observer
from agent.rebalance import RebalanceConfig
from agent.role_mover import RoleMover
from protocol.messages import WorkerInfo
from state.agent_state import AgentEvent, now_unix_ms
from telemetry.metrics import MetricsRegistry

log = logging.getLogger(__name__)
PROBATION = "probation"


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

    def __post_init__(self) -> None:
        if min(self.period_s, self.window_s, self.cooldown_s, self.probation_s,
               self.rebalance_period_s, self.role_drain_timeout_s) <= 0:
            raise ValueError("periods, windows and timeouts must be > 0")
        if self.window_s < 2 * self.period_s:
            raise ValueError("the window must hold at least two periods")


@dataclass(slots=True)
class Ejected:
    """One of the agent's own ejections."""

    epoch: int
    rule: str
    at_s: float
    readmit_after_s: float | None  # None: restarting (re-admitted as a new epoch)
    renewed_s: float
    healthy_since_s: float | None = None


class ControlLoop:
    def __init__(self, observer: Observer, actuator: Actuator, audit: Audit,
                 config: AgentConfig, metrics: MetricsRegistry) -> None:
        self.observer = observer
        self.actuator = actuator
        self.audit = audit
        self.config = config
        self.agent_id = uuid.uuid4().hex[:12]
        self.windows: dict[str, deque[WorkerSample]] = {}
        self.infos: dict[str, WorkerInfo] = {}  # last seen, so a lapsed worker can be restarted
        self.ejected: dict[str, Ejected] = {}
        self.restarting: dict[str, tuple[int, float]] = {}  # worker -> (old epoch, when)
        # worker -> (epoch, since, evidence): ejected, restarted once it runs nothing
        self.draining: dict[str, tuple[int, float, str]] = {}
        self.strikes: dict[tuple[str, int], int] = {}
        self.last_action_s: dict[tuple[str, int, ActionKind], float] = {}
        self.mover = None if config.rebalance is None else RoleMover(
            actuator, self._record_one, config.rebalance, config.rebalance_period_s,
            config.role_drain_timeout_s, config.dry_run)
        self.is_leader = False
        self.ticks = metrics.counter("pdserve_agent_ticks_total", "control loop ticks, by result",
                                     ("result",))
        self.num_ejected = metrics.gauge("pdserve_agent_ejected_workers",
                                         "workers the agent keeps out of routing now")
        self.leader = metrics.gauge("pdserve_agent_leader", "1 while this agent acts")
        self.tick_seconds = metrics.histogram("pdserve_agent_tick_seconds",
                                              "one control loop tick")

    # ---------------------------------------------------------------- lifecycle

    async def adopt(self) -> None:
        """Take over the ejections a previous agent left (after a restart of the agent)."""
        now = time.monotonic()
        for worker_id, entry in (await self.actuator.agent_state.read_ejected()).items():
            readmit = now + self.config.probation_s
            self.ejected[worker_id] = Ejected(entry.epoch, entry.rule, now, readmit, now)

    async def stop(self) -> None:
        if self.mover is not None:
            await self.mover.stop()

    # ---------------------------------------------------------------- one tick

    async def tick(self) -> list[AgentEvent]:
        started = time.perf_counter()
        samples = await self.observer.observe()
        now = time.monotonic()
        self._remember(samples, now)
        # A dry run acts on nothing, so it never needs (nor takes) the leader lease.
        self.is_leader = self.config.dry_run or await self.actuator.agent_state.lead(
            self.agent_id, int(max(5.0, 5 * self.config.period_s) * 1000))
        self.leader.set(1 if self.is_leader else 0)
        events: list[AgentEvent] = []
        if self.is_leader:
            events += await self._finish_drains(now)
            events += await self._follow_restarts(now)
            events += await self._act(now)
            events += await self._probation(now)
            await self._renew(now)
            if self.mover is not None:
                await self.mover.tick(self.observer.registry, self.ejected, now,
                                      self.config.window_s)
        self.num_ejected.set(len(self.ejected))
        self.tick_seconds.observe(time.perf_counter() - started)
        self.ticks.inc(result="leader" if self.is_leader else "standby")
        return events

    def _remember(self, samples: list[WorkerSample], now: float) -> None:
        registry = self.observer.registry
        self.infos.update(registry.workers)
        for sample in samples:
            window = self.windows.setdefault(sample.worker_id, deque())
            if sample.epoch == 0 and window:  # lapsed: carry the epoch it had
                sample = dataclasses.replace(sample, epoch=window[-1].epoch,
                                             role=window[-1].role)
            window.append(sample)
            while window and window[0].at_s < now - self.config.window_s:
                window.popleft()
        registered = set(registry.registered_ids)
        for worker_id in set(self.windows) - registered:
            del self.windows[worker_id]
        for worker_id in set(self.infos) - registered:
            if worker_id not in self.restarting:
                del self.infos[worker_id]

    def _event(self, worker_id: str, epoch: int, rule: str, evidence: str, action: str,
               outcome: str) -> AgentEvent:
        if self.config.dry_run and not outcome.startswith("held"):
            outcome = "dry_run"
        return AgentEvent(at_unix_ms=now_unix_ms(), worker_id=worker_id, epoch=epoch,
                          rule=rule, evidence=evidence, action=action, outcome=outcome)

    async def _record(self, events: list[AgentEvent]) -> list[AgentEvent]:
        return [e for e in events if await self.audit.record(e)]

    async def _record_one(self, worker_id: str, epoch: int, rule: str, evidence: str,
                          action: str, outcome: str) -> None:
        await self.audit.record(self._event(worker_id, epoch, rule, evidence, action, outcome))

    # ---------------------------------------------------------------- detection -> action

    async def _act(self, now: float) -> list[AgentEvent]:
        detections = detect(self.windows, now, self.config.thresholds)
        registry = self.observer.registry
        epochs = {w: i.epoch for w, i in registry.workers.items()}
        roles = {w: i.role.value for w, i in registry.workers.items()}
        for worker_id, window in self.windows.items():
            if worker_id not in roles and window:
                epochs[worker_id], roles[worker_id] = window[-1].epoch, window[-1].role
        state = PoolState(epochs=epochs, roles=roles, ejected=frozenset(self.ejected),
                          last_action_s=self.last_action_s, strikes=self.strikes)
        actions, held = plan_actions(self._unhandled(detections), state, now,
                                     self.config.max_eject_fraction, self.config.cooldown_s)
        events = [self._event(h.detection.worker_id, h.detection.epoch, h.detection.rule.value,
                              h.detection.evidence, "hold", f"held: {h.reason}") for h in held]
        for action in actions:
            self.last_action_s[(action.worker_id, action.epoch, action.kind)] = now
            events.append(await self._do(action.kind, action.because, now))
        return await self._record(events)

    def _unhandled(self, detections: list[Detection]) -> list[Detection]:
        """The detections the agent is not handling already."""
        out = []
        for found in detections:
            if found.worker_id in self.restarting or found.worker_id in self.draining:
                continue  # its restart is under way
            mine = self.ejected.get(found.worker_id)
            if mine is not None and mine.epoch == found.epoch and mine.readmit_after_s \
                    is not None and found.rule in (Rule.SLOW, Rule.ERROR_SPIKE):
                continue  # out already, on probation: judged when it ends
            out.append(found)
        return out

    async def _do(self, kind: ActionKind, found: Detection, now: float) -> AgentEvent:
        worker, epoch, rule = found.worker_id, found.epoch, found.rule.value
        info = self.infos.get(worker)
        if kind is ActionKind.RECLAIM_KV:
            if self.config.dry_run or info is None:
                return self._event(worker, epoch, rule, found.evidence, "reclaim",
                                   "done" if info else "failed: no control URL known")
            try:
                num = await self.actuator.reclaim(info, self.config.thresholds.leak_after_s)
            except ActionError as exc:
                return self._event(worker, epoch, rule, found.evidence, "reclaim",
                                   f"failed: {exc}")
            return self._event(worker, epoch, rule, found.evidence, "reclaim",
                               f"done: {num} reservation(s) freed")
        restart = kind is ActionKind.EJECT_AND_RESTART
        action = "eject+restart" if restart else "eject"
        if self.config.dry_run:
            return self._event(worker, epoch, rule, found.evidence, action, "dry_run")
        outcome = []
        try:
            await self.actuator.eject(worker, epoch, rule, found.evidence)
            outcome.append("ejected")
        except ActionError as exc:
            outcome.append(f"not ejected ({exc})")
        self.strikes[(worker, epoch)] = self.strikes.get((worker, epoch), 0) + 1
        readmit = None if restart else now + self.config.probation_s
        self.ejected[worker] = Ejected(epoch, rule, now, readmit, now)
        if restart and info is None:
            outcome.append("not restarted (no pid or control URL known)")
        elif restart and found.rule in (Rule.SLOW, Rule.ERROR_SPIKE):
            # Alive and answering: let what it runs finish first (it gets nothing new).
            self.draining[worker] = (epoch, now, found.evidence)
            outcome.append(f"draining before its restart (at most "
                           f"{self.config.role_drain_timeout_s:g} s)")
        elif restart:
            assert info is not None
            outcome.append(await self._restart(info, epoch, found.evidence, now))
        failed = any(o.startswith("not ") for o in outcome)
        return self._event(worker, epoch, rule, found.evidence, action,
                           ("failed: " if failed else "done: ") + "; ".join(outcome))

    async def _restart(self, info: WorkerInfo, epoch: int, evidence: str, now: float) -> str:
        try:
            outcome = await self.actuator.restart(info, evidence)
        except ActionError as exc:
            return f"not restarted ({exc})"
        self.restarting[info.worker_id] = (epoch, now)
        return outcome

    async def _finish_drains(self, now: float) -> list[AgentEvent]:
        """Restart each draining worker once it runs nothing, or its drain time is up."""
        events = []
        for worker_id, (epoch, since, evidence) in list(self.draining.items()):
            window = self.windows.get(worker_id)
            last = window[-1] if window else None
            info = self.infos.get(worker_id)
            idle = last is not None and last.num_running == 0 and last.num_waiting == 0
            if last is not None and last.epoch == epoch and info is not None and not idle \
                    and now - since < self.config.role_drain_timeout_s:
                continue
            del self.draining[worker_id]
            if info is None or info.epoch != epoch:
                continue  # gone, or replaced meanwhile: nothing left to restart
            outcome = await self._restart(info, epoch, evidence, now)
            how = "drained" if idle else f"drain cut after {now - since:.0f} s"
            events.append(self._event(worker_id, epoch, "restart", f"{how}; {evidence}",
                                      "restart", ("failed: " if outcome.startswith("not ")
                                                  else "done: ") + outcome))
        return await self._record(events)

    # ---------------------------------------------------------------- recovery

    async def _follow_restarts(self, now: float) -> list[AgentEvent]:
        """A restarted worker that registered a newer epoch: its old ejection goes, and the
        new epoch starts its probation (held out of routing if its pool can spare it)."""
        events = []
        live = self.observer.registry.workers
        for worker_id, (old_epoch, since) in list(self.restarting.items()):
            info = live.get(worker_id)
            if info is None or info.epoch <= old_epoch:
                if now - since > self.config.restart_grace_s:
                    del self.restarting[worker_id]
                    events.append(self._event(worker_id, old_epoch, "restart", "no new epoch "
                                              f"within {self.config.restart_grace_s:g} s",
                                              "wait", "failed: not back; see its log"))
                continue
            del self.restarting[worker_id]
            evidence = f"epoch {old_epoch} replaced by epoch {info.epoch} (pid {info.pid})"
            try:
                await self.actuator.readmit(worker_id, old_epoch)
            except ActionError as exc:
                log.warning("could not drop the old ejection of %s: %s", worker_id, exc)
            self.ejected.pop(worker_id, None)
            if self._pool_can_spare(info):
                try:
                    await self.actuator.eject(worker_id, info.epoch, PROBATION,
                                              f"restarted; on probation for "
                                              f"{self.config.probation_s:g} s")
                    self.ejected[worker_id] = Ejected(info.epoch, PROBATION, now,
                                                      now + self.config.probation_s, now)
                    outcome = f"done: on probation for {self.config.probation_s:g} s"
                except ActionError as exc:
                    outcome = f"done: admitted at once ({exc})"
            else:
                outcome = "done: admitted at once (no other routable worker of its role)"
            events.append(self._event(worker_id, info.epoch, "restart", evidence, "recovered",
                                      outcome))
        return await self._record(events)

    def _pool_can_spare(self, info: WorkerInfo) -> bool:
        routable = [w for w in self.observer.registry.workers.values()
                    if w.role == info.role and w.worker_id != info.worker_id
                    and not w.draining and w.worker_id not in self.ejected]
        return bool(routable)

    async def _probation(self, now: float) -> list[AgentEvent]:
        """Re-admit ejected workers whose probation is over and whose health checks pass."""
        events = []
        margin = self.config.thresholds.lease_margin_s
        for worker_id, mine in list(self.ejected.items()):
            if mine.readmit_after_s is None:
                continue  # restarting: re-admitted as its new epoch
            window = self.windows.get(worker_id)
            last = window[-1] if window else None
            healthy = (last is not None and last.epoch == mine.epoch and last.control_ok
                       and last.lease_left_s is not None and last.lease_left_s >= margin
                       and last.process_alive is not False)
            if not healthy:
                mine.healthy_since_s = None
                if last is None or last.epoch != mine.epoch:
                    # Replaced by a newer epoch we did not restart, or gone: nothing to hold.
                    await self._drop_ejection(worker_id, mine)
                continue
            if mine.healthy_since_s is None:
                mine.healthy_since_s = now
            if now < mine.readmit_after_s or \
                    now - mine.healthy_since_s < min(self.config.probation_s, 3.0):
                continue
            found = still_slow(window or (), latest_tick(self.windows), self.config.thresholds) \
                if mine.rule == Rule.SLOW.value else None
            if found is not None:  # readmitted, it would get nothing to prove it recovered
                self.last_action_s[(worker_id, mine.epoch, ActionKind.EJECT_AND_RESTART)] = now
                events.append(await self._do(ActionKind.EJECT_AND_RESTART, found, now))
                continue
            outcome = "dry_run" if self.config.dry_run else "done"
            try:
                if not self.config.dry_run:
                    await self.actuator.readmit(worker_id, mine.epoch)
            except ActionError as exc:
                events.append(self._event(worker_id, mine.epoch, PROBATION, "health checks "
                                          "pass", "readmit", f"failed: {exc}"))
                continue
            del self.ejected[worker_id]
            events.append(self._event(worker_id, mine.epoch, PROBATION,
                                      f"ejected for {mine.rule}; healthy for "
                                      f"{now - mine.healthy_since_s:.0f} s", "readmit",
                                      outcome))
        return await self._record(events)

    async def _drop_ejection(self, worker_id: str, mine: Ejected) -> None:
        try:
            await self.actuator.readmit(worker_id, mine.epoch)
        except ActionError:
            return  # tried again next tick
        self.ejected.pop(worker_id, None)

    async def _renew(self, now: float) -> None:
        """Keep each ejection this agent holds from lapsing in Redis."""
        every = self.actuator.eject_hold_s / 3
        for worker_id, mine in self.ejected.items():
            if now - mine.renewed_s < every or self.config.dry_run:
                continue
            try:
                await self.actuator.eject(worker_id, mine.epoch, mine.rule, "renewed")
                mine.renewed_s = now
            except ActionError as exc:
                log.warning("could not renew the ejection of %s: %s", worker_id, exc)
