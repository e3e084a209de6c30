"""One request's KV push from a prefill worker: announce, the layers, finish, its result.

    start (announce; the receiver checks the layout) ─▶ the layers:
        CUDA + a mapped link, started mid-step: every layer's copy queued on the GPU
            behind that layer's event (the copies overlap the layers still computing)
        otherwise: once the KV is written (`early.written`), send_layer for each layer
    ─▶ finish (the receiver's Landed) ─▶ TransferResult DONE
    a transfer error ─▶ cancel (the receiver frees its blocks) ─▶ TransferResult FAILED
    `stop` set (an abort, or the request ended) ─▶ TransferCancelled ─▶ FAILED

Every push starts mid-step, from the prompt's KVReady (worker/prefill_half.py). The request
deadline bounds the announce and the finish. The time recorded for a push is the part after
the prompt's step ended: the rate the router predicts handoffs with must not count the
compute the push overlapped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kv_transfer.errors import KVTransferError, TransferCancelled
from kv_transfer.interface import KVSender, SendHandle, TransferSpec
from kv_transfer.layout import KVLayout, TransferPlan, transfer_bytes
from protocol.messages import DecodeDestination, TransferResult, TransferStatus
from worker.faults import Faults
from worker.handoff import EarlyPush
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")
# A push that landed before (or just after) its prompt's step ended hid all of its time
# behind the compute; it is recorded as this long, so the send rate stays finite.
MIN_EXPOSED_PUSH_S = 1e-4


class KVPusher:
    def __init__(self, sender: KVSender, kv_layout: KVLayout, metrics: WorkerMetrics,
                 faults: Faults) -> None:
        """`faults`: what a test injected (worker/faults.py): a delayed push sleeps
        before each layer, so a transfer can be stalled or cut mid-way."""
        self.sender = sender
        self.kv_layout = kv_layout
        self.metrics = metrics
        self.faults = faults

    async def push(self, spec: TransferSpec, destination: DecodeDestination,
                   stop: asyncio.Event, reason: Callable[[], str], deadline: float,
                   early: EarlyPush) -> TransferResult:
        """Announce and move `spec`; `early`: the push, started mid-step (its KV may not be
        written yet: queue behind the layer events, or wait for `early.written`)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        handle: SendHandle | None = None
        try:
            handle = await unless(self.sender.start(destination.kv_address, spec,
                                                    max(deadline - loop.time(), 0.001)),
                                  stop, reason)
            post_s = time.perf_counter() - started  # announcing it, then queueing each layer
            delayed = self.faults.delays_push(spec.request_id)
            events = early.layer_events
            start = "mid_step"
            if events is not None and handle.sends_after_events and not delayed:
                accepted = time.perf_counter()
                handle.send_layers_after(events)
                post_s += time.perf_counter() - accepted
                start = "layer_events"
                log.debug("push %s: started %.6f, accepted %.6f, copies queued %.6f",
                          spec.request_id, started, accepted, time.perf_counter())
            else:
                await unless(early.written.wait(), stop, reason)
                for layer in spec.layers:
                    if delayed:
                        await asyncio.sleep(self.faults.transfer_layer_delay_s)
                    if handle.state.is_terminal or stop.is_set():
                        break
                    posting = time.perf_counter()
                    handle.send_layer(layer)
                    post_s += time.perf_counter() - posting
            if stop.is_set():
                raise TransferCancelled(reason())
            posted = time.perf_counter()
            await unless(handle.finish(), stop, reason)
            wire_s = time.perf_counter() - posted
        except KVTransferError as exc:
            if handle is not None and not handle.state.is_terminal:
                await handle.cancel(str(exc))  # tells the receiver, which frees its blocks
            name = type(exc).__name__
            if early.counted:
                self.metrics.handoff_failures.inc(reason=f"transfer_{name}")
            log.info("KV push of %s failed: %s", spec.request_id, exc)
            return transfer_result(spec.request_id, destination, TransferStatus.FAILED,
                                   error=f"{name}: {exc}")
        num_blocks = len(spec.src_block_ids)
        num_bytes = transfer_bytes(self.kv_layout, num_blocks, len(spec.layers))
        log.debug("push %s (%s): step output %s, landed %.6f", spec.request_id, start,
                  early.written_at, time.perf_counter())
        step_end = early.written_at if early.written_at is not None else time.perf_counter()
        started = max(started, step_end)
        self.metrics.record_kv_sent(num_bytes, max(time.perf_counter() - started,
                                                   MIN_EXPOSED_PUSH_S))
        self.metrics.kv_transfer_blocks.inc(num_blocks, direction="sent")
        self.metrics.kv_transfers.inc(direction="sent",
                                      path="mapped" if handle.mapped else "carrier")
        self.metrics.kv_pushes.inc(start=start)
        num_descriptors = TransferPlan(self.kv_layout, spec).num_messages
        self.metrics.record_push_cost(num_bytes, num_descriptors, post_s, wire_s)
        return transfer_result(spec.request_id, destination, TransferStatus.DONE,
                               num_blocks_sent=num_blocks, num_bytes_sent=num_bytes,
                               num_descriptors=num_descriptors, post_ms=round(post_s * 1e3, 3),
                               wire_ms=round(wire_s * 1e3, 3))


async def unless(awaitable: Awaitable[T], stop: asyncio.Event, reason: Callable[[], str]) -> T:
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


def transfer_result(request_id: str, destination: DecodeDestination, status: TransferStatus,
                    num_blocks_sent: int = 0, num_bytes_sent: int = 0,
                    error: str | None = None, num_descriptors: int = 0, post_ms: float = 0.0,
                    wire_ms: float = 0.0) -> TransferResult:
    return TransferResult(request_id=request_id, destination_worker_id=destination.worker_id,
                          destination_epoch=destination.epoch, status=status, error=error,
                          num_blocks_sent=num_blocks_sent, num_bytes_sent=num_bytes_sent,
                          num_descriptors=num_descriptors, post_ms=post_ms, wire_ms=wire_ms)
