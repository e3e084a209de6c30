"""A decode stream's frames: `DecodeStream` sends a plain token from put() through the
stream's writer only while its task waits with nothing queued, so frames leave in the order
the outputs were put, whichever way each one goes; `stream_frames` sends the rest and counts
every token sent, by either way, exactly."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.kv_ready import KVReady
from engine.llm_engine import RequestOutput
from protocol.finish_reason import FinishReason
from protocol.messages import ErrorFrame, Message, TokenFrame
from telemetry.metrics import MetricsRegistry
from worker.metrics import WorkerMetrics
from worker.stream_frames import DecodeStream, stream_frames


def _out(*tokens: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", list(tokens), "".join(f"<{t}>" for t in tokens),
                         [None] * len(tokens), finish, 4, tokens[-1] + 1, 1)


class Wire:
    """What left for the client, in order: "sent …" through the writer (a FrameWriter
    stand-in), "task …" by the stream's task. `accepts` False refuses, like a paused channel;
    `broken` raises."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.accepts = True
        self.broken = False
        self.num_sends = 0  # calls, refused ones included

    def send(self, frame: Message) -> bool:
        self.num_sends += 1
        if self.broken:
            raise RuntimeError("writer bug")
        if not self.accepts:
            return False
        assert isinstance(frame, TokenFrame)
        self.log.append(f"sent {frame.token_ids}" + _finish(frame))
        return True


def _finish(frame: TokenFrame) -> str:
    return f" {frame.finish_reason.value}" if frame.finish_reason is not None else ""


async def _consume(stream: DecodeStream, wire: Wire, until: int) -> None:
    """Takes items as a worker's stream task does, until `until` entries are on the wire
    (it checks on waking: the last one must come through the queue)."""
    while len(wire.log) < until:
        items = [await stream.next(5.0), *stream.take_ready()]
        stream.check_invariants()
        for item in items:
            if isinstance(item, RequestOutput):
                finish = item.finish_reason
                wire.log.append(f"task {item.new_token_ids}"
                                + (f" {finish.value}" if finish is not None else ""))
            else:
                wire.log.append(type(item).__name__)


def _stream(wire: Wire | None, first_frame_out: bool = True) -> DecodeStream:
    stream = DecodeStream("r", wire)
    if first_frame_out:
        stream.first_frame_sent()
    return stream


# ---------------------------------------------------------------- DecodeStream


def test_without_a_writer_every_item_goes_through_the_queue() -> None:
    async def main() -> tuple[list[str], int]:
        stream, wire = _stream(None), Wire()
        consumer = asyncio.create_task(_consume(stream, wire, 3))
        await asyncio.sleep(0)
        for i in range(3):
            stream.put(_out(i))
            await asyncio.sleep(0)
        await consumer
        return wire.log, stream.num_tokens_sent

    assert asyncio.run(main()) == (["task [0]", "task [1]", "task [2]"], 0)


def test_nothing_leaves_from_put_before_the_first_frame_is_out() -> None:
    async def main() -> tuple[list[str], int]:
        wire = Wire()
        stream = _stream(wire, first_frame_out=False)
        consumer = asyncio.create_task(_consume(stream, wire, 1))
        await asyncio.sleep(0)  # the consumer waits, but its first frame is not out
        stream.put(_out(0))
        await consumer
        stream.first_frame_sent()
        consumer = asyncio.create_task(_consume(stream, wire, 3))
        await asyncio.sleep(0)
        stream.put(_out(1))
        stream.put(_out(2, finish=FinishReason.STOP))
        await consumer
        return wire.log, stream.num_tokens_sent

    assert asyncio.run(main()) == (["task [0]", "sent [1]", "task [2] stop"], 1)


