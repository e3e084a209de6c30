"""One decode stream's frames: the engine's outputs for a request, as TokenFrames.

`DecodeStream` is the request's stream (engine/request_stream.py) as the decode half opens
it. `stream_frames` reads it: each read takes every output ready now and sends them as one
TokenFrame (worker/output_frames.py). Once the first frame is out, a plain token (not the
last, not an error) does not wait for the task: `DecodeStream.put`, in the engine thread's
delivery callback, sends it as its own frame through the stream's FrameWriter
(rpc/control_app.py) while the task waits, so a token costs no task wake-up, no timeout
context and no generator hop (benchmarks/worker_streams.py). The last token, an end, and
anything the writer refuses (a paused or closed channel) go through the task.

An end put on the stream by the worker (abort, shutdown, failure) wins over outputs read
with it: after an end, no token is sent (the abort's `num_tokens_sent` relies on it). The
request's outcome is counted once, in `pdserve_requests_total`.

Invariants (`DecodeStream.check_invariants`):
  * frames leave in the order put() got the outputs: put() sends directly only while the
    task waits in next() with nothing queued (`_waiting`), so everything before was sent;
  * `_waiting` implies an empty queue: any item that goes to the queue clears it;
  * a StreamEnd or KVReady always goes to the queue; a writer that raises is dropped
    (logged) and its output queued;
  * `num_tokens_sent` counts exactly the tokens sent, by either way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from engine.llm_engine import RequestOutput
from engine.request_stream import RequestStream, StreamEnd, StreamItem
from protocol.messages import ErrorCode, ErrorFrame, TokenFrame
from rpc.control_app import FrameWriter
from worker.metrics import WorkerMetrics
from worker.output_frames import error_frame, frame_outcome, merge_outputs

log = logging.getLogger(__name__)


class DecodeStream(RequestStream):
    """A decode request's stream: plain tokens leave from put() while the task waits."""

    def __init__(self, request_id: str, out: FrameWriter | None) -> None:
        super().__init__(request_id)
        self.num_tokens_sent = 0
        self._out = out  # None: every frame through the task (a traced request)
        self._direct = False  # the first frame is out: put() may send
        self._waiting = False  # the task waits in next() and everything before was sent

    def put(self, item: StreamItem) -> None:
        if self._waiting and self._direct and isinstance(item, RequestOutput) \
                and item.finish_reason is None and self._send(item):
            return
        self._waiting = False
        self.queue.put_nowait(item)

    def _send(self, output: RequestOutput) -> bool:
        out = self._out
        assert out is not None
        try:
            if not out.send(merge_outputs(self.request_id, (output,))):
                return False
        except Exception:  # a broken writer must not stop the step's other streams
            log.exception("%s: sending a token from the delivery callback failed; the "
                          "stream's task takes over", self.request_id)
            self._direct = False
            return False
        self.num_tokens_sent += len(output.new_token_ids)
        return True

    def first_frame_sent(self) -> None:
        """From now on put() may send plain tokens itself."""
        self._direct = self._out is not None

    async def next(self, timeout_s: float) -> StreamItem:
        self._waiting = self.queue.empty()
        try:
            return await super().next(timeout_s)
        finally:
            self._waiting = False

    def check_invariants(self) -> None:
        assert not (self._waiting and not self.queue.empty()), \
            f"{self.request_id}: the task waits while items are queued"
        assert self.num_tokens_sent >= 0


async def stream_frames(stream: DecodeStream, deadline: float, metrics: WorkerMetrics
                        ) -> AsyncGenerator[TokenFrame | ErrorFrame, None]:
    """The frames of the request's stream until it finishes, ends (abort, shutdown) or
    passes `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    rid = stream.request_id
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
        if outputs and end is None:  # after an end, nothing more is sent
            frame = merge_outputs(rid, outputs)
            if isinstance(frame, TokenFrame):
                stream.num_tokens_sent += len(frame.token_ids)
            yield frame
            if (outcome := frame_outcome(frame)) is not None:
                metrics.requests.inc(outcome=outcome)
                return
            if first:
                first = False
                stream.first_frame_sent()
        if end is not None:
            metrics.requests.inc(outcome="aborted")
            code = ErrorCode.ABORTED if end.error is None else ErrorCode.INTERNAL
            yield error_frame(rid, code, f"request ended: {end.reason}")
            return
