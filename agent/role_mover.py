"""Rebalancing in the agent: the pools' signals over time, and at most one role change at
a time, decided by agent/rebalance.py's pure policy and carried out through the actuator.

Every tick `observe()` appends one `PoolSignals` (the history the policy reads); every
`period_s` `maybe_move()` asks the policy for a move (and, when it asks for none, the
capacity plan's split: agent/planned_move.py) and, if there is one, starts the role
change as an owned task (a drain takes seconds and must not stall the health checks). A
worker whose process cannot change role (404 on /internal/role: an older build) is
remembered per epoch and never chosen again. Invariant: at most one role-change task
exists; stop() cancels and awaits it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Collection

from agent.actuator import ActionError, Actuator
from agent.capacity_plan import CapacityPlanner
from agent.decision import Decision, Outcome, OutcomeKind, RoleSwitch, Routine
from agent.planned_move import plan_ahead
from agent.rebalance import (PoolSignals, RebalanceConfig, RoleMove, RoleView, plan_rebalance,
                             pool_signals)
from protocol.messages import WorkerInfo
from protocol.worker_load import WorkerLoad
from state.agent_state import now_unix_ms
from state.redis_state import Registry

Recorder = Callable[[Decision], Awaitable[None]]  # into the audit trail


def role_views(registry: Registry, out: Collection[str]) -> list[RoleView]:
    """Every registered worker as the pool policies see it (those in `out`, and draining
    ones, marked ejected)."""
    return [RoleView(worker_id=w, epoch=i.epoch, role=i.role,
                     load=registry.loads[w].load if w in registry.loads else WorkerLoad(),
                     ejected=w in out or i.draining)
            for w, i in sorted(registry.workers.items())]


class RoleMover:
    def __init__(self, actuator: Actuator, record: Recorder, config: RebalanceConfig,
                 period_s: float, drain_timeout_s: float, dry_run: bool,
                 planner: CapacityPlanner | None = None) -> None:
        """`planner`: the capacity plan whose split a move follows ahead of pressure
        (agent/planned_move.py), when the pools' signals ask for none; None: react only."""
        self.actuator = actuator
        self.record = record
        self.config = config
        self.period_s = period_s
        self.drain_timeout_s = drain_timeout_s
        self.dry_run = dry_run
        self.planner = planner
        self.history: deque[PoolSignals] = deque()
        self.last_move_s: float | None = None
        self._last_decision_s: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def tick(self, registry: Registry, out: Collection[str], now: float,
                   window_s: float) -> None:
        views = role_views(registry, out)
        self.history.append(pool_signals(views, now))
        keep_s = max(window_s, 2 * self.config.sustain_s)
        while self.history and self.history[0].at_s < now - keep_s:
            self.history.popleft()
        if self._last_decision_s is not None and now - self._last_decision_s < self.period_s:
            return
        if self._task is not None and not self._task.done():
            return  # one role change at a time
        self._last_decision_s = now
        move = plan_rebalance(list(self.history), views, self.last_move_s, now, self.config)
        if move is None and self.planner is not None and self.planner.config.act:
            move = plan_ahead(self.planner.desired, views, self.last_move_s, now, self.config)
        if move is None:
            return
        self.last_move_s = now
        await self.record(_decision(move, move.worker_id, move.epoch, Outcome(
            OutcomeKind.DRY_RUN if self.dry_run else OutcomeKind.STARTED)))
        if not self.dry_run:
            self._task = asyncio.create_task(self._switch(registry.workers[move.worker_id],
                                                          move),
                                             name=f"role-change-{move.worker_id}")

    async def _switch(self, info: WorkerInfo, move: RoleMove) -> None:
        try:
            epoch = await self.actuator.switch_role(info, move.to_role, self.drain_timeout_s)
            outcome = Outcome.done(f"serving as {move.to_role.value} in epoch {epoch}")
        except ActionError as exc:
            outcome = Outcome.failed(str(exc))
        await self.record(_decision(move, info.worker_id, info.epoch, outcome))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _decision(move: RoleMove, worker_id: str, epoch: int, outcome: Outcome) -> Decision:
    return Decision(now_unix_ms(), worker_id, epoch, Routine.REBALANCE, move.reason,
                    RoleSwitch(move.from_role, move.to_role), outcome)
