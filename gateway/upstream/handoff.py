"""One generation's upstream state: its attempts, the workers each touched, its bounds.

    Generation  one client request: its token relay (what the client has), its attempts,
                the workers it must not use again
    Attempt     one plan tried: worker-facing request id, the workers called (each is
                aborted unless the attempt finishes), a failure the transfer watcher saw
    UpstreamTimeouts  every wait of a leg
    should_prefill_early  the policy: start the prefill beside the reservation, or after it

An early prefill (wherever the decode worker has room) sends the PrefillRequest
with `destination_follows` at once, beside the ReserveRequest; the decode worker's answer
is forwarded as a DestinationNotice (`reserve_and_forward`) while the prompt computes, so
the reservation's round trip, and its wait for the decode worker's engine thread (one
decode step at most), leave the time to the first token:

    gateway ──ReserveRequest──▶ D ──ReserveResponse──▶ gateway ──DestinationNotice──▶ P
    gateway ──PrefillRequest(destination_follows)──▶ P   computes meanwhile; its push
                                                         waits for the notice

Attempt n > 0 of request R reaches the workers as "R-n": a worker still freeing attempt
n-1's reservation or stream never sees the id reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from gateway.api.backend import GenerationRequest
from gateway.routing.retry_policy import FailureKind, LegFailed, Phase, leg_failed
from gateway.routing.router import RoutePlan, load_has_room
from gateway.upstream.relay import TokenRelay
from gateway.upstream.worker_clients import CALL_FAILURES
from protocol.messages import (DestinationAck, DestinationNotice, Message, ReserveRequest,
                               ReserveResponse, TokenFrame, TransferResult, TransferStatus)
from protocol.worker_load import WorkerLoad
from rpc.control_client import ControlClient, FrameBatches

log = logging.getLogger(__name__)
# An early prefill needs the decode worker to have room for this many times the prompt's
# blocks, as its last load report says: that report is up to a second old, and a prefill
# that computed while the reservation queued for blocks holds its own KV meanwhile.
EARLY_PREFILL_ROOM = 2


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    reserve_s: float = 5.0  # answer to /internal/reserve, beyond kv_wait_ms
    kv_wait_ms: int = 60_000  # D queues a reservation this long for free KV blocks
    first_token_s: float = 120.0  # PrefillResult, or D's first frame (a long CPU prefill)
    frame_s: float = 60.0  # between two frames of a running stream
    reservation_ms: int = 120_000  # D holds the blocks this long for the KV + DecodeRequest
    request_ms: int = 600_000  # the budget sent to workers with each request
    abort_s: float = 2.0
    worker_wait_s: float = 15.0  # no worker to route to: wait this long for one (a restart)

    @property
    def reserve_call_s(self) -> float:
        return self.reserve_s + self.kv_wait_ms / 1000


class Attempt:
    def __init__(self, request_id: str, number: int, plan: RoutePlan) -> None:
        self.request_id = request_id  # as the workers see it
        self.number = number
        self.plan = plan
        self.legs: dict[str, ControlClient] = {}  # worker id -> client: abort these on failure
        self.transfer_failure: LegFailed | None = None  # set by the KV transfer watcher

    @property
    def worker_ids(self) -> tuple[str, ...]:
        plan = self.plan
        if plan.prefill_worker_id is None:
            return (plan.decode_worker_id,)
        return plan.prefill_worker_id, plan.decode_worker_id


class Generation:
    def __init__(self, request: GenerationRequest, relay: TokenRelay) -> None:
        self.request = request
        self.relay = relay
        self.attempts: list[Attempt] = []
        # Workers that failed this generation -> the epoch they had; a worker restarted
        # since (a new epoch) may serve the generation again.
        self.excluded: dict[str, int] = {}
        self.last_failure: LegFailed | None = None

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def traceparent(self) -> str | None:
        """The request span's, for the workers' messages (None: not traced)."""
        return None if self.request.trace is None else self.request.trace.traceparent

    def new_attempt(self, plan: RoutePlan) -> Attempt:
        number = len(self.attempts)
        rid = self.request.request_id if number == 0 else f"{self.request.request_id}-{number}"
        attempt = Attempt(rid, number, plan)
        self.attempts.append(attempt)
        if self.request.trace is not None:
            self.request.trace.planned(number, plan, time.monotonic())
        return attempt

    def failed(self, failure: LegFailed) -> None:
        """The current attempt failed (the next one must avoid its worker)."""
        self.last_failure = failure
        if self.request.trace is not None:
            self.request.trace.failed(failure, time.monotonic())

    def prefilled(self, worker_id: str, queue_ms: float | None) -> None:
        """A prefill worker's first token arrived, saying how long the prompt waited in its
        queue (None: it did not say)."""
        if self.request.trace is not None and queue_ms is not None:
            self.request.trace.prefill_queue(worker_id, queue_ms, time.monotonic())


async def prepend(first: asyncio.Task[list[TokenFrame]], rest: FrameBatches[TokenFrame]
                  ) -> AsyncGenerator[list[TokenFrame], None]:
    """`first`'s batch (a task already reading `rest`), then the rest of `rest`."""
    try:
        yield await first
    except StopAsyncIteration:
        return
    async for item in rest:
        yield item


