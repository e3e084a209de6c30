"""Worker channels over a real control server on 127.0.0.1, port 0: calls and streams on one
connection (the port's HTTP side serves the probes), the token, bad bytes, deadlines (moved
with the loop's clock, tests/manual_clock.py), and a peer that is no worker's control port."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from manual_clock import ManualClock, settle
from raw_channel import open_greeted

from protocol.messages import (AbortRequest, AbortResponse, DecodeRequest, DecodeResponseFrame,
                               ErrorCode, ErrorFrame, FinishReason, TokenFrame)
from protocol.sampling_params import SamplingParams
from rpc.channel_client import Channel, ChannelPool
from rpc.channel_wire import FrameSplitter, end_frame, frame
from rpc.control_client import ControlClient
from rpc.control_server import (ControlServer, FrameWriter, RequestRejected, add_call, add_stream,
                                make_app)
from rpc.errors import ControlError, FrameDeadlineError, PeerUnverifiedError, RemoteError
from rpc.frames import FrameDecoder

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TOKEN = "channel-token"


@pytest.fixture(params=["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> object:
    """Both loops: pdserve's processes run on uvloop, whose transports differ."""
    return request.param


def needs_manual_clock() -> None:
    if not isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop):
        pytest.skip("the manual clock replaces asyncio's own loop's time()")


class Worker:
    """Canned answers: `max_tokens` frames, a finish; prompt [0] stalls, [1] fails mid-way."""

    def __init__(self) -> None:
        self.closed: list[str] = []  # request ids whose producer was closed
        self.aborts: list[str] = []
        self.stall = asyncio.Event()

    async def decode(self, request: DecodeRequest, out: FrameWriter
                     ) -> AsyncIterator[TokenFrame | ErrorFrame]:
        try:
            for i in range(request.sampling.max_tokens):
                if request.prompt_token_ids == [0] and i == 1:
                    await self.stall.wait()
                if request.prompt_token_ids == [1] and i == 2:
                    yield ErrorFrame(request_id=request.request_id, code=ErrorCode.PEER_LOST,
                                     message="gone")
                    return
                yield TokenFrame(request_id=request.request_id, token_ids=[i], text=f"t{i}",
                                 finish_reason=FinishReason.LENGTH
                                 if i == request.sampling.max_tokens - 1 else None)
                await asyncio.sleep(0)
        finally:
            self.closed.append(request.request_id)

    async def abort(self, request: AbortRequest) -> AbortResponse:
        if request.reason == "reject":
            raise RequestRejected(ErrorCode.BAD_REQUEST, "not this one", request.request_id)
        self.aborts.append(request.request_id)
        return AbortResponse(request_id=request.request_id, found=True)


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def served() -> AsyncIterator[tuple[Worker, ControlServer]]:
    worker = Worker()
    app = make_app(token=TOKEN, max_body_bytes=64 << 10, body_timeout_s=2.0)
    add_stream(app, DecodeRequest, worker.decode)
    add_call(app, AbortRequest, worker.abort)
    app.router.add_get("/health", health)
    server = ControlServer(app, token=TOKEN)
    await server.start()
    yield worker, server
    worker.stall.set()
    await server.stop()
    server.check_invariants()


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    channels = ChannelPool(TOKEN, connect_timeout_s=5)
    yield channels
    channels.check_invariants()
    await channels.aclose()


def decode(rid: str, max_tokens: int = 4, prompt: list[int] | None = None) -> DecodeRequest:
    return DecodeRequest(request_id=rid, prompt_token_ids=prompt or [7],
                         sampling=SamplingParams(max_tokens=max_tokens), timeout_ms=60_000)


FRAMES: FrameDecoder[TokenFrame] = FrameDecoder(DecodeResponseFrame)


async def token_ids(stream: AsyncIterator[list[TokenFrame]]) -> list[int]:
    return [t async for batch in stream for frame in batch for t in frame.token_ids]


