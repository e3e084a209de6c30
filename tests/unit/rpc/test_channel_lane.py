"""A stream's FrameLane over a real control server on 127.0.0.1, port 0: frames sent from a
callback while the producer's task waits reach the client in order with the producer's own,
over HTTP the producer gets no lane, and a cancelled stream's lane refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from protocol.messages import DecodeRequest, DecodeResponseFrame, FinishReason, TokenFrame
from protocol.sampling_params import SamplingParams
from rpc.channel_client import ChannelPool
from rpc.control_app import FrameLane
from rpc.control_client import ControlClient
from rpc.control_server import ControlServer, add_lane_stream, make_app
from rpc.frames import FrameBatchDecoder

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TOKEN = "lane-token"
FRAMES: FrameBatchDecoder[TokenFrame] = FrameBatchDecoder(DecodeResponseFrame)


@pytest.fixture(params=["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


def _token(rid: str, i: int, last: bool = False) -> TokenFrame:
    return TokenFrame(request_id=rid, token_ids=[i], text=f"t{i}",
                      finish_reason=FinishReason.LENGTH if last else None)


class LaneWorker:
    """Sends tokens 0..n-2 from loop callbacks through the lane (when it has one) while its
    task waits, then yields the last token itself. Prompt [0]: stops after token 1 and
    keeps the lane (for the test to try it later)."""

    def __init__(self) -> None:
        self.lanes: dict[str, FrameLane | None] = {}
        self.closed: list[str] = []
        self.refused: list[int] = []

    async def decode(self, request: DecodeRequest, lane: FrameLane | None
                     ) -> AsyncIterator[TokenFrame]:
        rid, n = request.request_id, request.sampling.max_tokens
        self.lanes[rid] = lane
        try:
            if lane is None:
                for i in range(n):
                    yield _token(rid, i, i == n - 1)
                return
            loop, done = asyncio.get_running_loop(), asyncio.Event()

            def push(i: int) -> None:
                if i == n - 1 or (request.prompt_token_ids == [0] and i == 2):
                    done.set()
                elif lane.send(_token(rid, i)):
                    loop.call_soon(push, i + 1)
                else:
                    self.refused.append(i)
                    done.set()

            loop.call_soon(push, 0)
            await done.wait()
            if request.prompt_token_ids == [0]:
                await asyncio.Event().wait()  # until cancelled
            yield _token(rid, n - 1, True)
        finally:
            self.closed.append(rid)


@pytest.fixture
async def served() -> AsyncIterator[tuple[LaneWorker, ControlServer]]:
    worker = LaneWorker()
    app = make_app(token=TOKEN)
    add_lane_stream(app, "/internal/decode", DecodeRequest, worker.decode)
    server = ControlServer(app, token=TOKEN)
    await server.start()
    yield worker, server
    await server.stop()
    server.check_invariants()


def _decode(rid: str, n: int, prompt: list[int] | None = None) -> DecodeRequest:
    return DecodeRequest(request_id=rid, prompt_token_ids=prompt or [7],
                         sampling=SamplingParams(max_tokens=n), timeout_ms=60_000)


async def test_lane_frames_and_the_producers_own_arrive_in_order(
        served: tuple[LaneWorker, ControlServer]) -> None:
    worker, server = served
    pool = ChannelPool(TOKEN, connect_timeout_s=5)
    over_channel = ControlClient(server.url, TOKEN, channels=pool)
    over_http = ControlClient(server.url, TOKEN)
    try:
        for client, rid in ((over_channel, "c"), (over_http, "h")):
            frames = [f async for f in client.stream("/internal/decode", _decode(rid, 6),
                                                     DecodeResponseFrame, 5, 5)]
            assert [f.token_ids for f in frames] == [[i] for i in range(6)], rid
            assert [f.finish_reason for f in frames] == [None] * 5 + [FinishReason.LENGTH]
        assert worker.lanes["c"] is not None and worker.lanes["h"] is None
        channel = await pool.get(server.url)
        assert channel is not None
        many = [channel.open(_decode(f"m{i}", 30), FRAMES, 5, 5) for i in range(40)]
        results = await asyncio.gather(*(_token_ids(s) for s in many))
        assert results == [list(range(30))] * 40
        assert not worker.refused
    finally:
        await over_channel.aclose()
        await over_http.aclose()
        pool.check_invariants()
        await pool.aclose()


async def test_a_cancelled_streams_lane_refuses(
        served: tuple[LaneWorker, ControlServer]) -> None:
    worker, server = served
    pool = ChannelPool(TOKEN, connect_timeout_s=5)
    try:
        channel = await pool.get(server.url)
        assert channel is not None
        stream = channel.open(_decode("x", 10, [0]), FRAMES, 5, 5)
        assert [f.token_ids for f in await anext(stream)][0] == [0]
        lane = worker.lanes["x"]
        assert lane is not None
        await stream.aclose()  # the gateway drops the stream: the worker cancels it
        async with asyncio.timeout(5):
            while "x" not in worker.closed:
                await asyncio.sleep(0.01)
        assert not lane.send(_token("x", 5))
    finally:
        pool.check_invariants()
        await pool.aclose()


async def _token_ids(stream: AsyncIterator[list[TokenFrame]]) -> list[int]:
    return [t async for batch in stream for frame in batch for t in frame.token_ids]
