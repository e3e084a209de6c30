"""The control carrier over a real control server on 127.0.0.1, port 0: calls and streams on a
caller's channel (the token proved in its greeting, the body limit, the protocol version, a peer
that dies), and the HTTP side, which serves only the probes and /admin (the token, the body
limit). Deadline tests move the loop's clock (tests/manual_clock.py) instead of sleeping
through the deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web
from manual_clock import ManualClock
from raw_channel import open_greeted, read_frame

from protocol.cluster_secret import KeyPurpose, derive_key
from protocol.messages import (DecodeDestination, DecodeRequest, DecodeResponseFrame, ErrorCode,
                               ErrorFrame, FinishReason, MessageDecoder, ReserveRequest,
                               ReserveResponse, TokenFrame, TokenLogprob, Usage, encode)
from protocol.sampling_params import SamplingParams
from rpc.channel_client import ChannelPool
from rpc.channel_greeting import WorkerGreeting
from rpc.channel_wire import MAGIC, ChannelHello, ChannelWelcome, endpoint, frame
from rpc.control_client import ControlClient
from rpc.control_server import (ControlServer, FrameWriter, InsecureBindError, add_call, add_stream,
                                is_loopback, make_app)
from rpc.errors import ControlError, FrameDeadlineError, PeerUnverifiedError, RemoteError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

TOKEN = "s3cret-token"
MAX_BODY_BYTES = 64 << 10
ERROR_FRAME: MessageDecoder[ErrorFrame] = MessageDecoder(ErrorFrame)


class FakeWorker:
    """Just enough of a decode worker to drive the transport: pure canned answers."""

    def __init__(self) -> None:
        self.stall_after_first = False
        self.stream_closed = asyncio.Event()
        self.never = asyncio.Event()  # a stalled stream waits on this; nobody sets it
        self.reserved: list[str] = []  # request ids the reserve handler saw

    async def reserve(self, request: ReserveRequest) -> ReserveResponse | ErrorFrame:
        self.reserved.append(request.request_id)
        if len(request.prompt_token_ids) == 1:  # the test of an overloaded worker
            return ErrorFrame(request_id=request.request_id, code=ErrorCode.OVERLOADED,
                              message="no free blocks", retryable=True)
        num_blocks = -(-len(request.prompt_token_ids) // 4)
        return ReserveResponse(request_id=request.request_id,
                               destination=DecodeDestination(
                                   worker_id="d0", epoch=2, kv_address="ucx://x",
                                   block_ids=list(range(num_blocks)), num_prefix_blocks_held=1))

    async def decode(self, request: DecodeRequest, out: FrameWriter
                     ) -> AsyncIterator[TokenFrame | ErrorFrame]:
        try:
            for i in range(3):
                yield TokenFrame(request_id=request.request_id, token_ids=[i], text=f"t{i}",
                                 logprobs=[TokenLogprob(i, -0.5 * i, [(i, -0.5 * i)])])
                if self.stall_after_first:
                    await self.never.wait()
            if request.sampling.max_tokens == 3:
                yield TokenFrame(request_id=request.request_id, token_ids=[],
                                 finish_reason=FinishReason.LENGTH,
                                 usage=Usage(num_prompt_tokens=2, num_completion_tokens=3))
            else:
                yield ErrorFrame(request_id=request.request_id, code=ErrorCode.PEER_LOST,
                                 message="prefill worker died")
        finally:
            self.stream_closed.set()


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def echo_size(request: web.Request) -> web.Response:
    """An admin path that reads its body (the worker's own take none: the limit guards any)."""
    return web.Response(text=str(len(await request.read())))


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeWorker, ControlServer]]:
    worker = FakeWorker()
    app = make_app(token=TOKEN, max_body_bytes=MAX_BODY_BYTES, body_timeout_s=30.0)
    add_call(app, ReserveRequest, worker.reserve)
    add_stream(app, DecodeRequest, worker.decode)
    for path in ("/health", "/ready", "/metrics", "/admin/state"):
        app.router.add_get(path, ok)
    app.router.add_post("/admin/echo", echo_size)
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


def decode_request(max_tokens: int = 3, rid: str = "r1") -> DecodeRequest:
    return DecodeRequest(request_id=rid, prompt_token_ids=[1, 2], timeout_ms=1000,
                         first_token_id=7, sampling=SamplingParams(max_tokens=max_tokens))


