"""One request's outputs on their way from the engine thread to the task that streams them.

    put(item)        loop thread: an output, a KVReady or a StreamEnd (EngineThread delivers
                     each step's outputs; the worker ends a stream on abort or shutdown)
    next(timeout_s)  the consumer task: the next item, in order
    take_ready()     the consumer task: every item queued now
    direct           the consumer's lane, optional: a plain output sent on straight from
                     put(), without waking the task (worker/stream_frames.py)

A decode stream's tokens are most of a worker's event-loop work: with a lane, put() hands
each one to the consumer's frame writer while the task sleeps in next(), so a token costs
no task wake-up, no timeout context and no generator hops (benchmarks/worker_streams.py).

Invariants:
  * items reach the consumer in the order put() got them: put() uses the lane only while
    the consumer waits in next() with nothing queued (`_waiting`), so every item before
    it was already taken and streamed;
  * `_waiting` implies an empty queue: any item that goes to the queue clears it;
  * a StreamEnd or KVReady always goes to the queue (an end wins over later outputs: the
    lane is shut the moment it is queued); the lane may refuse an output (returns False:
    a final token, a paused channel), which then queues too, and a lane that raises is
    dropped (logged) and its output queued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_ready import KVReady
from engine.llm_engine import RequestOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamEnd:
    """Put on a request's queue when it ends outside the engine (abort, shutdown, failure)."""

    reason: str
    error: BaseException | None = None


# What a request's stream carries: a KVReady only for requests added with notify_kv_ready,
# and then before the output of the step that sent it.
StreamItem = RequestOutput | StreamEnd | KVReady


@dataclass(slots=True)
class RequestStream:
    """The outputs of one request, in order, as the engine thread produced them."""

    request_id: str
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    num_tokens_sent: int = 0  # counted by the consumer (and its lane), for tokens passed on
    # Sends one output on now, True; False leaves it to the queue. Set by the consumer.
    direct: Callable[[RequestOutput], bool] | None = None
    _waiting: bool = False  # the consumer waits in next() and everything before is streamed

    def put(self, item: StreamItem) -> None:
        if self._waiting and self.direct is not None and isinstance(item, RequestOutput):
            try:
                if self.direct(item):
                    return
            except Exception:  # a broken lane must not stop the step's other streams
                log.exception("%s: the stream's lane failed; its task takes over",
                              self.request_id)
                self.direct = None
        self._waiting = False
        self.queue.put_nowait(item)

    def end(self, reason: str, error: BaseException | None = None) -> None:
        self.put(StreamEnd(reason, error))

    async def next(self, timeout_s: float) -> StreamItem:
        """The next item; raises TimeoutError after timeout_s."""
        self._waiting = self.queue.empty()
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await self.queue.get()
        finally:
            self._waiting = False

    def take_ready(self) -> list[StreamItem]:
        items = []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def check_invariants(self) -> None:
        assert not (self._waiting and not self.queue.empty()), \
            f"{self.request_id}: the lane is open with items queued"