def test_a_waiting_consumer_lets_plain_outputs_leave_from_put_and_keeps_the_last() -> None:
    async def main() -> tuple[list[str], int]:
        wire = Wire()
        stream = _stream(wire)
        consumer = asyncio.create_task(_consume(stream, wire, 4))
        await asyncio.sleep(0)  # the consumer waits
        stream.put(_out(0))  # no wake-up between them: all through the writer
        stream.put(_out(1, 2))  # a step that made two tokens counts two
        stream.put(_out(3))
        stream.check_invariants()
        stream.put(_out(4, finish=FinishReason.LENGTH))
        await consumer
        return wire.log, stream.num_tokens_sent

    assert asyncio.run(main()) == (["sent [0]", "sent [1, 2]", "sent [3]", "task [4] length"],
                                 4)


def test_an_output_put_before_the_consumer_took_the_last_one_waits_its_turn() -> None:
    async def main() -> tuple[list[str], int]:
        wire = Wire()
        stream = _stream(wire)
        consumer = asyncio.create_task(_consume(stream, wire, 4))
        await asyncio.sleep(0)
        wire.accepts = False
        stream.put(_out(0))  # refused: queued, the consumer is woken
        wire.accepts = True
        stream.put(_out(1))  # the consumer has not taken 0 yet: queued behind it
        stream.check_invariants()
        await asyncio.sleep(0)  # it takes both and waits again
        stream.put(_out(2))  # through the writer
        stream.put(_out(3, finish=FinishReason.STOP))
        await consumer
        return wire.log, stream.num_tokens_sent

    assert asyncio.run(main()) == (["task [0]", "task [1]", "sent [2]", "task [3] stop"], 1)


def test_an_end_and_a_kv_ready_always_queue_and_stop_sends_from_put() -> None:
    async def main() -> tuple[list[str], int, int]:
        wire = Wire()
        stream = _stream(wire)
        consumer = asyncio.create_task(_consume(stream, wire, 4))
        await asyncio.sleep(0)
        stream.put(KVReady("r", (1,), 4, None))
        stream.put(_out(0))  # behind the KVReady
        await asyncio.sleep(0)  # taken; the consumer waits again
        stream.end("aborted")
        stream.put(_out(1))  # after the end: queued behind it, never sent from put()
        await consumer
        return wire.log, stream.num_tokens_sent, wire.num_sends

    assert asyncio.run(main()) == (["KVReady", "task [0]", "StreamEnd", "task [1]"], 0, 0)


def test_a_deadline_passes_while_tokens_leave_from_put() -> None:
    async def main() -> tuple[list[str], bool]:
        wire = Wire()
        stream = _stream(wire)
        waiter = asyncio.create_task(stream.next(0.05))
        await asyncio.sleep(0)
        stream.put(_out(0))
        try:
            await waiter
        except TimeoutError:
            return wire.log, True
        return wire.log, False

    assert asyncio.run(main()) == (["sent [0]"], True)