async def watch_transfer(prefill_frames: AsyncGenerator[Message, None], attempt: Attempt,
                         prefill_id: str, abort: Callable[[Attempt], None]) -> None:
    """Reads P's TransferResult; a failed move is recorded on the attempt and aborts it
    (`abort`), so the decode leg fails at once instead of waiting for the KV."""
    failure: LegFailed | None = None
    try:
        async with contextlib.aclosing(prefill_frames):
            async for frame in prefill_frames:
                if isinstance(frame, TransferResult):
                    if frame.status is TransferStatus.FAILED:
                        failure = LegFailed(prefill_id, Phase.TRANSFER, FailureKind.WORKER_ERROR,
                                            frame.error or "KV transfer failed")
                    return
            failure = LegFailed(prefill_id, Phase.TRANSFER, FailureKind.WORKER_ERROR,
                                "stream ended before the KV transfer finished")
    except CALL_FAILURES as exc:
        failure = leg_failed(prefill_id, Phase.TRANSFER, exc)
    finally:
        if failure is not None:
            attempt.transfer_failure = failure
            log.warning("%s: %s; aborting the attempt", attempt.request_id, failure)
            abort(attempt)


def should_prefill_early(num_prompt_tokens: int, block_size: int,
                         decode_load: WorkerLoad | None) -> bool:
    """Start the prefill beside the reservation (True), or once it is made (pure).

    Early only where the decode worker's last report shows room for the prompt's blocks
    `EARLY_PREFILL_ROOM` times over: a reservation that may queue for blocks goes first,
    so the prefill worker does not hold a computed prompt while it waits."""
    return decode_load is not None and load_has_room(decode_load, num_prompt_tokens, block_size,
                                                     EARLY_PREFILL_ROOM)


async def reserve_and_forward(decoder: ControlClient, decode_id: str, message: ReserveRequest,
                              call_s: float, prefiller: ControlClient | None = None,
                              prefill_id: str = "", forward_s: float = 0.0) -> ReserveResponse:
    """Reserve on the decode worker; with `prefiller` (an early prefill), forward the
    destination to the prefill worker. A failure is the LegFailed of the worker at fault."""
    try:  # D may queue it for free KV blocks (kv_wait_ms) before it answers
        reserved = await decoder.call(message, ReserveResponse, call_s)
    except CALL_FAILURES as exc:
        raise leg_failed(decode_id, Phase.RESERVE, exc) from exc
    if prefiller is not None:
        notice = DestinationNotice(request_id=message.request_id,
                                   destination=reserved.destination)
        try:
            await prefiller.call(notice, DestinationAck, forward_s)
        except CALL_FAILURES as exc:
            raise leg_failed(prefill_id, Phase.PREFILL, exc) from exc
    return reserved


async def first_prefill_frame(frames: AsyncGenerator[Message, None], prefill_id: str,
                              reserving: asyncio.Task[ReserveResponse] | None) -> Message:
    """P's first frame; with an early prefill, a failed reservation (`reserving`) ends
    the wait at once (its LegFailed is raised) instead of after the prompt's compute."""
    first = asyncio.ensure_future(anext(frames))
    try:
        if reserving is not None:
            await asyncio.wait({first, reserving}, return_when=asyncio.FIRST_COMPLETED)
            error = None if first.done() else reserving.exception()
            if error is not None:
                raise error
        return await first
    except StopAsyncIteration:
        raise LegFailed(prefill_id, Phase.PREFILL, FailureKind.WORKER_ERROR,
                        "stream ended before the first token") from None
    except CALL_FAILURES as exc:
        raise leg_failed(prefill_id, Phase.PREFILL, exc) from exc
    finally:
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
