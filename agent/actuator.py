"""Every action the agent takes on the cluster, behind one interface.

    eject(worker, epoch, rule, reason)   the registry's ejection list (the gateway routes
                                         nothing new there from its next poll, 0.25 s);
                                         renewing is the same call; fenced by epoch
    readmit(worker, epoch)               drop that ejection (a newer one stays)
    restart(info, reason)                agent/restarters.py, by deployment kind; never
                                         for an id that is no worker id
    reclaim(info, older_than_s)          a ReclaimRequest: leaked reservations
    switch_role(info, role)              a RoleChangeRequest: drain, then a new epoch

Calls reach the workers over their channels (rpc/), like the gateway's.

Each is idempotent (ejecting an ejected worker renews it; restarting a worker that is gone
reports so; reclaiming twice frees nothing more) and has a deadline; failures raise
ActionError with a one-line reason for the audit log. Rate limits and the guard rails are
the caller's (agent/guard_rails.py and the control loop): this module only acts.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from agent.decision import EventRule
from agent.restarters import Restarter, RestartError
from protocol.agent_messages import ReclaimRequest, ReclaimResponse
from protocol.messages import (Message, Role, RoleChangeRequest, RoleChangeResponse, WorkerInfo,
                               is_worker_id)
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.errors import ControlError
from state.agent_state import AgentState, Ejection, now_unix_ms
from state.redis_state import REDIS_FAILURES, StaleEpochError, raise_if_cancelling

R = TypeVar("R", bound=Message)


class ActionError(RuntimeError):
    """An action did not go through; the message is the audit log's one-line reason."""


@contextlib.asynccontextmanager
async def _redis(what: str) -> AsyncIterator[None]:
    """A Redis failure inside becomes an ActionError naming `what` did not go through."""
    try:
        yield
    except REDIS_FAILURES as exc:
        raise_if_cancelling(exc)
        raise ActionError(f"Redis did not take {what}: {exc!r}") from None


class Actuator:
    def __init__(self, agent_state: AgentState, restarter: Restarter,
                 channels: ChannelPool, eject_hold_s: float = 300.0,
                 control_timeout_s: float = 5.0) -> None:
        self.agent_state = agent_state
        self.restarter = restarter
        self.channels = channels
        self.eject_hold_s = eject_hold_s
        self.control_timeout_s = control_timeout_s

    async def eject(self, worker_id: str, epoch: int, rule: EventRule, reason: str) -> None:
        now = now_unix_ms()
        entry = Ejection(worker_id=worker_id, epoch=epoch, rule=rule.value, reason=reason[:1000],
                         at_unix_ms=now, until_unix_ms=now + int(self.eject_hold_s * 1000))
        async with _redis("the ejection"):
            try:
                await self.agent_state.eject(entry)
            except StaleEpochError as exc:
                raise ActionError(str(exc)) from None

    async def readmit(self, worker_id: str, epoch: int) -> bool:
        async with _redis("the re-admission"):
            return await self.agent_state.readmit(worker_id, epoch)

    async def restart(self, info: WorkerInfo, reason: str) -> str:
        if not is_worker_id(info.worker_id):  # `gateway`, `redis`, ...: never restarted
            raise ActionError(f"{info.worker_id[:200]!r} is not a worker id: not restarted")
        try:
            return await self.restarter.restart(info, reason)
        except RestartError as exc:
            raise ActionError(str(exc)) from None

    async def reclaim(self, info: WorkerInfo, older_than_s: float) -> int:
        request = ReclaimRequest(older_than_ms=max(1000, int(older_than_s * 1000)))
        answer = await self._call(info, request, ReclaimResponse, self.control_timeout_s)
        return answer.num_reclaimed

    async def switch_role(self, info: WorkerInfo, role: Role, drain_timeout_s: float) -> int:
        """The worker's new epoch once it serves its new role."""
        change = RoleChangeRequest(role=role, drain_timeout_ms=max(1, int(drain_timeout_s * 1000)))
        answer = await self._call(info, change, RoleChangeResponse,
                                  drain_timeout_s + self.control_timeout_s + 5.0)
        return answer.epoch

    async def _call(self, info: WorkerInfo, message: Message, answer_type: type[R],
                    timeout_s: float) -> R:
        client = ControlClient(info.control_url, self.channels)
        try:
            return await client.call(message, answer_type, timeout_s=timeout_s)
        except ControlError as exc:
            raise ActionError(f"{type(message).__name__} to {info.worker_id}: {exc}") from None
