"""Decode worker: reserve -> receive KV -> join the decode batch -> stream tokens.

Serves ReserveRequest, DecodeRequest (a stream of TokenFrames) and the operations agent's
ReclaimRequest (protocol/), behind the role gate (worker/role_gate.py), which registers the
routes and ends requests of either half on an AbortRequest. The engine runs in its own
thread (EngineThread).

The handoff as this worker sees it (disaggregated request):

    gateway                         decode worker                       prefill worker
    ReserveRequest ───────────────▶ engine.reserve(prompt)
                                    receiver.expect(rid, blocks, deadline)
                   ◀─────────────── ReserveResponse(dest) ─▶ (gateway) ─▶ PrefillRequest(dest)
                                       or, the prefill already running, DestinationNotice(dest)
    DecodeRequest(first_token) ───▶ wait for the KV (deadline)   ◀════ KV layers (kv_transfer)
                                    add_decode_request (blocks move to the request)
                   ◀─────────────── TokenFrame(tokens 2..n) ... finish + usage

Short prompts (DecodeRequest without first_token_id) skip the reservation: the request is
prefilled here and its first frame carries the first token. A migrated stream arrives the
same way with `resume_token_ids` (what the client already has): prompt and those tokens are
recomputed here and the first frame carries the token after them.

Failure paths (each frees every block it holds, exactly once; see reservations.py):
  * transfer fails or stalls -> the receiver aborts it by its deadline, waits until no
    byte can land, then calls our release -> engine.release_reservation; a waiting
    DecodeRequest gets TRANSFER_FAILED;
  * no DecodeRequest joined -> released when the channel the reservation came on closes
    (its gateway died, or retries elsewhere), else at the reservation deadline;
  * AbortRequest or a client hang-up -> transfer cancelled and reservation released, or
    the running request aborted in the engine;
  * DecodeRequest.timeout_ms passes -> DEADLINE_EXCEEDED and the request is aborted.

Lifecycle of this object: constructed (routes answer OVERLOADED) -> attach() (receiver
started) -> serving -> close() (reservations released, tasks cancelled, receiver closed).
Invariants: see reservations.py; every task this worker starts is in `_tasks`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine

from engine.engine_thread import EngineThread
from engine.kv_storage import KVStorage
from engine.request import RequestMode
from kv_transfer.errors import KVTransferError
from kv_transfer.interface import KVReceiver, TransferState
from kv_transfer.layout import transfer_bytes
from protocol.agent_messages import ReclaimRequest, ReclaimResponse
from protocol.messages import (DecodeDestination, DecodeRequest, ErrorCode, ErrorFrame, Message,
                               ReserveRequest, ReserveResponse, TokenFrame)
from rpc.control_app import FrameWriter, on_caller_lost
from worker.block_waiters import BlockWaiters, ReservationAborted, refusal
from worker.metrics import WorkerMetrics
from worker.output_frames import error_frame
from worker.reservations import (EndReason, Reservation, ReservationState, ReservationTable,
                                 blocks_to_receive)
from worker.stream_frames import DecodeStream, stream_frames

log = logging.getLogger(__name__)

_END_CODES = {EndReason.TRANSFER_FAILED: ErrorCode.TRANSFER_FAILED,
              EndReason.EXPIRED: ErrorCode.DEADLINE_EXCEEDED,
              EndReason.ABORTED: ErrorCode.ABORTED, EndReason.SHUTDOWN: ErrorCode.ABORTED}


class DecodeWorker:
    def __init__(self, worker_id: str, metrics: WorkerMetrics,
                 make_receiver: Callable[[KVStorage], Awaitable[KVReceiver]],
                 epoch: Callable[[], int],
                 own_epoch: Callable[[int], bool] | None = None) -> None:
        """`own_epoch(e)`: did this process register epoch `e` (a role change starts a new
        one; reservations of an earlier one stay joinable)? Default: `e == epoch()`."""
        self.worker_id = worker_id
        self.metrics = metrics
        self._make_receiver = make_receiver
        self._epoch = epoch
        self._own_epoch = own_epoch or (lambda e: e == epoch())
        self.table = ReservationTable()
        self.block_waiters = BlockWaiters(on_change=self._on_waiters)  # for free KV blocks
        self._last_full_log = -1e9  # loop time of the last "KV cache full" log line
        self.engine: EngineThread | None = None
        self.receiver: KVReceiver | None = None
        self.draining = False
        self._streams: dict[str, DecodeStream] = {}  # open decode streams, by request id
        self._tasks: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- RoleWorker

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + len(self.table)

    @property
    def kv_address(self) -> str | None:
        return None if self.receiver is None else self.receiver.address

    async def attach(self, engine: EngineThread) -> None:
        """Serve with `engine`; the KV receiver opens with the role's reservations."""
        self.engine = engine

    async def start_receiver(self) -> None:
        """Open the KV receiver (the role takes reservations now); idempotent."""
        if self.receiver is None and self.engine is not None:
            self.receiver = await self._make_receiver(self.engine.kv_storage)

    def state(self) -> dict[str, object]:
        return {"num_reservations": len(self.table), "num_streams": len(self._streams),
                "num_waiting_for_blocks": len(self.block_waiters),
                "reservations": [r.request_id for r in self.table.live()],
                "streams": sorted(self._streams), "num_tasks": len(self._tasks)}

    def check_invariants(self) -> None:
        self.table.check_invariants()
        self.block_waiters.check_invariants()
        for reservation in self.table.live():
            assert reservation.request_id not in self._streams or reservation.attached, \
                f"{reservation.request_id} streams but its reservation is not attached"
        if self.receiver is not None:
            self.receiver.check_invariants()

    async def close(self) -> None:
        self.draining = True
        for reservation in self.table.live():
            await self._drop(reservation, EndReason.SHUTDOWN, "worker shutting down")
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        if self.receiver is not None:
            await self.receiver.close()

    # ---------------------------------------------------------------- reserve

    async def reserve(self, request: ReserveRequest) -> Message:
        rid = request.request_id
        if self.engine is None or self.receiver is None or self.draining:
            return error_frame(rid, ErrorCode.OVERLOADED, "not accepting reservations "
                          "(loading, draining or colocated)", retryable=True)
        if rid in self.table or rid in self._streams or rid in self.block_waiters:
            return error_frame(rid, ErrorCode.BAD_REQUEST, "request id already in use")
        engine, receiver = self.engine, self.receiver
        try:
            held = await self.block_waiters.reserve(engine, request, lambda: self.draining)
        except (ValueError, ReservationAborted) as exc:
            code = ErrorCode.BAD_REQUEST if isinstance(exc, ValueError) else ErrorCode.ABORTED
            return error_frame(rid, code, str(exc))
        if held is None or self.draining or self.receiver is not receiver:
            if held is not None:  # the worker began draining while this one waited
                engine.submit(lambda e: e.release_reservation(rid), f"release {rid}")
            return error_frame(rid, ErrorCode.OVERLOADED, self._refusal(engine, request),
                               retryable=True)
        block_size = engine.block_size
        num_held, num_receive = blocks_to_receive(len(request.prompt_token_ids), block_size,
                                                  held.num_cached_tokens)
        loop = asyncio.get_running_loop()
        timeout_s = request.timeout_ms / 1000
        reservation = Reservation(rid, list(request.prompt_token_ids), list(held.block_ids),
                                  num_held, num_receive, loop.time() + timeout_s, loop.time())
        self.table.add(reservation)
        if num_receive:
            # expect() must precede the sender's announcement: do it before answering.
            reservation.handle = receiver.expect(
                rid, reservation.receive_block_ids, range(engine.num_layers),
                functools.partial(self._on_transfer_failed, reservation), timeout_s)
            self._spawn(self._watch_transfer(reservation))
        reservation.timer = loop.call_at(reservation.deadline, self._on_deadline, reservation)
        # A dead gateway's reservation goes now, not at its deadline (minutes away).
        reservation.forget_caller = on_caller_lost(functools.partial(
            self._drop_unjoined, reservation, "caller_lost", EndReason.ABORTED,
            "the caller that reserved it closed its channel"))
        self.metrics.reservations.set(len(self.table))
        destination = DecodeDestination(worker_id=self.worker_id, epoch=self._epoch(),
                                        kv_address=receiver.address,
                                        block_ids=list(held.block_ids),
                                        num_prefix_blocks_held=num_held)
        return ReserveResponse(request_id=rid, destination=destination)

    async def reclaim(self, request: ReclaimRequest) -> Message:
        """Free reservations no decode request joined for `older_than_ms` (leaked: the
        gateway that made them is gone); the KV receiver's cancel runs first, as always."""
        old = self.table.unjoined(asyncio.get_running_loop().time() - request.older_than_ms / 1000)
        for reservation in old:
            self.metrics.handoff_failures.inc(reason="reservation_reclaimed")
            await self._drop(reservation, EndReason.EXPIRED,
                             "reclaimed by the operations agent: no decode request joined")
        if old:
            log.warning("reclaimed %d reservation(s) older than %d ms", len(old),
                        request.older_than_ms)
        return ReclaimResponse(num_reclaimed=len(old), request_ids=[r.request_id for r in old])

    def _refusal(self, engine: EngineThread, request: ReserveRequest) -> str:
        message = refusal(request, engine.block_size, engine.load)
        if (now := asyncio.get_running_loop().time()) - self._last_full_log > 10.0:
            self._last_full_log = now  # one line per burst of refusals
            log.warning("reservation %s refused: %s", request.request_id, message)
        return message

    async def _watch_transfer(self, reservation: Reservation) -> None:
        """Mark LANDED as soon as the KV is in (and count its bytes); failures are
        reported through the receiver's release callback."""
        assert reservation.handle is not None and self.engine is not None
        try:
            await reservation.handle.wait()
        except KVTransferError:
            return
        if reservation.state is ReservationState.RECEIVING:
            self.table.mark_landed(reservation.request_id)
        layout = self.engine.kv_layout
        num_bytes = transfer_bytes(layout, reservation.num_receive_blocks, layout.num_layers)
        self.metrics.kv_transfer_bytes.inc(num_bytes, direction="received")
        self.metrics.kv_transfer_blocks.inc(reservation.num_receive_blocks, direction="received")

    def _on_transfer_failed(self, reservation: Reservation, _block_ids: list[int]) -> None:
        # Called by the receiver exactly once, after no byte of the transfer can land.
        if reservation.state is not ReservationState.RELEASED:
            self.metrics.handoff_failures.inc(reason="transfer_failed")
        self._release(reservation, EndReason.TRANSFER_FAILED, "KV transfer failed")

    def _on_deadline(self, reservation: Reservation) -> None:
        reservation.timer = None
        self._drop_unjoined(reservation, "reservation_expired", EndReason.EXPIRED,
                            "no decode request joined before the reservation deadline")

    def _drop_unjoined(self, reservation: Reservation, metric_reason: str, reason: EndReason,
                       detail: str) -> None:
        if reservation.attached or reservation.state not in (ReservationState.RECEIVING,
                                                              ReservationState.LANDED):
            return  # a DecodeRequest owns it now (its own waits are bounded), or it ended
        self.metrics.handoff_failures.inc(reason=metric_reason)
        self._spawn(self._drop(reservation, reason, detail))

    async def _drop(self, reservation: Reservation, reason: EndReason, detail: str) -> None:
        """Free a reservation that will not be joined, waiting until no byte can land."""
        handle = reservation.handle
        if handle is not None and handle.state is not TransferState.DONE:
            reservation.end_reason = reservation.end_reason or reason
            await handle.cancel(detail)  # its release callback frees the blocks
        self._release(reservation, reason, detail)

    def _release(self, reservation: Reservation, reason: EndReason, detail: str) -> None:
        if self.table.release(reservation.request_id, reason, detail) and self.engine is not None:
            rid = reservation.request_id
            self.engine.submit(lambda e: e.release_reservation(rid), f"release {rid}")
            self.metrics.reservations.set(len(self.table))
            self.block_waiters.notify()

    # ---------------------------------------------------------------- decode

    async def decode(self, request: DecodeRequest, out: FrameWriter | None
                     ) -> AsyncGenerator[Message, None]:
        """The request's frames; `out`: the stream's writer for tokens sent from the
        engine's delivery callback (worker/stream_frames.py), None: all through here."""
        rid = request.request_id
        if self.engine is None or (self.draining and request.is_local_prefill):
            yield error_frame(rid, ErrorCode.OVERLOADED, "not serving (loading or draining)", True)
            return
        if rid in self._streams:
            yield error_frame(rid, ErrorCode.BAD_REQUEST, "request id already streaming")
            return
        params = request.sampling  # validated while decoding
        engine = self.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.timeout_ms / 1000
        stream = self._streams[rid] = DecodeStream(rid, out)
        engine.open_stream(rid, stream)
        in_engine = finished = False
        reservation: Reservation | None = None
        try:
            if params.grammar is not None:  # compiled off the engine's thread
                await engine.compile_grammar(params.grammar)
            if request.is_local_prefill:
                await engine.call(lambda e: e.add_request(
                    rid, request.prompt_token_ids, params, request.priority,
                    RequestMode.PREFILL_AND_DECODE, request.resume_token_ids,
                    tpot_s=request.tpot_s))
                in_engine = True
            elif request.resume_token_ids:
                yield error_frame(rid, ErrorCode.BAD_REQUEST, "resume_token_ids needs a local "
                             "prefill (no first_token_id)")
                return
            else:
                reservation = self.table.get(rid)
                error = self._check_joinable(request, reservation)
                if error is not None or reservation is None:
                    yield error or error_frame(rid, ErrorCode.UNKNOWN_REQUEST, "no reservation")
                    return
                # From here this stream owns the reservation's fate.
                reservation.attached = True
                error = await self._wait_for_kv(reservation, deadline - loop.time())
                if error is not None:
                    yield error
                    return
                self.table.join(rid)
                self.metrics.reservations.set(len(self.table))
                in_engine = True  # from here the engine request owns the blocks
                first_token_id = request.first_token_id
                assert first_token_id is not None  # not a local prefill
                await engine.call(lambda e: e.add_decode_request(
                    rid, request.prompt_token_ids, params, first_token_id, request.priority,
                    tpot_s=request.tpot_s))
            async for frame in stream_frames(stream, deadline, self.metrics):
                # Only a normal finish leaves nothing behind in the engine.
                finished = isinstance(frame, TokenFrame) and frame.finish_reason is not None
                yield frame
        except ValueError as exc:  # the engine refused the request (bad prompt, id in use,
            finished = True  # a first token its grammar refuses): joined blocks go back
            engine.submit(lambda e: e.release_reservation(rid), f"release {rid}")
            yield error_frame(rid, ErrorCode.BAD_REQUEST, str(exc))
        finally:
            self._streams.pop(rid, None)
            engine.close_stream(rid)
            self.block_waiters.notify()  # its blocks are freed by now or by the abort below
            if in_engine and not finished:
                engine.submit(lambda e: e.abort_request(rid), f"abort {rid}")
            elif reservation is not None and reservation.state in (
                    ReservationState.RECEIVING, ReservationState.LANDED):
                self._spawn(self._drop(reservation, EndReason.ABORTED, "decode stream closed"))

    def _check_joinable(self, request: DecodeRequest,
                        reservation: Reservation | None) -> ErrorFrame | None:
        rid = request.request_id
        if reservation is None:
            ended = self.table.tombstone(rid)
            if ended is not None:
                return error_frame(rid, _END_CODES[ended[0]], f"reservation ended: {ended[1]}")
            return error_frame(rid, ErrorCode.UNKNOWN_REQUEST, "no reservation for this request")
        if request.epoch is not None and not self._own_epoch(request.epoch):
            return error_frame(rid, ErrorCode.STALE_EPOCH, f"reservation epoch {request.epoch} is "
                          f"not this worker's epoch {self._epoch()}")
        if reservation.attached:
            return error_frame(rid, ErrorCode.BAD_REQUEST, "a decode request already joined")
        return None

    async def _wait_for_kv(self, reservation: Reservation, timeout_s: float) -> ErrorFrame | None:
        rid = reservation.request_id
        if reservation.handle is None or reservation.state is ReservationState.LANDED:
            return None
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await reservation.handle.wait()  # the transfer's own deadline bounds it too
        except TimeoutError:
            self.metrics.handoff_failures.inc(reason="decode_deadline")
            await self._drop(reservation, EndReason.EXPIRED, "request deadline passed")
            return error_frame(rid, ErrorCode.DEADLINE_EXCEEDED, "KV did not land before the "
                          "request deadline")
        except KVTransferError as exc:
            await self._drop(reservation, EndReason.TRANSFER_FAILED, str(exc))
            reason = reservation.end_reason or EndReason.TRANSFER_FAILED
            return error_frame(rid, _END_CODES[reason], f"KV transfer failed: {exc}")
        self.table.mark_landed(rid)
        return None

    # ---------------------------------------------------------------- abort

    def tokens_sent(self, rid: str) -> int:
        """Tokens the open decode stream of `rid` has sent (0 without one); read before
        ending it: nothing is sent after an end."""
        stream = self._streams.get(rid)
        return stream.num_tokens_sent if stream is not None else 0

    def abort_request(self, rid: str, reason: str) -> bool:
        """End a reservation or a running stream of `rid`; True when there was one."""
        found = self.block_waiters.cancel(rid)
        reservation = self.table.get(rid)
        if reservation is not None:
            found = True
            self.metrics.handoff_failures.inc(reason="aborted")
            reservation.end_reason = EndReason.ABORTED
            self._spawn(self._drop(reservation, EndReason.ABORTED, reason))
        engine = self.engine
        stream = engine.stream(rid) if engine is not None else None
        if stream is not None and engine is not None:
            found = True
            stream.end(reason)
            engine.submit(lambda e: e.abort_request(rid), f"abort {rid}")
        return found

    @property
    def stream_ids(self) -> tuple[str, ...]:
        return tuple(self._streams)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _on_waiters(self, length: int, outcome: str | None) -> None:
        self.metrics.kv_waiting.set(length)
        if outcome is not None:
            self.metrics.kv_waits.inc(outcome=outcome)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("decode worker task failed", exc_info=task.exception())