def reserve_request(rid: str, num_tokens: int) -> ReserveRequest:
    return ReserveRequest(request_id=rid, prompt_token_ids=list(range(num_tokens)),
                          timeout_ms=500)


# ---------------------------------------------------------------- calls and streams


async def test_call_round_trip_and_error_frame(served: tuple[FakeWorker, ControlServer],
                                               pool: ChannelPool) -> None:
    _, server = served
    client = ControlClient(server.url, pool)
    reply = await client.call(reserve_request("r1", 10), ReserveResponse, timeout_s=2.0)
    assert reply.destination.block_ids == [0, 1, 2] and reply.destination.epoch == 2
    with pytest.raises(RemoteError) as err:
        await client.call(reserve_request("r2", 1), ReserveResponse, timeout_s=2.0)
    assert err.value.frame.code is ErrorCode.OVERLOADED and err.value.frame.retryable
    assert err.value.frame.request_id == "r2" and err.value.frame.message == "no free blocks"


async def test_token_stream_frames_round_trip(served: tuple[FakeWorker, ControlServer],
                                              pool: ChannelPool) -> None:
    _, server = served
    client = ControlClient(server.url, pool)
    frames = [f async for f in client.stream(decode_request(), TokenFrame,
                                             first_frame_timeout_s=2.0, frame_timeout_s=1.0)]
    assert [f.token_ids for f in frames] == [[0], [1], [2], []]
    assert "".join(f.text for f in frames) == "t0t1t2"
    assert frames[2].logprobs == [TokenLogprob(2, -1.0, [(2, -1.0)])]
    assert frames[-1].finish_reason is FinishReason.LENGTH
    assert frames[-1].usage == Usage(num_prompt_tokens=2, num_completion_tokens=3)
    # A stream that ends in an ErrorFrame raises after the frames before it.
    received = []
    with pytest.raises(RemoteError) as err:
        async for frame_ in client.stream(decode_request(max_tokens=9), DecodeResponseFrame,
                                          2.0, 1.0):
            received.append(frame_)
    assert len(received) == 3 and err.value.frame.code is ErrorCode.PEER_LOST


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_missing_or_wrong_token_is_refused_and_no_handler_runs(
        served: tuple[FakeWorker, ControlServer], token: str | None) -> None:
    # Without a token the caller proves nothing: the worker refuses it. With a wrong one the
    # worker's proof does not check out here: the caller refuses the worker first.
    worker, server = served
    channels = ChannelPool(token, connect_timeout_s=5)
    client = ControlClient(server.url, channels)
    refusal = RemoteError if token is None else PeerUnverifiedError
    try:
        with pytest.raises(refusal) as err:
            await client.call(reserve_request("r1", 2), ReserveResponse, timeout_s=2.0)
        with pytest.raises(refusal) as err:
            async for _ in client.stream(decode_request(), TokenFrame, 2.0, 1.0):
                pass
        if isinstance(err.value, RemoteError):
            assert err.value.frame.code is ErrorCode.UNAUTHORIZED
        assert worker.reserved == [] and not worker.stream_closed.is_set(), \
            "a handler ran unauthenticated"
        assert channels.num_channels == 0
        async with asyncio.timeout(5):  # the caller that refused the worker hung up
            while server.num_channels:
                await asyncio.sleep(0.01)
    finally:
        await channels.aclose()


