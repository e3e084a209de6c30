"""The control-plane helpers over a real aiohttp server on 127.0.0.1, port 0. Deadline tests
move the loop's clock (tests/manual_clock.py) instead of sleeping through the deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import ClientSession, web
from manual_clock import ManualClock

from protocol.messages import (DecodeDestination, DecodeRequest, DecodeResponseFrame, ErrorCode,
                               ErrorFrame, FinishReason, MessageDecoder, ReserveRequest,
                               ReserveResponse, TokenFrame, TokenLogprob, Usage)
from protocol.sampling_params import SamplingParams
from rpc.control_client import ControlClient
from rpc.control_server import (ControlServer, InsecureBindError, is_loopback, make_app,
                                message_handler, stream_handler)
from rpc.errors import ControlError, FrameDeadlineError, RemoteError
from rpc.frames import FRAMES_CONTENT_TYPE, MSGPACK_CONTENT_TYPE

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

TOKEN = "s3cret-token"


class FakeWorker:
    """Just enough of a decode worker to drive the transport: pure canned answers."""

    def __init__(self) -> None:
        self.stall_after_first = False
        self.stream_closed = asyncio.Event()
        self.never = asyncio.Event()  # a stalled stream waits on this; nobody sets it

    async def reserve(self, request: ReserveRequest) -> ReserveResponse | ErrorFrame:
        if len(request.prompt_token_ids) == 1:  # the test of an overloaded worker
            return ErrorFrame(request_id=request.request_id, code=ErrorCode.OVERLOADED,
                              message="no free blocks", retryable=True)
        num_blocks = -(-len(request.prompt_token_ids) // 4)
        return ReserveResponse(request_id=request.request_id, block_size=4,
                               destination=DecodeDestination(
                                   worker_id="d0", epoch=2, kv_address="ucx://x",
                                   block_ids=list(range(num_blocks)), num_prefix_blocks_held=1))

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenFrame | ErrorFrame]:
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


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeWorker, str]]:
    worker = FakeWorker()
    app = make_app(token=TOKEN, max_body_bytes=64 << 10)
    app.router.add_post("/v1/reserve", message_handler(ReserveRequest, worker.reserve))
    app.router.add_post("/v1/decode", stream_handler(DecodeRequest, worker.decode))
    server = ControlServer(app, token=TOKEN)
    url = await server.start()
    yield worker, url
    await server.stop()


def decode_request(max_tokens: int = 3) -> DecodeRequest:
    return DecodeRequest(request_id="r1", prompt_token_ids=[1, 2], timeout_ms=1000,
                         first_token_id=7, sampling=SamplingParams(max_tokens=max_tokens))


async def test_message_call_round_trip_and_error_frame(served: tuple[FakeWorker, str]) -> None:
    _, url = served
    client = ControlClient(url, token=TOKEN)
    try:
        reply = await client.call("/v1/reserve", ReserveRequest(
            request_id="r1", prompt_token_ids=list(range(10)), timeout_ms=500),
            ReserveResponse, timeout_s=2.0)
        assert reply.destination.block_ids == [0, 1, 2] and reply.destination.epoch == 2
        with pytest.raises(RemoteError) as err:
            await client.call("/v1/reserve", ReserveRequest(
                request_id="r2", prompt_token_ids=[1], timeout_ms=500),
                ReserveResponse, timeout_s=2.0)
        assert err.value.status == 503 and err.value.frame.retryable
        assert err.value.frame.code is ErrorCode.OVERLOADED
    finally:
        await client.aclose()


async def test_token_stream_frames_round_trip(served: tuple[FakeWorker, str]) -> None:
    _, url = served
    client = ControlClient(url, token=TOKEN)
    try:
        frames = [f async for f in client.stream("/v1/decode", decode_request(), TokenFrame,
                                                 first_frame_timeout_s=2.0, frame_timeout_s=1.0)]
        assert [f.token_ids for f in frames] == [[0], [1], [2], []]
        assert "".join(f.text for f in frames) == "t0t1t2"
        assert frames[2].logprobs == [TokenLogprob(2, -1.0, [(2, -1.0)])]
        assert frames[-1].finish_reason is FinishReason.LENGTH
        assert frames[-1].usage == Usage(num_prompt_tokens=2, num_completion_tokens=3)
        # A stream that ends in an ErrorFrame raises after the frames before it.
        received = []
        with pytest.raises(RemoteError) as err:
            async for frame in client.stream("/v1/decode", decode_request(max_tokens=9),
                                             DecodeResponseFrame, 2.0, 1.0):
                received.append(frame)
        assert len(received) == 3 and err.value.frame.code is ErrorCode.PEER_LOST
    finally:
        await client.aclose()


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_missing_or_wrong_token_is_401(served: tuple[FakeWorker, str], token: str | None) -> None:
    worker, url = served
    client = ControlClient(url, token=token)
    try:
        with pytest.raises(RemoteError) as err:
            await client.call("/v1/reserve", ReserveRequest(
                request_id="r1", prompt_token_ids=[2, 3], timeout_ms=500),
                ReserveResponse, timeout_s=2.0)
        assert err.value.status == 401 and err.value.frame.code is ErrorCode.UNAUTHORIZED
        with pytest.raises(RemoteError) as err:
            async for _ in client.stream("/v1/decode", decode_request(), TokenFrame, 2.0, 1.0):
                pass
        assert err.value.status == 401
        assert not worker.stream_closed.is_set(), "the handler must not run unauthenticated"
    finally:
        await client.aclose()


async def test_probe_paths_are_open_but_nothing_else_is() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = make_app(token=TOKEN)
    for path in ("/health", "/ready", "/metrics", "/internal/state"):
        app.router.add_get(path, ok)
    server = ControlServer(app, token=TOKEN)
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/health", "/ready", "/metrics"):
                async with session.get(url + path) as response:
                    assert response.status == 200, path
            async with session.get(url + "/internal/state") as response:
                assert response.status == 401
            async with session.get(url + "/internal/state",
                                   headers={"Authorization": f"Bearer {TOKEN}"}) as response:
                assert response.status == 200
    finally:
        await server.stop()


async def test_peer_dying_mid_stream_is_a_control_error() -> None:
    async def die_mid_frame(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        await response.prepare(request)
        await response.write(b"\x00\x00\x01\x00partial")  # announces 256 bytes, sends 7
        request.transport.abort()  # the connection drops as when the process dies
        return response

    app = make_app(token=None)
    app.router.add_post("/v1/decode", die_mid_frame)
    server = ControlServer(app)
    url = await server.start()
    client = ControlClient(url)
    try:
        with pytest.raises(ControlError):
            async for _ in client.stream("/v1/decode", decode_request(), TokenFrame, 2.0, 1.0):
                pass
    finally:
        await client.aclose()
        await server.stop()


async def test_oversize_body_is_413(served: tuple[FakeWorker, str]) -> None:
    _, url = served
    client = ControlClient(url, token=TOKEN)
    try:
        with pytest.raises(RemoteError) as err:
            await client.call("/v1/reserve", ReserveRequest(
                request_id="r1", prompt_token_ids=list(range(100_000)),
                timeout_ms=500), ReserveResponse, timeout_s=2.0)
        assert err.value.status == 413 and err.value.frame.code is ErrorCode.TOO_LARGE
    finally:
        await client.aclose()


async def test_protocol_version_mismatch_is_a_clear_400(served: tuple[FakeWorker, str]) -> None:
    _, url = served
    body = msgspec.msgpack.encode((99, {"type": "reserve_request"}))
    async with ClientSession() as session:
        async with session.post(url + "/v1/reserve", data=body, headers={
                "Authorization": f"Bearer {TOKEN}", "Content-Type": MSGPACK_CONTENT_TYPE}) as resp:
            assert resp.status == 400
            frame = MessageDecoder(ErrorFrame).decode(await resp.read())
    assert frame.code is ErrorCode.PROTOCOL_VERSION and "99" in frame.message


async def test_stalled_stream_hits_the_frame_deadline_and_the_worker_sees_it(
        served: tuple[FakeWorker, str]) -> None:
    worker, url = served
    worker.stall_after_first = True
    client = ControlClient(url, token=TOKEN)
    received: list[TokenFrame] = []

    async def read() -> None:
        async with contextlib.aclosing(client.stream(
                "/v1/decode", decode_request(), TokenFrame, first_frame_timeout_s=60.0,
                frame_timeout_s=30.0)) as frames:
            async for frame in frames:
                received.append(frame)

    try:
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
        # Hanging up cancels the worker's handler: its producer is closed promptly.
        await asyncio.wait_for(worker.stream_closed.wait(), 5.0)
    finally:
        await client.aclose()


def test_non_loopback_bind_requires_a_token() -> None:
    app = make_app(token=None)
    with pytest.raises(InsecureBindError, match="PDSERVE_INTERNAL_TOKEN"):
        ControlServer(app, host="0.0.0.0")
    with pytest.raises(InsecureBindError):
        ControlServer(app, host="worker-3.internal")
    ControlServer(make_app(token=TOKEN), host="0.0.0.0", token=TOKEN)  # allowed, not started
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5")


async def test_a_body_that_does_not_arrive_in_time_is_408_and_the_handler_never_runs() -> None:
    worker = FakeWorker()
    called = []

    async def reserve(request: ReserveRequest) -> ReserveResponse | ErrorFrame:
        called.append(request)
        return await worker.reserve(request)

    app = make_app(token=None, body_timeout_s=30.0)
    app.router.add_post("/v1/reserve", message_handler(ReserveRequest, reserve))
    server = ControlServer(app)
    url = await server.start()

    rest_sent = asyncio.Event()
    first_part_sent = asyncio.Event()

    async def trickle() -> AsyncIterator[bytes]:
        yield b"\x92\x01"
        first_part_sent.set()
        await rest_sent.wait()  # the rest never comes while the test looks
        yield b"\x80"

    async def post() -> tuple[int, bytes]:
        async with ClientSession() as session:
            async with session.post(url + "/v1/reserve", data=trickle(),
                                    headers={"Content-Type": MSGPACK_CONTENT_TYPE}) as response:
                return response.status, await response.read()

    try:
        with ManualClock() as clock:
            posting = asyncio.create_task(post())
            await asyncio.wait_for(first_part_sent.wait(), 5.0)
            await clock.advance(25.0)  # short of the server's 30 s body deadline
            assert not posting.done()
            # Past it. (The server arms the deadline when its handler starts reading, which
            # may come a little after the client sent the first part: step until it fires.)
            for _ in range(10):
                await clock.advance(10.0)
                if posting.done():
                    break
            status, body = await asyncio.wait_for(posting, 5.0)
        rest_sent.set()
        assert status == 408
        frame = MessageDecoder(ErrorFrame).decode(body)
        assert frame.code is ErrorCode.BAD_REQUEST and "not received" in frame.message
        assert called == []
        server.check_invariants()
    finally:
        await server.stop()
    server.check_invariants()
