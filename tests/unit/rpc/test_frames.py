"""The gateway's batched frame reader: splitting, decoding, deadlines, errors, reuse.

The splitting tests are pure; the stream tests run a real control server on 127.0.0.1:0,
and the deadline tests move the loop's clock (tests/manual_clock.py) instead of sleeping.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiohttp import ClientSession, TCPConnector, web
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock

from protocol.messages import (DecodeRequest, DecodeResponseFrame, ErrorCode, ErrorFrame,
                               FinishReason, ProtocolVersionError, TokenFrame)
from protocol.sampling_params import SamplingParams
from rpc.control_server import ControlServer, make_app
from rpc.errors import ControlError, FrameDeadlineError, RemoteError
from rpc.frames import FRAME_HEADER, FrameBatchDecoder, encode_frame, stream_frame_batches

pytestmark = pytest.mark.timeout(30)


def token(i: int, finish: FinishReason | None = None) -> TokenFrame:
    return TokenFrame(request_id="r", token_ids=[i], text=f" t{i}", finish_reason=finish)


@settings(max_examples=200, deadline=None)
@given(num_frames=st.integers(1, 12), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_every_frame_once_in_order_however_the_bytes_are_cut(num_frames, cuts):
    frames = [token(i) for i in range(num_frames)]
    wire = b"".join(encode_frame(f) for f in frames)
    points = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    decoder = FrameBatchDecoder(DecodeResponseFrame)
    got = []
    for start, end in zip(points, points[1:]):
        got += decoder.feed(wire[start:end])
    assert got == frames
    assert not decoder.has_partial_frame


def test_other_protocol_version_and_oversized_frames_are_refused():
    decoder = FrameBatchDecoder(DecodeResponseFrame)
    body = msgspec.msgpack.encode((99, token(1)))
    with pytest.raises(ProtocolVersionError):
        decoder.feed(FRAME_HEADER.pack(len(body)) + body)
    small = FrameBatchDecoder(DecodeResponseFrame, max_frame_bytes=16)
    with pytest.raises(ControlError, match="exceeds"):
        small.feed(FRAME_HEADER.pack(17))


def test_fresh_decoder_shares_nothing_buffered():
    first = FrameBatchDecoder(DecodeResponseFrame)
    wire = encode_frame(token(1))
    assert first.feed(wire[:5]) == [] and first.has_partial_frame
    second = first.fresh()
    assert second.feed(wire) == [token(1)] and not second.has_partial_frame
    assert first.feed(wire[5:]) == [token(1)]


# ---------------------------------------------------------------- against a real server


class ScriptedWorker:
    """Streams `script` for every decode request: frames, a float (sleep that long) or an
    asyncio.Event (wait until the test sets it)."""

    def __init__(self) -> None:
        self.script: list[object] = []
        self.peers: list[tuple] = []  # the client address of each request: reuse shows here
        self.server: ControlServer | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/x-pdserve-frames"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for step in self.script:
            if isinstance(step, float):
                await asyncio.sleep(step)
            elif isinstance(step, asyncio.Event):
                await step.wait()
            else:
                await response.write(encode_frame(step))
        await response.write_eof()
        return response

    async def __aenter__(self) -> str:
        app = make_app(token=None)
        app.router.add_post("/internal/decode", self.handle)
        self.server = ControlServer(app)
        return await self.server.start() + "/internal/decode"

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()


DECODE_FRAMES = FrameBatchDecoder(DecodeResponseFrame)
REQUEST = DecodeRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=8),
                        timeout_ms=10_000)


async def collect(session: ClientSession, url: str, frame_timeout_s: float = 5.0) -> list:
    got = []
    async for batch in stream_frame_batches(session, url, REQUEST, DECODE_FRAMES, 5.0,
                                            frame_timeout_s):
        assert batch, "an empty batch was yielded"
        got += batch
    return got


def test_stream_yields_all_frames_then_reuses_the_connection():
    async def main() -> None:
        worker = ScriptedWorker()
        frames = [token(i) for i in range(5)] + [token(5, FinishReason.STOP)]
        worker.script = [frames[0], 0.01, *frames[1:]]
        async with worker as url, ClientSession(connector=TCPConnector(limit=0)) as session:
            assert await collect(session, url) == frames
            assert await collect(session, url) == frames
        assert worker.peers[0] == worker.peers[1], "a finished stream's connection was not reused"
    asyncio.run(main())


def test_stalled_stream_fails_at_the_frame_deadline_and_drops_the_connection():
    async def main() -> None:
        worker = ScriptedWorker()
        held = asyncio.Event()
        worker.script = [token(0), held, token(1)]
        async with worker as url, ClientSession() as session:
            got: list = []

            async def read() -> None:
                async for batch in stream_frame_batches(session, url, REQUEST,
                                                        DECODE_FRAMES, 5.0, 30.0):
                    got.extend(batch)

            with ManualClock() as clock:
                reader = asyncio.create_task(read())
                while not got:
                    await asyncio.sleep(0.01)
                await clock.advance(25.0)  # short of the 30 s frame deadline
                assert not reader.done() and got == [token(0)]
                await clock.advance(10.0)  # past it
                with pytest.raises(FrameDeadlineError, match="stalled"):
                    await asyncio.wait_for(reader, 5.0)
            assert got == [token(0)]
            held.set()
            worker.script = [token(7, FinishReason.STOP)]
            assert await collect(session, url) == [token(7, FinishReason.STOP)]
        assert worker.peers[0] != worker.peers[1], "a stalled connection was reused"
    asyncio.run(main())


def test_slow_consumer_is_not_mistaken_for_a_stalled_worker():
    async def main() -> None:
        worker = ScriptedWorker()
        held = asyncio.Event()
        worker.script = [token(0), held, token(1, FinishReason.STOP)]
        async with worker as url, ClientSession() as session:
            got = []
            with ManualClock() as clock:
                async for batch in stream_frame_batches(session, url, REQUEST,
                                                        DECODE_FRAMES, 5.0, 2.0):
                    got += batch
                    if not held.is_set():
                        # Far past the frame deadline, spent here while the worker waits.
                        await clock.advance(60.0)
                        held.set()
            assert got == [token(0), token(1, FinishReason.STOP)]
    asyncio.run(main())


def test_error_frame_raises_after_the_frames_before_it():
    async def main() -> None:
        worker = ScriptedWorker()
        error = ErrorFrame(request_id="r", code=ErrorCode.PEER_LOST, message="gone")
        worker.script = [token(0), token(1), error]
        async with worker as url, ClientSession() as session:
            got = []
            with pytest.raises(RemoteError, match="gone"):
                async for batch in stream_frame_batches(session, url, REQUEST,
                                                        DECODE_FRAMES, 5.0, 5.0):
                    got += batch
            assert got == [token(0), token(1)]
    asyncio.run(main())


def test_stream_cut_inside_a_frame_is_an_error():
    async def main() -> None:
        async def cut(request: web.Request) -> web.StreamResponse:
            await request.read()
            response = web.StreamResponse(
                headers={"Content-Type": "application/x-pdserve-frames"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            await response.write(encode_frame(token(0))[:-2])
            await response.write_eof()
            return response

        app = make_app(token=None)
        app.router.add_post("/internal/decode", cut)
        server = ControlServer(app)
        url = await server.start() + "/internal/decode"
        try:
            async with ClientSession() as session:
                with pytest.raises(ControlError, match="cut inside a frame"):
                    await collect(session, url)
        finally:
            await server.stop()
    asyncio.run(main())
