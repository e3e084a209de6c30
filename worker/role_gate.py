"""One worker process that takes whichever role it is given, and changes role at run time.

Every worker process runs this: a `PrefillWorker` (prefill for others, push KV) and a
`DecodeWorker` (reserve, receive KV, decode; local prefill + decode) over one engine, and a
current `Role` that decides which new work is accepted:

    request               accepted while the role ...         else
    PrefillRequest        prefills for others (PREFILL, BOTH)  WRONG_ROLE (retryable)
    ReserveRequest        takes reservations (DECODE, BOTH)    WRONG_ROLE
    DecodeRequest         decodes (all but PREFILL) for a      WRONG_ROLE
                          local prefill; joining a reservation
                          is always accepted (it is in flight)
    DestinationNotice     always (the destination of a prefill in flight, see
                          worker/handoff.py)
    AbortRequest          always (ends the request in whichever half holds it)
    ReclaimRequest        always (the operations agent: leaked reservations)
    RoleChangeRequest     always -> RoleChangeResponse

The gate registers every route of the worker's control API (worker/main.py asks it to); the halves
register none.

A role change (weights, KV pool and prefix cache stay; nothing restarts):

    gate: the new role applies to new work at once
      -> open the KV receiver / sender if the new role needs one
      -> drain: wait until the in-flight work the new role forbids has ended
         (<= drain_timeout_ms; what is left is aborted: the gateway retries or migrates it)
      -> publish the new role under a new epoch (WorkerRuntime.change_role); reservations
         made under an earlier epoch of this process stay joinable

One change at a time (a lock). The KV receiver, once open, stays open.

Invariants (`check_invariants`): both halves' invariants hold; a role that takes
reservations has an open receiver; a role that prefills for others has a sender.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

from aiohttp import web

from engine.engine_thread import EngineThread
from protocol.agent_messages import ReclaimRequest
from protocol.messages import (AbortRequest, AbortResponse, DecodeRequest, DestinationNotice,
                               ErrorCode, ErrorFrame, Message, PrefillRequest, ReserveRequest, Role,
                               RoleChangeRequest, RoleChangeResponse)
from rpc.control_server import FrameWriter, add_call, add_stream
from telemetry.tracing import NO_TRACING, Tracing
from worker.decode_half import DecodeWorker
from worker.metrics import WorkerMetrics
from worker.prefill_half import PrefillWorker
from worker.request_spans import traced_decode, traced_prefill

DRAIN_POLL_S = 0.05


class AnyRoleWorker:
    def __init__(self, role: Role, prefill: PrefillWorker, decode: DecodeWorker,
                 metrics: WorkerMetrics, publish_role: Callable[[Role, str | None], Awaitable[int]],
                 epoch: Callable[[], int], tracing: Tracing = NO_TRACING,
                 kv_backend: str = "") -> None:
        """`publish_role(role, kv_address)` registers the new role under a new epoch;
        `tracing` gets a span per traced request (worker/request_spans.py)."""
        self.role = role
        self.tracing, self.kv_backend = tracing, kv_backend
        self.prefill_half = prefill
        self.decode_half = decode
        self.metrics = metrics
        self._publish_role = publish_role
        self._epoch = epoch
        self._engine: EngineThread | None = None
        self._role_lock = asyncio.Lock()

    # ---------------------------------------------------------------- RoleWorker

    @property
    def num_in_flight(self) -> int:
        return self.prefill_half.num_in_flight + self.decode_half.num_in_flight

    @property
    def kv_address(self) -> str | None:
        return self.decode_half.kv_address

    def add_routes(self, app: web.Application) -> None:
        add_stream(app, PrefillRequest, traced_prefill(self.tracing, self.prefill,
                                                       self.kv_backend))
        add_call(app, ReserveRequest, self.reserve)
        add_stream(app, DecodeRequest, traced_decode(self.tracing, self.decode))
        add_call(app, DestinationNotice, self.prefill_half.destination_notice)
        add_call(app, AbortRequest, self.abort)
        add_call(app, ReclaimRequest, self.decode_half.reclaim)
        add_call(app, RoleChangeRequest, self.change_role)

    async def attach(self, engine: EngineThread) -> None:
        self._engine = engine
        await self._open_for(self.role)

    def state(self) -> dict[str, object]:
        return {"role": self.role.value, **self.prefill_half.state(), **self.decode_half.state()}

    def check_invariants(self) -> None:
        self.prefill_half.check_invariants()
        self.decode_half.check_invariants()
        if self._engine is not None and not self._role_lock.locked():
            if self.role.takes_reservations:
                assert self.decode_half.receiver is not None, \
                    f"{self.role.value} takes reservations without a KV receiver"
            if self.role.prefills_for_others:
                assert self.prefill_half.sender is not None, \
                    f"{self.role.value} prefills for others without a KV sender"

    async def close(self) -> None:
        await self.prefill_half.close()
        await self.decode_half.close()

    # ---------------------------------------------------------------- gated routes

    async def prefill(self, request: PrefillRequest, out: FrameWriter
                      ) -> AsyncGenerator[Message, None]:
        if not self.role.prefills_for_others:
            yield self._wrong_role(request.request_id, "prefill for other workers")
            return
        async for message in self.prefill_half.prefill(request):
            yield message

    async def reserve(self, request: ReserveRequest) -> Message:
        if not self.role.takes_reservations:
            return self._wrong_role(request.request_id, "take reservations")
        return await self.decode_half.reserve(request)

    async def decode(self, request: DecodeRequest, out: FrameWriter | None
                     ) -> AsyncGenerator[Message, None]:
        if request.is_local_prefill and not self.role.decodes:
            yield self._wrong_role(request.request_id, "decode")
            return
        async for message in self.decode_half.decode(request, out):
            yield message

    async def abort(self, request: AbortRequest) -> Message:
        reason = request.reason or "aborted by the gateway"
        sent = self.decode_half.tokens_sent(request.request_id)
        found = self.prefill_half.abort_request(request.request_id, reason)
        found = self.decode_half.abort_request(request.request_id, reason) or found
        self.metrics.aborts.inc(found="yes" if found else "no")
        return AbortResponse(request_id=request.request_id, found=found, num_tokens_sent=sent)

    def _wrong_role(self, request_id: str, what: str) -> ErrorFrame:
        return ErrorFrame(request_id=request_id, code=ErrorCode.WRONG_ROLE, retryable=True,
                          message=f"this worker is now a {self.role.value} worker and does "
                                  f"not {what}")

    # ---------------------------------------------------------------- role change

    async def change_role(self, request: RoleChangeRequest) -> Message:
        async with self._role_lock:
            new = request.role
            if new is self.role:
                return RoleChangeResponse(role=new, epoch=self._epoch())
            self.role = new
            await self._open_for(new)
            num_aborted = await self._drain_forbidden(new, request.drain_timeout_ms / 1000)
            epoch = await self._publish_role(new, self.kv_address)
            return RoleChangeResponse(role=new, epoch=epoch, num_aborted=num_aborted)

    async def _open_for(self, role: Role) -> None:
        assert self._engine is not None
        if role.prefills_for_others and self.prefill_half.sender is None:
            await self.prefill_half.attach(self._engine)
        if self.decode_half.engine is None:
            await self.decode_half.attach(self._engine)  # no receiver yet when colocated
        if role.takes_reservations:
            await self.decode_half.start_receiver()

    def _forbidden(self, role: Role) -> list[tuple[str, Callable[[str, str], bool]]]:
        """(request id, its half's abort) of in-flight work `role` does not do."""
        work: list[tuple[str, Callable[[str, str], bool]]] = []
        if not role.prefills_for_others:
            work += [(rid, self.prefill_half.abort_request)
                     for rid in self.prefill_half.active_ids]
        if not role.decodes:
            work += [(rid, self.decode_half.abort_request)
                     for rid in self.decode_half.stream_ids]
            work += [(r.request_id, self.decode_half.abort_request)
                     for r in self.decode_half.table.live()]
        return work

    async def _drain_forbidden(self, role: Role, timeout_s: float) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._forbidden(role) and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = self._forbidden(role)
        for rid, abort in left:
            abort(rid, f"worker changed role to {role.value}")
        return len(left)
