"""A worker's trace spans for one request, read off the frames it streams back.

    traced_prefill(tracing, produce, backend)   span "prefill" (tokens, cached tokens,
                                                chunks) and its child "kv_transfer" (bytes,
                                                blocks, backend, GB/s), from the
                                                PrefillResult and TransferResult frames
    traced_decode(tracing, produce)             span "decode" (tokens, steps, finish)

Each wraps a stream producer (rpc/control_server.py's `add_stream`) and yields its frames
unchanged. A request without a `traceparent` (the gateway traces
nothing) or a worker with tracing off gets the producer itself: no wrapper at all. The
spans are children of the gateway's request span named by the message's `traceparent`;
they end when the stream ends, however it ends (an ErrorFrame marks them failed).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable

from protocol.messages import (DecodeRequest, ErrorFrame, Message, PrefillRequest, PrefillResult,
                               TokenFrame, TransferResult)
from rpc.control_app import FrameWriter
from telemetry.tracing import Span, Tracing

ProducePrefill = Callable[[PrefillRequest, FrameWriter], AsyncGenerator[Message, None]]
# A decode producer given no writer sends every frame through its task (worker/stream_frames.py).
ProduceDecode = Callable[[DecodeRequest, FrameWriter | None], AsyncGenerator[Message, None]]


def traced_prefill(tracing: Tracing, produce: ProducePrefill, backend: str) -> ProducePrefill:
    def run(request: PrefillRequest, out: FrameWriter) -> AsyncGenerator[Message, None]:
        if not tracing.enabled or request.traceparent is None:
            return produce(request, out)
        return _prefill_spans(tracing, produce(request, out), request, backend)

    return run


def traced_decode(tracing: Tracing, produce: ProduceDecode) -> ProduceDecode:
    def run(request: DecodeRequest, out: FrameWriter | None) -> AsyncGenerator[Message, None]:
        if not tracing.enabled or request.traceparent is None:
            return produce(request, out)
        # Every frame through the span's counters: none sent from the delivery callback.
        return _decode_spans(tracing, produce(request, None), request)

    return run


async def _prefill_spans(tracing: Tracing, frames: AsyncGenerator[Message, None],
                         request: PrefillRequest, backend: str) -> AsyncGenerator[Message, None]:
    span = tracing.start("prefill", request.traceparent, kind="server", attributes={
        "pdserve.request_id": request.request_id,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        "pdserve.kv.destination": request.destination.worker_id if request.destination else None})
    transfer: Span | None = None
    transfer_started = 0.0
    try:
        async with contextlib.aclosing(frames):
            async for frame in frames:
                if isinstance(frame, PrefillResult):
                    span.set({"pdserve.prefill.tokens": frame.num_prompt_tokens,
                              "pdserve.prefill.cached_tokens": frame.num_cached_tokens,
                              "pdserve.prefill.chunks": frame.num_steps,
                              "pdserve.kv.transfer_status": frame.transfer_status.value})
                    span.event("first_token")
                    yield frame
                    # Asked for the next frame: the push starts now.
                    if request.destination is not None or request.destination_follows:
                        transfer = span.child("kv_transfer", {"pdserve.kv.backend": backend})
                        transfer_started = time.perf_counter()
                    continue
                if isinstance(frame, TransferResult) and transfer is not None:
                    seconds = max(time.perf_counter() - transfer_started, 1e-9)
                    span.set({"pdserve.kv.destination": frame.destination_worker_id})
                    transfer.set({"pdserve.kv.bytes": frame.num_bytes_sent,
                                  "pdserve.kv.blocks": frame.num_blocks_sent,
                                  "pdserve.kv.descriptors": frame.num_descriptors,
                                  "pdserve.kv.post_ms": frame.post_ms,
                                  "pdserve.kv.wire_ms": frame.wire_ms,
                                  "pdserve.kv.status": frame.status.value,
                                  "pdserve.kv.gbps": round(frame.num_bytes_sent / seconds / 1e9, 6)})
                    if frame.error:
                        transfer.fail("transfer_failed", frame.error)
                    transfer.end()
                    transfer = None
                elif isinstance(frame, ErrorFrame):
                    span.fail(frame.code.value, frame.message)
                yield frame
    finally:
        if transfer is not None:
            transfer.fail("cancelled", "the stream ended before the transfer")
            transfer.end()
        span.end()


async def _decode_spans(tracing: Tracing, frames: AsyncGenerator[Message, None],
                        request: DecodeRequest) -> AsyncGenerator[Message, None]:
    span = tracing.start("decode", request.traceparent, kind="server", attributes={
        "pdserve.request_id": request.request_id,
        "pdserve.prefill.local": request.is_local_prefill,
        "gen_ai.request.max_tokens": request.sampling.max_tokens})
    num_tokens = 0
    ended = False
    try:
        async with contextlib.aclosing(frames):
            async for frame in frames:
                last = False
                if isinstance(frame, TokenFrame):
                    if num_tokens == 0 and frame.token_ids:
                        span.event("first_token")
                    num_tokens += len(frame.token_ids)
                    if frame.usage is not None:
                        span.set({"gen_ai.usage.input_tokens": frame.usage.num_prompt_tokens,
                                  "gen_ai.usage.output_tokens": frame.usage.num_completion_tokens,
                                  "pdserve.decode.steps": frame.usage.num_steps})
                    if frame.finish_reason is not None:
                        span.set({"gen_ai.response.finish_reasons": [frame.finish_reason.value]})
                        last = True
                elif isinstance(frame, ErrorFrame):
                    span.fail(frame.code.value, frame.message)
                    last = True
                if last:
                    # Ended before the last frame leaves: the span lies inside the caller's,
                    # which ends on reading that frame.
                    span.set({"pdserve.decode.tokens": num_tokens})
                    span.end()
                    ended = True
                yield frame
    finally:
        if not ended:
            span.set({"pdserve.decode.tokens": num_tokens})
            span.end()