async def test_a_call_over_the_body_limit_is_too_large_and_the_channel_lives_on(
        served: tuple[FakeWorker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    worker.stall_after_first = True
    client = ControlClient(server.url, pool)
    streaming = client.stream(decode_request(rid="alongside"), TokenFrame, 2.0, 30.0)
    assert (await anext(streaming)).token_ids == [0]
    channel = pool.ready(server.url)
    with pytest.raises(RemoteError) as err:  # some 100 KB against the worker's 64 KiB
        await client.call(reserve_request("big", 30_000), ReserveResponse, timeout_s=2.0)
    assert err.value.frame.code is ErrorCode.TOO_LARGE and err.value.frame.request_id == "big"
    assert "big" not in worker.reserved
    # Only that request failed: the stream beside it and the channel are untouched.
    reply = await client.call(reserve_request("small", 10), ReserveResponse, timeout_s=2.0)
    assert reply.request_id == "small"
    assert pool.ready(server.url) is channel and server.num_channels == 1
    assert not worker.stream_closed.is_set()
    await streaming.aclose()
    await asyncio.wait_for(worker.stream_closed.wait(), 5.0)


async def test_peer_dying_mid_frame_is_a_control_error_after_the_frames_before_it(
        pool: ChannelPool) -> None:
    async def die_mid_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readexactly(len(MAGIC)) == MAGIC
        _, hello = await read_frame(reader)  # the greeting, answered as a worker would
        port = writer.get_extra_info("sockname")[1]
        greeting = WorkerGreeting(derive_key(TOKEN, KeyPurpose.CHANNEL),
                                  endpoint("127.0.0.1", port))
        writer.write(frame(0, greeting.challenge(MessageDecoder(ChannelHello).decode(hello))))
        await read_frame(reader)  # the caller's proof
        writer.write(frame(0, encode(ChannelWelcome(max_frame_bytes=1 << 20))))
        stream_id, _ = await read_frame(reader)  # the request
        token = encode(TokenFrame(request_id="r1", token_ids=[0], text="t0"))
        writer.write(frame(stream_id, token) + frame(stream_id, token)[:-3])
        await writer.drain()
        writer.transport.abort()  # the connection drops as when the process dies

    server = await asyncio.start_server(die_mid_frame, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = ControlClient(url, pool)
    received: list[TokenFrame] = []
    try:
        with pytest.raises(ControlError) as err:
            async for frame_ in client.stream(decode_request(), TokenFrame, 2.0, 1.0):
                received.append(frame_)
        assert not isinstance(err.value, (RemoteError, FrameDeadlineError))
        assert [f.token_ids for f in received] == [[0]]
        assert pool.ready(url) is None
    finally:
        server.close()
        await server.wait_closed()


async def test_protocol_version_mismatch_is_a_clear_refusal(
        served: tuple[FakeWorker, ControlServer]) -> None:
    worker, server = served
    reader, writer = await raw_channel(server)
    try:
        writer.write(frame(1, msgspec.msgpack.encode((99, {"type": "reserve_request"}))))
        refusal = await read_frame(reader)
        assert await read_frame(reader) == (1, b"")  # the stream ends; the channel does not
        assert refusal[0] == 1
        error = ERROR_FRAME.decode(refusal[1])
        assert error.code is ErrorCode.PROTOCOL_VERSION and "99" in error.message
        writer.write(frame(3, encode(reserve_request("next", 4))))
        stream_id, body = await read_frame(reader)
        assert stream_id == 3 and b"reserve_response" in body
        assert worker.reserved == ["next"]
    finally:
        writer.close()


async def test_stalled_stream_hits_the_frame_deadline_and_the_worker_sees_it(
        served: tuple[FakeWorker, ControlServer], pool: ChannelPool) -> None:
    worker, server = served
    worker.stall_after_first = True
    client = ControlClient(server.url, pool)
    await pool.get(server.url)  # connected before the clock moves
    received: list[TokenFrame] = []

    async def read() -> None:
        async with contextlib.aclosing(client.stream(
                decode_request(), TokenFrame, first_frame_timeout_s=60.0,
                frame_timeout_s=30.0)) as frames:
            async for frame_ in frames:
                received.append(frame_)

    with ManualClock() as clock:
        reader = asyncio.create_task(read())
        while not received:
            await asyncio.sleep(0.01)
        await clock.advance(25.0)  # the worker is stalled, the 30 s deadline not reached
        assert not reader.done() and not worker.stream_closed.is_set()
        await clock.advance(10.0)
        with pytest.raises(FrameDeadlineError):
            await asyncio.wait_for(reader, 5.0)
    assert len(received) == 1
    # Dropping the stream cancels the worker's producer: it is closed promptly.
    await asyncio.wait_for(worker.stream_closed.wait(), 5.0)


@pytest.mark.parametrize("what", ["greeting", "request"])
async def test_bytes_that_do_not_arrive_in_time_close_the_channel_and_no_handler_runs(
        served: tuple[FakeWorker, ControlServer], what: str) -> None:
    worker, server = served
    if what == "greeting":
        assert server.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        whole = MAGIC + frame(0, encode(ChannelHello(nonce=bytes(16))))
    else:
        reader, writer = await raw_channel(server)
        whole = frame(1, encode(reserve_request("slow", 4)))
    try:
        with ManualClock() as clock:
            writer.write(whole[:len(whole) - 3])  # the rest never comes while the test looks
            for _ in range(100):
                await asyncio.sleep(0.01)
                if server.num_channels == 1:
                    break
            assert server.num_channels == 1
            await clock.advance(25.0)  # short of the server's 30 s deadline
            assert server.num_channels == 1 and not reader.at_eof()
            await clock.advance(10.0)
            async with asyncio.timeout(5):
                assert await reader.read() == b"", "the channel was not closed"
        assert server.num_channels == 0 and worker.reserved == []
        server.check_invariants()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


# ---------------------------------------------------------------- HTTP: probes and /admin


async def test_probe_paths_are_open_but_nothing_else_is(
        served: tuple[FakeWorker, ControlServer]) -> None:
    _, server = served
    url = server.url
    async with aiohttp.ClientSession() as session:
        for path in ("/health", "/ready", "/metrics"):
            async with session.get(url + path) as response:
                assert response.status == 200, path
        for method, path in (("GET", "/admin/state"), ("POST", "/health")):
            for headers in ({}, {"Authorization": "Bearer wrong-token"},
                            {"Authorization": TOKEN}):
                async with session.request(method, url + path, headers=headers) as response:
                    assert response.status == 401, (method, path, headers)
                    error = ERROR_FRAME.decode(await response.read())
                    assert error.code is ErrorCode.UNAUTHORIZED
        async with session.get(url + "/admin/state",
                               headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status == 200
    assert server.num_channels == 0


async def test_an_http_body_over_the_limit_is_413_before_it_is_read(
        served: tuple[FakeWorker, ControlServer]) -> None:
    _, server = served
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/admin/echo", data=b"x" * MAX_BODY_BYTES,
                                headers=headers) as response:
            assert response.status == 200 and await response.text() == str(MAX_BODY_BYTES)
        async with session.post(server.url + "/admin/echo", data=b"x" * (MAX_BODY_BYTES + 1),
                                headers=headers) as response:
            assert response.status == 413
            error = ERROR_FRAME.decode(await response.read())
    assert error.code is ErrorCode.TOO_LARGE


def test_non_loopback_bind_requires_a_token() -> None:
    app = make_app(token=None)
    with pytest.raises(InsecureBindError, match="PDSERVE_INTERNAL_TOKEN"):
        ControlServer(app, host="0.0.0.0")
    with pytest.raises(InsecureBindError):
        ControlServer(app, host="worker-3.internal")
    ControlServer(make_app(token=TOKEN), host="0.0.0.0", token=TOKEN)  # allowed, not started
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5")


# ---------------------------------------------------------------- a raw channel


async def raw_channel(server: ControlServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A greeted channel, spoken by hand."""
    assert server.port is not None
    return await open_greeted("127.0.0.1", server.port, TOKEN)


async def test_a_handler_hears_once_when_its_callers_channel_closes() -> None:
    from rpc.control_app import on_caller_lost

    lost: list[str] = []
    forgotten: list[str] = []

    async def watch(request: ReserveRequest) -> ReserveResponse:
        forget = on_caller_lost(lambda: lost.append(request.request_id))
        if request.request_id == "forgotten":
            forget()
            forgotten.append(request.request_id)
        return ReserveResponse(request_id=request.request_id, destination=DecodeDestination(
            worker_id="d0", epoch=1, kv_address="x", block_ids=[0],
            num_prefix_blocks_held=0))

    app = make_app(token=TOKEN)
    add_call(app, ReserveRequest, watch)
    server = ControlServer(app, token=TOKEN)
    await server.start()
    try:
        channels = ChannelPool(TOKEN, connect_timeout_s=5)
        client = ControlClient(server.url, channels)
        for rid in ("kept", "forgotten"):
            await client.call(reserve_request(rid, 4), ReserveResponse, timeout_s=2.0)
        assert lost == [] and forgotten == ["forgotten"]
        await channels.aclose()
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert lost == ["kept"]  # once, and not the one forgotten
    finally:
        await server.stop()
    server.check_invariants()
