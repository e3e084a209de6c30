"""Control messages the operations agent sends to a worker (msgpack envelopes, like
protocol/messages.py's), on the worker's token-guarded control API:

    POST /internal/reclaim   ReclaimRequest -> ReclaimResponse   (decode-capable workers)
        free every reservation older than `older_than_ms` that no decode request joined:
        what a gateway that died between reserve and decode leaves behind
    POST /internal/exit      ExitRequest -> ExitResponse
        answer, then exit with EXIT_CODE_RESTART at once (no drain): how the agent restarts
        a worker whose orchestrator restarts exited containers (compose)
    POST /internal/fault     FaultRequest -> FaultResponse
        fault injection for tests and drills: only served when the worker was started with
        PDSERVE_FAULT_INJECTION=1 in its environment (404 otherwise)
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.messages import Message

EXIT_CODE_RESTART = 75  # EX_TEMPFAIL: "restart me", not a crash of the worker's own
FAULT_INJECTION_ENV = "PDSERVE_FAULT_INJECTION"
MAX_FAULT_DELAY_MS = 10_000
Reason = Annotated[str, msgspec.Meta(max_length=1024)]


class ReclaimRequest(Message, tag="reclaim_request", frozen=True, kw_only=True):
    older_than_ms: Annotated[int, msgspec.Meta(ge=1000, le=3_600_000)]


class ReclaimResponse(Message, tag="reclaim_response", frozen=True, kw_only=True):
    num_reclaimed: Annotated[int, msgspec.Meta(ge=0)]
    request_ids: Annotated[list[Reason], msgspec.Meta(max_length=4096)] = []


class ExitRequest(Message, tag="exit_request", frozen=True, kw_only=True):
    reason: Reason = ""


class ExitResponse(Message, tag="exit_response", frozen=True, kw_only=True):
    pid: Annotated[int, msgspec.Meta(ge=0)]


class FaultRequest(Message, tag="fault_request", frozen=True, kw_only=True):
    step_delay_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_FAULT_DELAY_MS)] = 0


class FaultResponse(Message, tag="fault_response", frozen=True, kw_only=True):
    step_delay_ms: int