def test_a_writer_that_raises_is_dropped_and_its_output_queued(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[list[str], int, int]:
        wire = Wire()
        stream = _stream(wire)
        consumer = asyncio.create_task(_consume(stream, wire, 3))
        await asyncio.sleep(0)
        wire.broken = True
        stream.put(_out(0))  # the writer raises: logged, queued, the consumer woken
        await asyncio.sleep(0)  # taken; the consumer waits again
        wire.broken = False
        stream.put(_out(1))  # the writer is not asked again
        await asyncio.sleep(0)
        stream.put(_out(2, finish=FinishReason.STOP))
        await consumer
        return wire.log, stream.num_tokens_sent, wire.num_sends

    with caplog.at_level(logging.ERROR, logger="worker.stream_frames"):
        assert asyncio.run(main()) == (["task [0]", "task [1]", "task [2] stop"], 0, 1)
    assert "writer bug" in caplog.text


# ---------------------------------------------------------------- stream_frames


class Frames:
    """Runs `stream_frames` over a DecodeStream whose writer is `wire`, recording each frame
    the task yields on the same wire as "task …" (or the ErrorFrame's code)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.wire = Wire()
        self.stream = DecodeStream("r", self.wire)
        self.metrics = WorkerMetrics(MetricsRegistry())
        self.timeout_s = timeout_s
        self.errors: list[ErrorFrame] = []

    async def run(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        async for frame in stream_frames(self.stream, deadline, self.metrics):
            self.stream.check_invariants()
            if isinstance(frame, ErrorFrame):
                self.errors.append(frame)
                self.wire.log.append(frame.code.value)
            else:
                self.wire.log.append(f"task {frame.token_ids}" + _finish(frame))

    def outcomes(self) -> dict[str, float]:
        return {o: self.metrics.requests.value(outcome=o)
                for o in ("stop", "length", "aborted", "error") if
                self.metrics.requests.value(outcome=o)}


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_the_first_frame_goes_through_the_task_then_tokens_leave_from_put() -> None:
    async def main() -> Frames:
        frames = Frames()
        task = asyncio.create_task(frames.run())
        await _settle()
        frames.stream.put(_out(0))
        await _settle()  # the first frame is out; the task waits again
        frames.stream.put(_out(1))
        frames.stream.put(_out(2, 3))
        frames.wire.accepts = False  # a paused channel: the task carries them, merged
        frames.stream.put(_out(4))
        frames.stream.put(_out(5))
        await _settle()
        frames.wire.accepts = True
        frames.stream.put(_out(6))
        frames.stream.put(_out(7, finish=FinishReason.STOP))
        await task
        return frames

    frames = asyncio.run(main())
    assert frames.wire.log == ["task [0]", "sent [1]", "sent [2, 3]", "task [4, 5]", "sent [6]",
                               "task [7] stop"]
    assert frames.stream.num_tokens_sent == 8
    assert frames.outcomes() == {"stop": 1}
    assert frames.metrics.prompt_tokens.value() == 4  # counted once, with the first frame


def test_an_end_wins_over_the_outputs_read_with_it_and_nothing_is_sent_after_it() -> None:
    async def main() -> Frames:
        frames = Frames()
        task = asyncio.create_task(frames.run())
        await _settle()
        frames.stream.put(_out(0))
        await _settle()
        frames.stream.put(_out(1))  # sent from put()
        frames.stream.end("aborted")  # an abort arrives ...
        frames.stream.put(_out(2))  # ... with a token the engine had already made
        await task
        return frames

    frames = asyncio.run(main())
    assert frames.wire.log == ["task [0]", "sent [1]", "aborted"]
    # What the abort answers: exactly the tokens that left, however they left.
    assert frames.stream.num_tokens_sent == 2
    assert frames.errors[0].message == "request ended: aborted"
    assert frames.outcomes() == {"aborted": 1}


def test_an_end_before_the_first_frame_sends_no_token() -> None:
    async def main() -> Frames:
        frames = Frames()
        frames.stream.put(_out(0))
        frames.stream.end("engine failed", RuntimeError("boom"))
        await frames.run()
        return frames

    frames = asyncio.run(main())
    assert frames.wire.log == ["internal"] and frames.stream.num_tokens_sent == 0
    assert frames.outcomes() == {"aborted": 1}


def test_a_stream_past_its_deadline_ends_with_deadline_exceeded() -> None:
    async def main() -> Frames:
        frames = Frames(timeout_s=0.05)
        task = asyncio.create_task(frames.run())
        await _settle()
        frames.stream.put(_out(0))
        await _settle()
        frames.stream.put(_out(1))  # tokens leaving from put() do not move the deadline
        await task
        return frames

    frames = asyncio.run(main())
    assert frames.wire.log == ["task [0]", "sent [1]", "deadline_exceeded"]
    assert frames.stream.num_tokens_sent == 2
    assert frames.metrics.handoff_failures.value(reason="decode_deadline") == 1
    assert frames.outcomes() == {}  # a deadline is counted as a handoff failure
