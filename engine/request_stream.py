"""One request's outputs on their way from the engine thread to the task that streams them.

    put(item)        loop thread: an output, a KVReady or a StreamEnd (EngineThread delivers
                     each step's outputs; the worker ends a stream on abort or shutdown)
    next(timeout_s)  the consumer task: the next item, in order
    take_ready()     the consumer task: every item queued now

`EngineThread.open_stream` takes a subclass where the consumer wants to act on an item as
it is delivered rather than when its task next runs (worker/stream_frames.py): `put` runs
on the event loop, in the engine thread's delivery callback, one call per item in order.

Invariant: items reach the consumer in the order put() got them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.kv_ready import KVReady
from engine.llm_engine import RequestOutput


@dataclass(slots=True)
class StreamEnd:
    """Put on a request's queue when it ends outside the engine (abort, shutdown, failure)."""

    reason: str
    error: BaseException | None = None


# What a request's stream carries: a KVReady only for requests added with notify_kv_ready,
# and then before the output of the step that sent it.
StreamItem = RequestOutput | StreamEnd | KVReady


class RequestStream:
    """The outputs of one request, in order, as the engine thread produced them."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()

    def put(self, item: StreamItem) -> None:
        self.queue.put_nowait(item)

    def end(self, reason: str, error: BaseException | None = None) -> None:
        self.put(StreamEnd(reason, error))

    async def next(self, timeout_s: float) -> StreamItem:
        """The next item; raises TimeoutError after timeout_s."""
        async with asyncio.timeout(max(timeout_s, 0.0)):
            return await self.queue.get()

    def take_ready(self) -> list[StreamItem]:
        items = []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items
