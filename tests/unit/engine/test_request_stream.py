"""RequestStream's order rule: its lane carries an output only while the consumer waits with
nothing queued, so items reach the consumer (and the wire) in the order they were put."""

from __future__ import annotations

import asyncio

from engine.kv_ready import KVReady
from engine.llm_engine import RequestOutput
from engine.request_stream import RequestStream
from protocol.finish_reason import FinishReason


def _out(token: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", [token], f"<{token}>", [None], finish, 4, token, 0)


class Wire:
    """What the consumer and the lane sent, in order; `accepts` False refuses the lane."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.accepts = True

    def direct(self, out: RequestOutput) -> bool:
        if not self.accepts or out.finished:
            return False
        self.sent.append(f"lane {out.new_token_ids[0]}")
        return True


async def _consume(stream: RequestStream, wire: Wire, until: int) -> None:
    """Takes items as a worker's stream task does, until `until` items are recorded (it
    checks on waking: the last item must come through the queue)."""
    while len(wire.sent) < until:
        items = [await stream.next(5.0), *stream.take_ready()]
        for item in items:
            stream.check_invariants()
            if isinstance(item, RequestOutput):
                wire.sent.append(f"task {item.new_token_ids[0]}")
            else:
                wire.sent.append(type(item).__name__)


def test_without_a_lane_every_item_goes_through_the_queue() -> None:
    async def main() -> list[str]:
        stream, wire = RequestStream("r"), Wire()
        consumer = asyncio.create_task(_consume(stream, wire, 3))
        await asyncio.sleep(0)
        for i in range(3):
            stream.put(_out(i))
            await asyncio.sleep(0)
        await consumer
        return wire.sent

    assert asyncio.run(main()) == ["task 0", "task 1", "task 2"]


def test_a_waiting_consumer_lets_plain_outputs_through_the_lane_and_keeps_the_last() -> None:
    async def main() -> list[str]:
        stream, wire = RequestStream("r"), Wire()
        stream.direct = wire.direct
        consumer = asyncio.create_task(_consume(stream, wire, 4))
        await asyncio.sleep(0)  # the consumer waits
        for i in range(3):
            stream.put(_out(i))  # no wake-up between them: all through the lane
        stream.put(_out(3, FinishReason.LENGTH))
        await consumer
        return wire.sent

    assert asyncio.run(main()) == ["lane 0", "lane 1", "lane 2", "task 3"]


def test_an_output_put_before_the_consumer_took_the_last_one_waits_its_turn() -> None:
    async def main() -> list[str]:
        stream, wire = RequestStream("r"), Wire()
        stream.direct = wire.direct
        consumer = asyncio.create_task(_consume(stream, wire, 4))
        await asyncio.sleep(0)
        wire.accepts = False
        stream.put(_out(0))  # refused: queued, the consumer is woken
        wire.accepts = True
        stream.put(_out(1))  # the consumer has not taken 0 yet: queued behind it
        await asyncio.sleep(0)  # it takes both
        stream.put(_out(2))  # it waits again: the lane
        stream.put(_out(3, FinishReason.STOP))
        await consumer
        return wire.sent

    assert asyncio.run(main()) == ["task 0", "task 1", "lane 2", "task 3"]


def test_an_end_and_a_kv_ready_always_queue_and_shut_the_lane() -> None:
    async def main() -> list[str]:
        stream, wire = RequestStream("r"), Wire()
        stream.direct = wire.direct
        consumer = asyncio.create_task(_consume(stream, wire, 4))
        await asyncio.sleep(0)
        stream.put(KVReady("r", (1,), 4, None))
        stream.put(_out(0))  # behind the KVReady
        await asyncio.sleep(0)
        stream.end("aborted")
        stream.put(_out(1))  # after the end: queued behind it, never through the lane
        await consumer
        return wire.sent

    assert asyncio.run(main()) == ["KVReady", "task 0", "StreamEnd", "task 1"]


def test_a_deadline_passes_while_tokens_flow_through_the_lane() -> None:
    async def main() -> tuple[list[str], bool]:
        stream, wire = RequestStream("r"), Wire()
        stream.direct = wire.direct
        waiter = asyncio.create_task(stream.next(0.05))
        await asyncio.sleep(0)
        stream.put(_out(0))
        try:
            await waiter
        except TimeoutError:
            return wire.sent, True
        return wire.sent, False

    assert asyncio.run(main()) == (["lane 0"], True)


def test_a_lane_that_raises_is_dropped_and_its_output_queued() -> None:
    async def main() -> list[str]:
        stream, wire = RequestStream("r"), Wire()

        def broken(out: RequestOutput) -> bool:
            raise RuntimeError("lane bug")

        stream.direct = broken
        consumer = asyncio.create_task(_consume(stream, wire, 2))
        await asyncio.sleep(0)
        stream.put(_out(0))
        await asyncio.sleep(0)
        assert stream.direct is None
        stream.put(_out(1, FinishReason.STOP))
        await consumer
        return wire.sent

    assert asyncio.run(main()) == ["task 0", "task 1"]
