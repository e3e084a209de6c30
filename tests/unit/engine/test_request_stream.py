"""RequestStream, the plain queue between the engine thread's delivery and a request's
consumer task: every item once, in the order put() got it, by next() or take_ready().
(The decode stream that sends tokens from put() itself: tests/unit/worker/test_stream_frames.py.)"""

from __future__ import annotations

import asyncio

import pytest

from engine.kv_ready import KVReady
from engine.llm_engine import RequestOutput
from engine.request_stream import RequestStream, StreamEnd
from protocol.finish_reason import FinishReason


def _out(token: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", [token], f"<{token}>", [None], finish, 4, token, 0)


def _name(item: object) -> str:
    return f"out {item.new_token_ids[0]}" if isinstance(item, RequestOutput) \
        else type(item).__name__


def test_items_reach_a_waiting_consumer_in_the_order_they_were_put() -> None:
    async def main() -> list[str]:
        stream = RequestStream("r")
        taken: list[str] = []

        async def consume() -> None:
            while "StreamEnd" not in taken:
                items = [await stream.next(5.0), *stream.take_ready()]
                taken.extend(_name(item) for item in items)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the consumer waits
        stream.put(KVReady("r", (1,), 4, None))
        stream.put(_out(0))
        await asyncio.sleep(0)
        for i in range(1, 4):  # no wake-up between them: one take_ready
            stream.put(_out(i))
        stream.end("aborted")
        stream.put(_out(4))  # after the end: still queued behind it, never before
        await consumer
        return taken

    assert asyncio.run(main()) == ["KVReady", "out 0", "out 1", "out 2", "out 3", "StreamEnd",
                                   "out 4"]


def test_take_ready_takes_exactly_what_is_queued_now() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        assert stream.take_ready() == []
        outputs = [_out(0), _out(1), _out(2, FinishReason.STOP)]
        for out in outputs:
            stream.put(out)
        assert await stream.next(0.0) is outputs[0]  # queued: no wait, even with no time left
        assert stream.take_ready() == outputs[1:]
        assert stream.take_ready() == [] and stream.queue.empty()

    asyncio.run(main())


def test_an_end_carries_its_reason_and_error() -> None:
    async def main() -> StreamEnd:
        stream = RequestStream("r")
        stream.end("engine failed", RuntimeError("boom"))
        item = await stream.next(1.0)
        assert isinstance(item, StreamEnd)
        return item

    end = asyncio.run(main())
    assert end.reason == "engine failed" and isinstance(end.error, RuntimeError)


def test_next_times_out_when_nothing_comes_and_loses_nothing_put_later() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        with pytest.raises(TimeoutError):
            await stream.next(0.01)
        with pytest.raises(TimeoutError):
            await stream.next(-1.0)  # a deadline already past
        stream.put(_out(7))
        assert (await stream.next(1.0)).new_token_ids == [7]

    asyncio.run(main())
