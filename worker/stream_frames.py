"""One decode stream's frames: the engine's outputs for a request, merged per read.

Each read takes every output ready now and sends them as one TokenFrame (common/worker/
output_frames.py). Given the channel's FrameLane, once the first frame is out, each plain
token (not the last, not an error) leaves from the engine thread's delivery callback
straight through the lane (`RequestStream.direct`), one frame per output, while this
generator waits; the last token, an end and anything the lane refuses come here. An end
put on the stream by the worker (abort, shutdown, failure) wins over outputs read with it:
after an end, no token is sent (the abort's `num_tokens_sent` relies on it). The
request's outcome is counted once, in `pdserve_requests_total`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from functools import partial

from engine.llm_engine import RequestOutput
from engine.request_stream import RequestStream, StreamEnd
from protocol.messages import ErrorCode, ErrorFrame, TokenFrame
from rpc.control_app import FrameLane
from worker.metrics import WorkerMetrics
from worker.output_frames import error_frame, frame_outcome, merge_outputs


def send_direct(rid: str, stream: RequestStream, lane: FrameLane, out: RequestOutput) -> bool:
    """`out` as its own frame through the lane, unless it ends the request."""
    if out.finish_reason is not None:
        return False
    frame = merge_outputs(rid, (out,))
    if not lane.send(frame):
        return False
    stream.num_tokens_sent += len(out.new_token_ids)
    return True


async def stream_frames(rid: str, stream: RequestStream, deadline: float,
                        metrics: WorkerMetrics, lane: FrameLane | None = None
                        ) -> AsyncGenerator[TokenFrame | ErrorFrame, None]:
    """The frames of `rid`'s stream until it finishes, ends (abort, shutdown) or passes
    `deadline` (loop time); `stream.num_tokens_sent` counts the tokens sent, by either
    path."""
    loop = asyncio.get_running_loop()
    first = True
    while True:
        try:
            item = await stream.next(deadline - loop.time())
        except TimeoutError:
            metrics.handoff_failures.inc(reason="decode_deadline")
            yield error_frame(rid, ErrorCode.DEADLINE_EXCEEDED, "request deadline passed")
            return
        items = [item, *stream.take_ready()]
        outputs = [i for i in items if isinstance(i, RequestOutput)]  # no KVReady here
        end = next((i for i in items if isinstance(i, StreamEnd)), None)
        if outputs and first:
            metrics.record_started(outputs[0].num_prompt_tokens, outputs[0].num_cached_tokens)
            first = False
        if outputs and end is None:  # after an end, nothing more is sent
            frame = merge_outputs(rid, outputs)
            if isinstance(frame, TokenFrame):
                stream.num_tokens_sent += len(frame.token_ids)
            yield frame
            if (outcome := frame_outcome(frame)) is not None:
                metrics.requests.inc(outcome=outcome)
                return
            if lane is not None and stream.direct is None:  # the first frame is out
                stream.direct = partial(send_direct, rid, stream, lane)
        if end is not None:
            metrics.requests.inc(outcome="aborted")
            code = ErrorCode.ABORTED if end.error is None else ErrorCode.INTERNAL
            yield error_frame(rid, code, f"request ended: {end.reason}")
            return
