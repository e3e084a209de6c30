"""A stream's FrameWriter over a real control server on 127.0.0.1, port 0: frames sent from a
callback while the producer's task waits reach the client in order with the producer's own,
and the writer of a cancelled or finished stream refuses (sends nothing)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from raw_channel import greet

from protocol.messages import DecodeRequest, DecodeResponseFrame, FinishReason, TokenFrame, encode
from protocol.sampling_params import SamplingParams
from rpc.channel_client import ChannelPool
from rpc.channel_wire import FrameSplitter, frame
from rpc.control_client import ControlClient
from rpc.control_server import ControlServer, FrameWriter, add_stream, make_app
from rpc.frames import FrameDecoder

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TOKEN = "writer-token"
FRAMES: FrameDecoder[TokenFrame] = FrameDecoder(DecodeResponseFrame)


@pytest.fixture(params=["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


def _token(rid: str, i: int, last: bool = False, text: str | None = None) -> TokenFrame:
    return TokenFrame(request_id=rid, token_ids=[i], text=text or f"t{i}",
                      finish_reason=FinishReason.LENGTH if last else None)


class DirectSendWorker:
    """Yields token 0 itself, sends tokens 1..n-2 from loop callbacks through the stream's
    writer while its task waits, then yields the last token itself. A token the writer
    refuses is yielded by the task, with a last token after it (the stream ends early).
    Prompt [0]: sends tokens 0 and 1, then waits until cancelled (for the test to try the
    writer). Prompt [2]: every token carries 64 KiB of text."""

    def __init__(self) -> None:
        self.writers: dict[str, FrameWriter] = {}
        self.closed: list[str] = []
        self.refused: list[int] = []

    async def decode(self, request: DecodeRequest, out: FrameWriter
                     ) -> AsyncIterator[TokenFrame]:
        rid, n = request.request_id, request.sampling.max_tokens
        self.writers[rid] = out
        hold = request.prompt_token_ids == [0]
        text = "x" * (64 << 10) if request.prompt_token_ids == [2] else None
        last = n - 1
        try:
            if not hold:
                yield _token(rid, 0, text=text)
            loop, done = asyncio.get_running_loop(), asyncio.Event()

            def push(i: int) -> None:
                nonlocal last
                if i == n - 1 or (hold and i == 2):
                    done.set()
                elif out.send(_token(rid, i, text=text)):
                    loop.call_soon(push, i + 1)
                else:
                    self.refused.append(i)
                    last = i + 1
                    done.set()

            loop.call_soon(push, 0 if hold else 1)
            await done.wait()
            if hold:
                await asyncio.Event().wait()  # until cancelled
            if last != n - 1:
                yield _token(rid, last - 1, text=text)  # the refused one
            yield _token(rid, last, True)
        finally:
            self.closed.append(rid)


@pytest.fixture
async def served() -> AsyncIterator[tuple[DirectSendWorker, ControlServer]]:
    worker = DirectSendWorker()
    app = make_app(token=TOKEN)
    add_stream(app, DecodeRequest, worker.decode)
    server = ControlServer(app, token=TOKEN)
    await server.start()
    yield worker, server
    await server.stop()
    server.check_invariants()


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    channels = ChannelPool(TOKEN, connect_timeout_s=5)
    yield channels
    channels.check_invariants()
    await channels.aclose()


def _decode(rid: str, n: int, prompt: list[int] | None = None) -> DecodeRequest:
    return DecodeRequest(request_id=rid, prompt_token_ids=prompt or [7],
                         sampling=SamplingParams(max_tokens=n), timeout_ms=60_000)


async def test_direct_sends_and_the_producers_own_frames_arrive_in_order(
        served: tuple[DirectSendWorker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    client = ControlClient(server.url, pool)
    frames = [f async for f in client.stream(_decode("c", 6), DecodeResponseFrame, 5, 5)]
    assert [f.token_ids for f in frames] == [[i] for i in range(6)]
    assert [f.finish_reason for f in frames] == [None] * 5 + [FinishReason.LENGTH]
    channel = await pool.get(server.url)
    many = [channel.open(_decode(f"m{i}", 30), FRAMES, 5, 5) for i in range(40)]
    results = await asyncio.gather(*(_token_ids(s) for s in many))
    assert results == [list(range(30))] * 40
    assert not worker.refused
    assert server.num_open_streams == 0
    # A finished stream's writer sends nothing: its id could not carry it to anyone.
    assert not worker.writers["c"].send(_token("c", 99))
    assert server.num_channels == 1 and pool.num_channels == 1


async def test_a_cancelled_streams_writer_refuses(
        served: tuple[DirectSendWorker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    channel = await pool.get(server.url)
    stream = channel.open(_decode("x", 10, [0]), FRAMES, 5, 5)
    got = [t for f in await anext(stream) for t in f.token_ids]
    assert got[0] == 0
    out = worker.writers["x"]
    await stream.aclose()  # the caller drops the stream: the worker cancels it
    async with asyncio.timeout(5):
        while "x" not in worker.closed:
            await asyncio.sleep(0.01)
    assert not out.send(_token("x", 5))
    # The channel lives on for the next stream.
    assert await _token_ids(channel.open(_decode("y", 4), FRAMES, 5, 5)) == [0, 1, 2, 3]


async def test_the_writer_refuses_while_the_caller_reads_nothing_and_the_task_carries_on(
        served: tuple[DirectSendWorker, ControlServer]) -> None:
    worker, server = served
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        await greet(reader, writer, TOKEN, "127.0.0.1", server.port)
        splitter = FrameSplitter(1 << 20)
        writer.write(frame(1, encode(_decode("big", 4096, [2]))))
        async with asyncio.timeout(10):  # reading nothing, the channel's buffers fill up
            while not worker.refused:
                await asyncio.sleep(0.01)
        refused = worker.refused[0]
        got: list[int] = []
        async with asyncio.timeout(10):
            while True:  # reading again: the producer's frames follow the sent ones
                bodies = [body for sid, body in splitter.feed(await reader.read(1 << 20))
                          if sid == 1]
                got += [t for body in bodies if body for t in FRAMES.decode(body).token_ids]
                if any(not body for body in bodies):
                    break
        assert got == list(range(refused + 2)), "a token was lost, repeated or reordered"
        assert worker.refused == [refused] and 1 < refused < 4095
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _token_ids(stream: AsyncIterator[list[TokenFrame]]) -> list[int]:
    return [t async for batch in stream for frame in batch for t in frame.token_ids]
