"""Worker channels over a real control server on 127.0.0.1, port 0: the same handlers as the
HTTP API, many streams on one connection, the token, bad bytes, deadlines (moved with the
loop's clock, tests/manual_clock.py), and the fallback to HTTP for a server without one."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from manual_clock import ManualClock, settle

from protocol.messages import (AbortRequest, AbortResponse, DecodeRequest, DecodeResponseFrame,
                               ErrorCode, ErrorFrame, FinishReason, TokenFrame, encode)
from protocol.sampling_params import SamplingParams
from rpc.channel_client import Channel, ChannelPool
from rpc.channel_wire import MAGIC, ChannelHello, FrameSplitter, end_frame, frame
from rpc.control_client import ControlClient
from rpc.control_server import ControlServer, RequestRejected, add_call, add_stream, make_app
from rpc.errors import ControlError, FrameDeadlineError, RemoteError
from rpc.frames import FrameBatchDecoder

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

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenFrame | ErrorFrame]:
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


@pytest.fixture
async def served() -> AsyncIterator[tuple[Worker, ControlServer]]:
    worker = Worker()
    app = make_app(token=TOKEN, max_body_bytes=64 << 10, body_timeout_s=2.0)
    add_stream(app, "/internal/decode", DecodeRequest, worker.decode)
    add_call(app, "/internal/abort", AbortRequest, worker.abort)
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


FRAMES: FrameBatchDecoder[TokenFrame] = FrameBatchDecoder(DecodeResponseFrame)


async def token_ids(stream: AsyncIterator[list[TokenFrame]]) -> list[int]:
    return [t async for batch in stream for frame in batch for t in frame.token_ids]


async def test_one_port_serves_http_and_channels(served: tuple[Worker, ControlServer],
                                                 pool: ChannelPool) -> None:
    worker, server = served
    over_http = ControlClient(server.url, TOKEN)
    over_channel = ControlClient(server.url, TOKEN, channels=pool)
    try:
        for client in (over_http, over_channel):
            answer = await client.call("/internal/abort", AbortRequest(request_id="a"),
                                       AbortResponse, 5)
            assert answer == AbortResponse(request_id="a", found=True)
            frames = [f async for f in client.stream("/internal/decode", decode("d"),
                                                     DecodeResponseFrame, 5, 5)]
            assert [f.token_ids for f in frames] == [[0], [1], [2], [3]]
            assert frames[-1].finish_reason is FinishReason.LENGTH
        assert server.num_channels == 1 and pool.num_channels == 1
    finally:
        await over_http.aclose()
        await over_channel.aclose()


async def test_many_streams_share_one_connection_each_exactly_once(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    _, server = served
    channel = await pool.get(server.url)
    assert channel is not None
    streams = [channel.open(decode(f"r{i}", max_tokens=20), FRAMES, 5, 5) for i in range(100)]
    results = await asyncio.gather(*(token_ids(s) for s in streams))
    assert results == [list(range(20))] * 100
    assert channel.num_streams == 0 and server.num_channels == 1


async def test_listener_and_pull_get_every_frame_once_in_order(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    _, server = served
    channel = await pool.get(server.url)
    assert channel is not None
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
    client = ControlClient(server.url, TOKEN, channels=pool)
    seen = []
    with pytest.raises(RemoteError) as info:
        async for f in client.stream("/internal/decode", decode("e", 5, [1]),
                                     DecodeResponseFrame, 5, 5):
            seen.append(f.token_ids)
    assert seen == [[0], [1]] and info.value.frame.code is ErrorCode.PEER_LOST
    with pytest.raises(RemoteError) as info:
        await client.call("/internal/abort", AbortRequest(request_id="x", reason="reject"),
                          AbortResponse, 5)
    assert info.value.frame.code is ErrorCode.BAD_REQUEST
    assert info.value.frame.message == "not this one"


async def test_closing_a_stream_early_closes_the_producer_on_the_worker(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    channel = await pool.get(server.url)
    assert channel is not None
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
    assert channel is not None
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


async def test_wrong_token_is_refused(served: tuple[Worker, ControlServer]) -> None:
    _, server = served
    for token in (None, "wrong"):
        with pytest.raises(RemoteError) as info:
            await Channel.connect(server.url, token, 5)
        assert info.value.frame.code is ErrorCode.UNAUTHORIZED
    assert server.num_channels == 0


async def test_server_going_away_fails_every_stream(pool: ChannelPool) -> None:
    worker = Worker()
    app = make_app(token=TOKEN)
    add_stream(app, "/internal/decode", DecodeRequest, worker.decode)
    server = ControlServer(app, token=TOKEN)
    await server.start()
    channel = await pool.get(server.url)
    assert channel is not None
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


async def test_a_server_without_channels_is_used_over_http(pool: ChannelPool) -> None:
    worker = Worker()
    app = web.Application()

    async def abort(request: web.Request) -> web.Response:
        return await abort_over_http(worker, request)

    app.router.add_post("/internal/abort", abort)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site.port}"
    try:
        assert await pool.get(url) is None
        client = ControlClient(url, TOKEN, channels=pool)
        answer = await client.call("/internal/abort", AbortRequest(request_id="h"),
                                   AbortResponse, 5)
        assert answer.found and worker.aborts == ["h"]
        await client.aclose()
    finally:
        await runner.cleanup()


async def abort_over_http(worker: Worker, request: web.Request) -> web.Response:
    from protocol.messages import decode as decode_message
    message = decode_message(await request.read(), AbortRequest)
    worker.aborts.append(message.request_id)
    return web.Response(body=encode(AbortResponse(request_id=message.request_id, found=True)),
                        content_type="application/x-msgpack")


async def raw_channel(server: ControlServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(MAGIC + frame(0, encode(ChannelHello(token=TOKEN))))
    splitter = FrameSplitter(1 << 20)
    while not (frames := splitter.feed(await reader.read(4096))):
        pass
    assert frames[0][0] == 0
    return reader, writer


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    data = b""
    async with asyncio.timeout(5):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def test_garbage_and_oversized_frames_close_only_that_channel(
        served: tuple[Worker, ControlServer], pool: ChannelPool) -> None:
    _, server = served
    good = ControlClient(server.url, TOKEN, channels=pool)
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
    answer = await good.call("/internal/abort", AbortRequest(request_id="ok"), AbortResponse, 5)
    assert answer.found
    await good.aclose()


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
