"""Prefill worker: admit -> prefill (chunked, batched) -> first token -> push KV -> release.

Handles POST /internal/prefill (a stream: PrefillResult, then TransferResult) and
POST /internal/abort. The engine runs in its own thread (EngineThread); KV moves with the
kv_transfer sender (UCX, or TCP).

Lifecycle of one request here:

    PrefillRequest ─▶ QUEUED ─(engine: PREFILL_ONLY, chunked with other prompts)─▶ PREFILLED
        (first token sampled; blocks parked)  ──▶ PrefillResult sent at once
    PREFILLED ─▶ PUSHING (sender.start, send_layer for every layer, finish) ─▶ TransferResult
        DONE | FAILED | SKIPPED ──▶ engine.release_prefilled (full blocks stay prefix-cached)

    The first token may end the request (EOS, max_tokens=1): PrefillResult carries the
    finish_reason and nothing is sent (TransferResult SKIPPED; the gateway aborts the
    reservation). Blocks the destination already holds (num_prefix_blocks_held) are not
    sent; prefix blocks cached here are not recomputed (the engine's prefix cache).

When the push starts (`layerwise`, the default: `--kv-push layerwise`):

    layerwise:  add_request(notify_kv_ready) ─▶ KVReady (mid-step, engine/kv_ready.py)
                  ─▶ sender.start (announce, while the prompt computes) ─▶
                  CUDA + mapped link: send_layers_after(layer events): layer n's copy runs
                    on the GPU as soon as layer n is computed, overlapping layers n+1..L-1
                  otherwise: send_layer ×L once the step's output arrived (KV written)
    after-step: the step ends ─▶ block table ─▶ sender.start ─▶ send_layer ×L

so with layerwise push on one host's GPUs the handoff adds about the last layer's copy to
the time the decode worker can start, not the whole transfer and its announce. A request
that ends at its first token cancels its early transfer (TransferResult SKIPPED as before).

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
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from common.contract.control_server import add_call, add_stream
from common.contract.finish_reason import FinishReason
from common.contract.protocol import (AbortRequest, AbortResponse, DecodeDestination, ErrorCode,
                                      Message, PrefillRequest, PrefillResult, TransferResult,
                                      TransferStatus)
from common.worker.metrics import WorkerMetrics
from common.worker.output_frames import error_frame, to_token_logprob
from engine.engine_thread import EngineThread
from engine.kv_ready import KVReady
from engine.kv_storage import KVStorage
from engine.llm_engine import RequestOutput
from engine.request import RequestMode
from engine.request_stream import StreamEnd
from kv_transfer.errors import KVTransferError, TransferCancelled
from kv_transfer.interface import KVSender, SendHandle, TransferSpec
from kv_transfer.layout import transfer_bytes
from prefill_workers.early_push import EarlyPush, log_push_error
from prefill_workers.push_plan import plan_push

log = logging.getLogger(__name__)
T = TypeVar("T")
# A push that landed before (or just after) its prompt's step ended hid all of its time
# behind the compute; it is recorded as this long, so the send rate stays finite.
MIN_EXPOSED_PUSH_S = 1e-4


@dataclass(slots=True)
class _Active:
    request_id: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    abort_reason: str = ""
    pushing: bool = False  # blocks are being read by the sender: only the stream frees them
    early: EarlyPush | None = None  # a push started mid-step (it watches its own stop)

    def abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.aborted.set()
        if self.early is not None:
            self.early.stop(reason)


class PrefillWorker:
    def __init__(self, metrics: WorkerMetrics, make_sender: Callable[[KVStorage], KVSender],
                 transfer_layer_delay_s: float = 0.0, fault_request_prefix: str = "",
                 layerwise_push: bool = True) -> None:
        self.metrics = metrics
        self._make_sender = make_sender
        self.layerwise_push = layerwise_push  # start pushing mid-step (see the module doc)
        self._pushes: set[asyncio.Task[TransferResult]] = set()
        # Fault injection for tests: pushes of requests whose id starts with the prefix
        # sleep before each layer, so a transfer can be stalled or cut mid-way.
        self.transfer_layer_delay_s = transfer_layer_delay_s
        self.fault_request_prefix = fault_request_prefix
        self.engine: EngineThread | None = None
        self.sender: KVSender | None = None
        self.draining = False
        self._active: dict[str, _Active] = {}

    # ---------------------------------------------------------------- RoleWorker

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    @property
    def kv_address(self) -> str | None:
        return None  # a sender only

    def add_routes(self, app: web.Application) -> None:
        add_stream(app, "/internal/prefill", PrefillRequest, self.prefill)
        add_call(app, "/internal/abort", AbortRequest, self.abort)

    async def attach(self, engine: EngineThread) -> None:
        self.engine = engine
        self.sender = self._make_sender(engine.kv_storage)

    def state(self) -> dict[str, object]:
        return {"num_active": len(self._active), "active": sorted(self._active)}

    def check_invariants(self) -> None:
        for rid, active in self._active.items():
            assert active.request_id == rid, f"{rid} tracked under another id"
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
        stream = engine.open_stream(rid)
        in_engine = False
        early: EarlyPush | None = None
        layerwise = self.layerwise_push and request.destination is not None
        try:
            await engine.call(lambda e: e.add_request(
                rid, request.prompt_token_ids, params, request.priority,
                RequestMode.PREFILL_ONLY, notify_kv_ready=layerwise))
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

    def _start_early_push(self, request: PrefillRequest, ready: KVReady, active: _Active,
                          deadline: float) -> EarlyPush | None:
        """Announce and queue the push of `ready`'s blocks now, while its step computes."""
        destination = request.destination
        assert destination is not None  # only requests with one asked for a KVReady
        spec = plan_push(request.request_id, ready.block_ids, destination.block_ids,
                         destination.num_prefix_blocks_held, ready.num_prompt_tokens,
                         self.block_size, self.num_layers)
        if spec is None:
            return None  # the destination holds it all: nothing to send, as after the step
        active.pushing = True  # from here only this stream may free the blocks
        early = EarlyPush(layer_events=ready.layer_events)
        early.task = asyncio.get_running_loop().create_task(
            self._push(spec, destination, active, deadline, early))
        self._pushes.add(early.task)
        early.task.add_done_callback(self._pushes.discard)
        early.task.add_done_callback(log_push_error)
        active.early = early
        return early

    @property
    def block_size(self) -> int:
        assert self.engine is not None
        return self.engine.block_size

    @property
    def num_layers(self) -> int:
        assert self.engine is not None
        return self.engine.num_layers
    async def _after_first_token(self, request: PrefillRequest, out: RequestOutput,
                                 active: _Active, deadline: float,
                                 early: EarlyPush | None) -> AsyncGenerator[Message, None]:
        assert self.engine is not None
        rid = request.request_id
        destination = request.destination
        pushing = early is not None and not out.finished
        spec = None
        if early is not None:
            if out.finished:
                early.stop("the request ended at its first token", counted=False)
            else:
                early.written_at = time.perf_counter()
                early.written.set()  # the step's output arrived: its KV is written
        elif destination is not None and not out.finished:
            src = await self.engine.call(lambda e: e.kv_cache.block_table(rid))
            active.pushing = True  # from here only this stream may free the blocks
            spec = plan_push(rid, src, destination.block_ids,
                             destination.num_prefix_blocks_held, out.num_prompt_tokens,
                             self.engine.block_size, self.engine.num_layers)
            pushing = spec is not None
        yield PrefillResult(
            request_id=rid, first_token_id=out.new_token_ids[0],
            first_logprob=to_token_logprob(out.logprobs[0]) if out.logprobs else None,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
            transfer_status=TransferStatus.PENDING if pushing else TransferStatus.SKIPPED,
            finish_reason=out.finish_reason, num_steps=out.num_steps)
        if destination is None:
            return
        if not pushing:
            yield TransferResult(request_id=rid, destination_worker_id=destination.worker_id,
                                 destination_epoch=destination.epoch,
                                 status=TransferStatus.SKIPPED)
            return
        if early is not None:
            yield await early.task
            return
        assert spec is not None
        yield await self._push(spec, destination, active, deadline, None)

    async def _push(self, spec: TransferSpec, destination: DecodeDestination, active: _Active,
                    deadline: float, early: EarlyPush | None) -> TransferResult:
        """Announce and move `spec`; `early`: started mid-step (its KV may not be written
        yet: queue behind the layer events, or wait for `early.written`)."""
        assert self.engine is not None and self.sender is not None
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        handle: SendHandle | None = None
        stop = early.stopped if early is not None else active.aborted
        active.pushing = True
        try:
            handle = await _unless(self.sender.start(destination.kv_address, spec,
                                                     max(deadline - loop.time(), 0.001)),
                                   stop, lambda: _stop_reason(active, early))
            delayed = self.transfer_layer_delay_s > 0 and \
                spec.request_id.startswith(self.fault_request_prefix)
            events = early.layer_events if early is not None else None
            start = "after_step" if early is None else "mid_step"
            if events is not None and handle.sends_after_events and not delayed:
                accepted = time.perf_counter()
                handle.send_layers_after(events)
                start = "layer_events"
                log.debug("push %s: started %.6f, accepted %.6f, copies queued %.6f",
                          spec.request_id, started, accepted, time.perf_counter())
            else:
                if early is not None:
                    await _unless(early.written.wait(), stop,
                                  lambda: _stop_reason(active, early))
                for layer in spec.layers:
                    if delayed:
                        await asyncio.sleep(self.transfer_layer_delay_s)
                    if handle.state.is_terminal or stop.is_set():
                        break
                    handle.send_layer(layer)
            if stop.is_set():
                raise TransferCancelled(_stop_reason(active, early))
            await _unless(handle.finish(), stop, lambda: _stop_reason(active, early))
        except KVTransferError as exc:
            if handle is not None and not handle.state.is_terminal:
                await handle.cancel(str(exc))  # tells the receiver, which frees its blocks
            reason = type(exc).__name__
            if early is None or early.counted:
                self.metrics.handoff_failures.inc(reason=f"transfer_{reason}")
            log.info("KV push of %s failed: %s", spec.request_id, exc)
            return _transfer_result(spec, destination, TransferStatus.FAILED,
                                    error=f"{reason}: {exc}")
        num_blocks = len(spec.src_block_ids)
        num_bytes = transfer_bytes(self.engine.kv_layout, num_blocks, len(spec.layers))
        log.debug("push %s (%s): step output %s, landed %.6f", spec.request_id, start,
                  None if early is None else early.written_at, time.perf_counter())
        if early is not None:
            # What the handoff added is the part after the prompt's step (the rate the router
            # predicts handoffs with must not count the prompt's compute it overlapped).
            step_end = early.written_at if early.written_at is not None else time.perf_counter()
            started = max(started, step_end)
        self.metrics.record_kv_sent(num_bytes, max(time.perf_counter() - started,
                                                   MIN_EXPOSED_PUSH_S))
        self.metrics.kv_transfer_blocks.inc(num_blocks, direction="sent")
        self.metrics.kv_transfers.inc(direction="sent",
                                      path="mapped" if handle.mapped else "data_plane")
        self.metrics.kv_pushes.inc(start=start)
        return _transfer_result(spec, destination, TransferStatus.DONE,
                                num_blocks_sent=num_blocks, num_bytes_sent=num_bytes)

    # ---------------------------------------------------------------- abort

    async def abort(self, request: AbortRequest) -> Message:
        found = self.abort_request(request.request_id, request.reason or "aborted by the gateway")
        self.metrics.aborts.inc(found="yes" if found else "no")
        return AbortResponse(request_id=request.request_id, found=found)

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


def _stop_reason(active: _Active, early: EarlyPush | None) -> str:
    if early is not None and early.reason:
        return early.reason
    return active.abort_reason or "aborted"


async def _unless(awaitable: Awaitable[T], stop: asyncio.Event, reason: Callable[[], str]) -> T:
    """Await `awaitable` unless `stop` is set first (then raise TransferCancelled(reason()))."""
    work = asyncio.ensure_future(awaitable)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        waiter.cancel()
    if work.done():
        return work.result()
    work.cancel()
    raise TransferCancelled(reason())


def _transfer_result(spec: TransferSpec, destination: DecodeDestination, status: TransferStatus,
                     num_blocks_sent: int = 0, num_bytes_sent: int = 0,
                     error: str | None = None) -> TransferResult:
    return TransferResult(request_id=spec.request_id, destination_worker_id=destination.worker_id,
                          destination_epoch=destination.epoch, status=status, error=error,
                          num_blocks_sent=num_blocks_sent, num_bytes_sent=num_bytes_sent)
