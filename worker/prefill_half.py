"""Prefill worker: admit -> prefill (chunked, batched) -> first token -> push KV -> release.

Serves PrefillRequest (a stream: PrefillResult, then TransferResult) and DestinationNotice
(where the KV of a request sent with `destination_follows` goes: worker/handoff.py),
behind the role gate (worker/role_gate.py), which registers the routes and ends requests
of either half on an AbortRequest. The engine runs in its own thread (EngineThread); KV
moves with the kv_transfer sender (worker/kv_push.py).

Lifecycle of one request here:

    PrefillRequest ─▶ QUEUED ─(engine: PREFILL_ONLY, chunked with other prompts)─▶ PREFILLED
        (first token sampled; blocks parked)  ──▶ PrefillResult sent at once
    PREFILLED ─▶ PUSHING (sender.start, send_layer for every layer, finish) ─▶ TransferResult
        DONE | FAILED | SKIPPED ──▶ engine.release_prefilled (full blocks stay prefix-cached)

    With `destination_follows` the push first waits for the DestinationNotice (the decode
    worker reserved while the prompt computed); the first token does not wait for it.

    The first token may end the request (EOS, max_tokens=1): PrefillResult carries the
    finish_reason and nothing is sent (TransferResult SKIPPED; the gateway aborts the
    reservation). Blocks the destination already holds (num_prefix_blocks_held) are not
    sent; prefix blocks cached here are not recomputed (the engine's prefix cache).

When the push starts: mid-step, from the KVReady the engine owes every request whose KV
goes elsewhere (layer-wise push):

    add_request(notify_kv_ready) ─▶ KVReady (mid-step, engine/kv_ready.py)
      ─▶ sender.start (announce, while the prompt computes) ─▶
      CUDA + mapped link: send_layers_after(layer events): layer n's copy runs
        on the GPU as soon as layer n is computed, overlapping layers n+1..L-1
      otherwise: send_layer ×L once the step's output arrived (KV written)

so on one host's GPUs the handoff adds about the last layer's copy to the time the decode
worker can start, not the whole transfer and its announce. (Starting only once the step
ended added as much TTFT and 1.9 ms more per push on the H200: docs/benchmark_journal.md,
"Layer-wise push and the handoff's added latency, H200".) A request that ends at its first
token cancels its early transfer (TransferResult SKIPPED as before).

Failures: abort or client hang-up while QUEUED -> engine abort; while PUSHING -> the send is
cancelled (the receiver is told and frees its reservation) and the blocks released here;
the request deadline (timeout_ms) bounds queueing, prefill and the push.

Invariants: a request id is in `_active` exactly while its stream is open; every request
that reached the engine is aborted or released exactly once when its stream ends, and only
after its push (which may still read its blocks) ended; every early push task is in
`_pushes` until it ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

from engine.engine_thread import EngineThread
from engine.kv_ready import KVReady
from engine.kv_storage import KVStorage
from engine.llm_engine import RequestOutput
from engine.request import RequestMode
from engine.request_stream import StreamEnd
from kv_transfer.errors import TransferCancelled
from kv_transfer.interface import KVSender
from protocol.finish_reason import FinishReason
from protocol.messages import (DecodeDestination, DestinationAck, DestinationNotice, ErrorCode,
                               Message, PrefillRequest, PrefillResult, TransferStatus)
from worker.faults import Faults
from worker.handoff import EarlyPush, FollowingDestinations, log_push_error, plan_push
from worker.kv_push import KVPusher, transfer_result, unless
from worker.metrics import WorkerMetrics
from worker.output_frames import error_frame, to_token_logprob

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Active:
    request_id: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    abort_reason: str = ""
    pushing: bool = False  # blocks are being read by the sender: only the stream frees them
    early: EarlyPush | None = None  # a push started mid-step (it watches its own stop)
    destination: asyncio.Future[DecodeDestination] | None = None  # `destination_follows`

    def abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.aborted.set()
        if self.early is not None:
            self.early.stop(reason)


class PrefillWorker:
    def __init__(self, metrics: WorkerMetrics, make_sender: Callable[[KVStorage], KVSender],
                 faults: Faults) -> None:
        """`faults`: what a test injected into this process (worker/faults.py)."""
        self.metrics = metrics
        self._make_sender = make_sender
        self._pushes: set[asyncio.Task[Message]] = set()
        self.faults = faults
        self.engine: EngineThread | None = None
        self.sender: KVSender | None = None
        self.pusher: KVPusher | None = None
        self.destinations = FollowingDestinations()
        self.draining = False
        self._active: dict[str, _Active] = {}

    # ---------------------------------------------------------------- RoleWorker

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    @property
    def kv_address(self) -> str | None:
        return None  # a sender only

    async def attach(self, engine: EngineThread) -> None:
        self.engine = engine
        self.sender = self._make_sender(engine.kv_storage)
        self.pusher = KVPusher(self.sender, engine.kv_layout, self.metrics, self.faults)

    def state(self) -> dict[str, object]:
        return {"num_active": len(self._active), "active": sorted(self._active),
                "num_held_destinations": self.destinations.num_held}

    def check_invariants(self) -> None:
        for rid, active in self._active.items():
            assert active.request_id == rid, f"{rid} tracked under another id"
        assert len(self.destinations) <= len(self._active), "a destination outlived its prefill"
        self.destinations.check_invariants()
        if self.sender is not None:
            self.sender.check_invariants()

    async def close(self) -> None:
        self.draining = True
        for active in self._active.values():
            active.abort("worker shutting down")
        if self._pushes:
            await asyncio.wait(self._pushes, timeout=5.0)  # each ends by its abort
        if self.sender is not None:
            await self.sender.close()

    # ---------------------------------------------------------------- prefill

    async def prefill(self, request: PrefillRequest) -> AsyncGenerator[Message, None]:
        rid = request.request_id
        if self.engine is None or self.draining:
            yield error_frame(rid, ErrorCode.OVERLOADED, "not serving (loading or draining)", True)
            return
        if rid in self._active:
            yield error_frame(rid, ErrorCode.BAD_REQUEST, "request id already in use")
            return
        params = request.sampling  # validated while decoding
        engine = self.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.timeout_ms / 1000
        active = self._active[rid] = _Active(rid)
        if request.destination_follows:
            active.destination = self.destinations.expect(rid, loop.time())
        stream = engine.open_stream(rid)
        in_engine = False
        early: EarlyPush | None = None
        sends_kv = _sends_kv(request)
        try:
            if params.grammar is not None:  # compiled off the engine's thread
                await engine.compile_grammar(params.grammar)
            await engine.call(lambda e: e.add_request(
                rid, request.prompt_token_ids, params, request.priority,
                RequestMode.PREFILL_ONLY, notify_kv_ready=sends_kv))
            in_engine = True
            try:
                item = await stream.next(deadline - loop.time())
                if isinstance(item, KVReady):
                    early = self._start_early_push(request, item, active, deadline)
                    item = await stream.next(deadline - loop.time())
            except TimeoutError:
                self.metrics.handoff_failures.inc(reason="prefill_deadline")
                yield error_frame(rid, ErrorCode.DEADLINE_EXCEEDED, "prefill not done by the deadline")
                return
            if isinstance(item, StreamEnd):
                code = ErrorCode.ABORTED if item.error is None else ErrorCode.INTERNAL
                yield error_frame(rid, code, f"request ended: {item.reason}")
                return
            if isinstance(item, KVReady):
                raise AssertionError(f"{rid}: a second KVReady")  # the engine sends one
            if item.finish_reason is FinishReason.ERROR:
                yield error_frame(rid, ErrorCode.INTERNAL, "the engine could not prefill this "
                             "prompt (too long for the KV pool?)")
                return
            self.metrics.record_started(item.num_prompt_tokens, item.num_cached_tokens)
            if item.finished:
                in_engine = False  # the engine already freed it
            async for frame in self._after_first_token(request, item, active, deadline, early):
                yield frame
        except ValueError as exc:  # the engine refused the prompt
            yield error_frame(rid, ErrorCode.BAD_REQUEST, str(exc))
        finally:
            self._active.pop(rid, None)
            self.destinations.forget(rid)
            engine.close_stream(rid)
            if early is not None and not early.task.done():
                # Ended before its push did (an error, an abort, a hang-up): stop the push;
                # the blocks are freed once it drained (its copies may still read them).
                early.stop("the prefill stream ended")
            if in_engine:
                # PREFILLED (KV sent or given up) or still queued: either way, free it now.
                def free(_: object = None) -> None:
                    engine.submit(lambda e: e.abort_request(rid), f"free {rid}")
                if early is not None and not early.task.done():
                    early.task.add_done_callback(free)
                else:
                    free()

    async def destination_notice(self, notice: DestinationNotice) -> Message:
        """Where the KV of a request sent with `destination_follows` goes."""
        waiting = self.destinations.deliver(notice.request_id, notice.destination,
                                            asyncio.get_running_loop().time())
        return DestinationAck(request_id=notice.request_id, waiting=waiting)

    def _start_early_push(self, request: PrefillRequest, ready: KVReady, active: _Active,
                          deadline: float) -> EarlyPush:
        """Announce and queue the push of `ready`'s blocks now, while its step computes
        (once the destination is known, where it follows)."""
        active.pushing = True  # from here only this stream may free the blocks
        early = EarlyPush(layer_events=ready.layer_events)
        early.task = asyncio.get_running_loop().create_task(self._push_prefilled(
            request, ready.block_ids, ready.num_prompt_tokens, active, deadline, early))
        self._pushes.add(early.task)
        early.task.add_done_callback(self._pushes.discard)
        early.task.add_done_callback(log_push_error)
        active.early = early
        return early

    async def _after_first_token(self, request: PrefillRequest, out: RequestOutput,
                                 active: _Active, deadline: float,
                                 early: EarlyPush | None) -> AsyncGenerator[Message, None]:
        rid = request.request_id
        pushing = _sends_kv(request) and not out.finished
        if early is not None:
            if out.finished:
                early.stop("the request ended at its first token", counted=False)
            else:
                early.written_at = time.perf_counter()
                early.written.set()  # the step's output arrived: its KV is written
        elif pushing:  # the engine owes a KVReady before the step's output (kv_ready.py)
            raise AssertionError(f"{rid}: its first token came before its KVReady")
        yield PrefillResult(
            request_id=rid, first_token_id=out.new_token_ids[0],
            first_logprob=to_token_logprob(out.logprobs[0]) if out.logprobs else None,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
            transfer_status=TransferStatus.PENDING if pushing else TransferStatus.SKIPPED,
            finish_reason=out.finish_reason, num_steps=out.num_steps,
            queue_ms=None if out.queued_s is None else round(out.queued_s * 1000, 3))
        destination = request.destination
        if not pushing:
            if destination is not None:  # (a destination that follows is never needed)
                yield transfer_result(rid, destination, TransferStatus.SKIPPED)
        elif early is not None:
            yield await early.task

    async def _push_prefilled(self, request: PrefillRequest, src_block_ids: Sequence[int],
                              num_prompt_tokens: int, active: _Active, deadline: float,
                              early: EarlyPush) -> Message:
        """Push a prefilled prompt's blocks (`src_block_ids`, from its KVReady) once its
        destination is known: a TransferResult, or an ErrorFrame when the destination never
        came."""
        assert self.engine is not None and self.pusher is not None
        rid, engine = request.request_id, self.engine
        stop = early.stopped  # an abort of the request stops it too (_Active.abort)
        reason = functools.partial(_stop_reason, active, early)
        destination = request.destination
        if destination is None:
            assert active.destination is not None  # `destination_follows`
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    destination = await unless(active.destination, stop, reason)
            except TimeoutError:
                self.metrics.handoff_failures.inc(reason="no_destination")
                return error_frame(rid, ErrorCode.DEADLINE_EXCEEDED,
                                   "no destination for the KV by the request's deadline")
            except TransferCancelled as exc:
                return error_frame(rid, ErrorCode.ABORTED, str(exc))
        spec = plan_push(rid, src_block_ids, destination.block_ids,
                         destination.num_prefix_blocks_held, num_prompt_tokens,
                         engine.block_size, engine.num_layers)
        if spec is None:  # the destination holds it all: nothing to send
            return transfer_result(rid, destination, TransferStatus.SKIPPED)
        return await self.pusher.push(spec, destination, stop, reason, deadline, early)

    # ---------------------------------------------------------------- abort

    def abort_request(self, rid: str, reason: str) -> bool:
        """End the prefill (or push) of `rid`; True when there was one."""
        active = self._active.get(rid)
        if active is None or self.engine is None:
            return False
        active.abort(reason)
        stream = self.engine.stream(rid)
        if stream is not None:
            stream.end(active.abort_reason)
        if not active.pushing:
            # While pushing, the stream frees the blocks once the send has drained.
            self.engine.submit(lambda e: e.abort_request(rid), f"abort {rid}")
        return True

    @property
    def active_ids(self) -> tuple[str, ...]:
        return tuple(self._active)


def _sends_kv(request: PrefillRequest) -> bool:
    """The request's KV goes to a decode worker (else it stays cached here)."""
    return request.destination is not None or request.destination_follows


def _stop_reason(active: _Active, early: EarlyPush) -> str:
    if early.reason:
        return early.reason
    return active.abort_reason or "aborted"