async def test_one_port_serves_calls_and_streams_on_one_channel_and_probes_over_http(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    client = ControlClient(server.url, pool)
    for rid in ("a", "b"):
        answer = await client.call(AbortRequest(request_id=rid), AbortResponse, 5)
        assert answer == AbortResponse(request_id=rid, found=True)
        frames = [f async for f in client.stream(decode(f"d{rid}"), DecodeResponseFrame, 5, 5)]
        assert [f.token_ids for f in frames] == [[0], [1], [2], [3]]
        assert frames[-1].finish_reason is FinishReason.LENGTH
    assert worker.aborts == ["a", "b"]
    assert server.num_channels == 1 and pool.num_channels == 1
    async with aiohttp.ClientSession() as session:  # a probe carries no token
        async with session.get(server.url + "/health") as response:
            assert response.status == 200 and await response.text() == "ok"
    assert server.num_channels == 1, "an HTTP connection was taken for a channel"


async def test_many_streams_share_one_connection_each_exactly_once(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    _, server = served
    channel = await pool.get(server.url)
    streams = [channel.open(decode(f"r{i}", max_tokens=20), FRAMES, 5, 5) for i in range(100)]
    results = await asyncio.gather(*(token_ids(s) for s in streams))
    assert results == [list(range(20))] * 100
    assert channel.num_streams == 0 and server.num_channels == 1


async def test_listener_and_pull_get_every_frame_once_in_order(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    _, server = served
    channel = await pool.get(server.url)
    stream = channel.open(decode("l", max_tokens=40), FRAMES, 5, 5)
    heard: list[int] = []
    choices = random.Random(3)

    def listener(item: TokenFrame) -> bool:
        if choices.random() < 0.5:
            return False  # refused: this one and every one after it until the queue empties
        heard.extend(item.token_ids)
        return True

    stream.listen(listener)
    pulled: list[list[int]] = []
    async for batch in stream:
        pulled.append([t for f in batch for t in f.token_ids])
        await asyncio.sleep(0)
    everything = sorted(heard + [t for b in pulled for t in b])
    assert everything == list(range(40)), "a frame was lost or given twice"
    assert heard and pulled
    assert all(b == list(range(b[0], b[0] + len(b))) for b in pulled), "a pulled batch is out of order"


async def test_error_frame_ends_the_stream_after_the_frames_before_it(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    _, server = served
    client = ControlClient(server.url, pool)
    seen = []
    with pytest.raises(RemoteError) as info:
        async for f in client.stream(decode("e", 5, [1]), DecodeResponseFrame, 5, 5):
            seen.append(f.token_ids)
    assert seen == [[0], [1]] and info.value.frame.code is ErrorCode.PEER_LOST
    with pytest.raises(RemoteError) as info:
        await client.call(AbortRequest(request_id="x", reason="reject"), AbortResponse, 5)
    assert info.value.frame.code is ErrorCode.BAD_REQUEST
    assert info.value.frame.message == "not this one"


async def test_closing_a_stream_early_closes_the_producer_on_the_worker(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    channel = await pool.get(server.url)
    stream = channel.open(decode("c", 10, [0]), FRAMES, 5, 5)  # stalls after one token
    assert [f.token_ids for f in await anext(stream)] == [[0]]
    await stream.aclose()
    for _ in range(200):
        if "c" in worker.closed:
            break
        await asyncio.sleep(0.01)
    assert "c" in worker.closed
    assert server.num_open_streams == 0


async def test_stalled_stream_misses_its_deadline_and_the_worker_drops_it(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    needs_manual_clock()
    channel = await pool.get(server.url)
    with ManualClock() as clock:
        stream = channel.open(decode("s", 10, [0]), FRAMES, 5, 1.0)
        assert [f.token_ids for f in await anext(stream)] == [[0]]
        await clock.advance(0.9)
        pending = asyncio.ensure_future(anext(stream))
        await settle()
        assert not pending.done(), "fired before its deadline"
        await clock.advance(0.2)
        assert pending.done(), "the deadline did not fire"
        with pytest.raises(FrameDeadlineError):
            await pending
    for _ in range(200):
        if "s" in worker.closed:
            break
        await asyncio.sleep(0.01)
    assert "s" in worker.closed
    # Only that stream missed its deadline: the channel carries the next one.
    assert pool.ready(server.url) is channel
    assert await token_ids(channel.open(decode("after", 5), FRAMES, 5, 1.0)) == list(range(5))


async def test_frames_that_arrived_wait_for_a_consumer_that_pulls_late(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    # The frame deadline watches the worker, not the consumer: a handler busy elsewhere
    # for longer than frame_timeout_s still gets every frame that came meanwhile.
    needs_manual_clock()
    _, server = served
    channel = await pool.get(server.url)
    with ManualClock() as clock:
        stream = channel.open(decode("late", 20), FRAMES, 5, 1.0)
        got = [t for f in await anext(stream) for t in f.token_ids]
        async with asyncio.timeout(5):
            while not stream.is_done:  # every frame and the end have arrived, unpulled
                await asyncio.sleep(0.01)
        await clock.advance(60.0)
        got += await token_ids(stream)
    assert got == list(range(20))


async def test_wrong_token_is_refused(served: tuple[Worker, ControlServer]) -> None:
    _, server = served
    with pytest.raises(RemoteError) as info:  # no token: the caller proves nothing
        await Channel.connect(server.url, None, 5)
    assert info.value.frame.code is ErrorCode.UNAUTHORIZED
    with pytest.raises(PeerUnverifiedError):  # another token: the worker's proof fails here
        await Channel.connect(server.url, "wrong", 5)
    async with asyncio.timeout(5):
        while server.num_channels:
            await asyncio.sleep(0.01)


async def test_server_going_away_fails_every_stream(pool: ChannelPool) -> None:
    worker = Worker()
    app = make_app(token=TOKEN)
    add_stream(app, DecodeRequest, worker.decode)
    server = ControlServer(app, token=TOKEN)
    await server.start()
    channel = await pool.get(server.url)
    streams = [channel.open(decode(f"g{i}", 10, [0]), FRAMES, 5, 5) for i in range(3)]
    for stream in streams:
        await anext(stream)
    await server.stop()
    for stream in streams:
        with pytest.raises(ControlError):
            await anext(stream)
    assert sorted(worker.closed) == ["g0", "g1", "g2"]
    assert pool.ready(server.url) is None
    with pytest.raises(ControlError):  # refused: the worker is unreachable
        await pool.get(server.url)


async def test_an_http_server_is_no_worker_and_is_asked_again_next_time(
        pool: ChannelPool) -> None:
    hits: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="not a worker")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site.port}"
    client = ControlClient(url, pool)
    try:
        for _ in range(2):  # no memory of the refusal: each use connects and greets again
            with pytest.raises(ControlError, match="HTTP") as info:
                await pool.get(url)
            assert not isinstance(info.value, RemoteError)
            with pytest.raises(ControlError, match="HTTP"):
                await client.call(AbortRequest(request_id="h"), AbortResponse, 5)
            with pytest.raises(ControlError, match="HTTP"):
                async for _ in client.stream(decode("h"), DecodeResponseFrame, 5, 5):
                    pass
        assert pool.ready(url) is None and pool.num_channels == 0
        assert hits == [], "a greeting reached a handler"
    finally:
        await runner.cleanup()


async def raw_channel(server: ControlServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert server.port is not None
    return await open_greeted("127.0.0.1", server.port, TOKEN)


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    data = b""
    async with asyncio.timeout(5):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def test_garbage_and_oversized_frames_close_only_that_channel(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    _, server = served
    good = ControlClient(server.url, pool)
    rng = random.Random(11)
    for case in range(30):
        reader, writer = await raw_channel(server)
        if case == 0:  # over the 64 KiB body limit: TOO_LARGE, then closed
            writer.write(struct.pack(">II", 1 << 20, 1))
            answer = await read_until_closed(reader)
            assert b"too_large" in answer
        elif case == 1:  # stream 0 after the greeting is a protocol violation
            writer.write(frame(0, b"x"))
            await read_until_closed(reader)
        else:  # a random body on a new stream: a BAD_REQUEST answer, the channel lives on
            writer.write(frame(case, rng.randbytes(rng.randint(1, 300))))
            splitter = FrameSplitter(1 << 20)
            got: list[tuple[int, bytes]] = []
            while len(got) < 2:
                got += [(s, bytes(b)) for s, b in splitter.feed(await reader.read(4096))]
            assert got[0][0] == case and b"bad_request" in got[0][1] and got[1] == (case, b"")
            writer.write(end_frame(case))  # ending a finished stream: nothing happens
        writer.close()
    answer = await good.call(AbortRequest(request_id="ok"), AbortResponse, 5)
    assert answer.found


async def test_a_frame_that_never_completes_closes_the_channel(
        served: tuple[Worker, ControlServer]) -> None:
    needs_manual_clock()
    _, server = served
    reader, writer = await raw_channel(server)
    writer.write(struct.pack(">II", 100, 1) + b"partial")
    with ManualClock() as clock:
        await settle()
        await clock.advance(2.5)  # body_timeout_s = 2
        assert await read_until_closed(reader) == b""
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
