"""A streamed answer's direct tokens: when `DirectTokens` takes them, what reaches the client
(aiohttp's own framing, byte for byte: one chunk per push on HTTP/1.1, raw bytes on
HTTP/1.0), what it counts; the relay's offer, which hands it only tokens that end nothing;
and a whole streamed answer whose backend pushes tokens from a loop callback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable

import aiohttp
import pytest
from aiohttp import web
from gateway_harness import MODEL, Harness
from test_relay import frame, relay

from gateway.admission.tiers import TierSpec
from gateway.api.backend import GenerationRequest, TokenDelta
from gateway.api.slo_accounting import RequestTiming
from gateway.api.sse import SseDecoder
from gateway.api.stream_writer import DirectTokens
from protocol.finish_reason import FinishReason
from protocol.messages import TokenFrame, TokenLogprob

TIER = TierSpec("t", priority=0, ttft_ms=500, tpot_ms=50, max_queued=1, max_running=1,
                tokens_per_min=None)


def encode(text: str) -> bytes:
    return f"data: {text}\n\n".encode()


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked HTTP/1.1 body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def direct_tokens() -> tuple[DirectTokens, list[float]]:
    clock = [10.0]
    timing = RequestTiming(TIER, arrived_s=9.0, first_token_s=9.5, last_token_s=9.5,
                           num_tokens=1)
    return DirectTokens(timing, clock=lambda: clock[0]), clock


async def serve_one(version: str, during: Callable[[DirectTokens, list[float]], None]
                    ) -> tuple[bytes, bytes, DirectTokens]:
    """One GET over HTTP/`version` to a real aiohttp server whose handler writes the event
    "first", opens a DirectTokens on its response and calls `during(direct, clock)`, then
    ends the body; returns the response's head and its body as they were on the wire."""
    direct, clock = direct_tokens()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(encode("first"))
        direct.open(response, request.transport, encode)
        during(direct, clock)
        direct.close()
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(f"GET / HTTP/{version}\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        async with asyncio.timeout(5):
            wire = await reader.read()  # to the end: the server closes the connection
        writer.close()
    finally:
        await runner.cleanup()
    head, _, body = wire.partition(b"\r\n\r\n")
    return head, body, direct


def push_two(direct: DirectTokens, clock: list[float]) -> None:
    with direct.waiting():
        assert direct.accepts()
        direct.push([TokenDelta(text="a", num_tokens=1)])
        clock[0] = 10.5
        direct.push([TokenDelta(text="bc", num_tokens=1), TokenDelta(text="d", num_tokens=1)])


@pytest.mark.anyio
async def test_on_http_1_1_each_push_is_one_chunk_of_one_event_per_token_and_is_timed() -> None:
    head, body, direct = await serve_one("1.1", push_two)
    assert b"Transfer-Encoding: chunked" in head
    assert body == (chunk(b"data: first\n\n") + chunk(b"data: a\n\n")
                    + chunk(b"data: bc\n\ndata: d\n\n") + b"0\r\n\r\n")
    assert direct.num_tokens == 3
    assert direct.timing.num_tokens == 4 and direct.timing.last_token_s == 10.5
    assert direct.timing.first_token_s == 9.5
    direct.check_invariants()


@pytest.mark.anyio
async def test_on_http_1_0_the_pushes_are_the_raw_events() -> None:
    head, body, direct = await serve_one("1.0", push_two)
    assert head.startswith(b"HTTP/1.0 200") and b"Transfer-Encoding" not in head
    assert body == b"data: first\n\ndata: a\n\ndata: bc\n\ndata: d\n\n"
    assert direct.num_tokens == 3
    direct.check_invariants()


class Transport:
    """What DirectTokens reads of the client's transport: is it closing, is anything
    buffered (a client that lags)."""

    def __init__(self) -> None:
        self.buffered = 0
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


def test_accepts_only_while_the_handler_waits_and_the_client_keeps_up() -> None:
    direct, _ = direct_tokens()
    transport = Transport()
    direct.open(web.StreamResponse(), transport, encode)  # type: ignore[arg-type]
    assert not direct.accepts(), "outside waiting(): the handler may be writing"
    with direct.waiting():
        assert direct.accepts()
        transport.buffered = 1
        assert not direct.accepts(), "a lagging client gets the handler's bounded writes"
        transport.buffered = 0
        transport.closing = True
        assert not direct.accepts(), "the client is gone"
        transport.closing = False
        assert direct.accepts()
    assert not direct.accepts()
    direct.close()
    with direct.waiting():
        assert not direct.accepts()
    direct.check_invariants()


def test_a_response_without_a_transport_stays_shut() -> None:
    direct, _ = direct_tokens()
    direct.open(web.StreamResponse(), None, encode)  # the client went away before
    with direct.waiting():
        assert not direct.accepts()
    direct.check_invariants()


def test_push_without_accepts_is_a_bug() -> None:
    direct, _ = direct_tokens()
    with pytest.raises(AssertionError):  # never opened
        with direct.waiting():
            direct.push([TokenDelta(text="a", num_tokens=1)])
    direct.open(web.StreamResponse(), Transport(), encode)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):  # outside waiting()
        direct.push([TokenDelta(text="a", num_tokens=1)])
    assert direct.num_tokens == 0


@pytest.mark.anyio
async def test_the_relay_offers_only_tokens_that_end_nothing() -> None:
    r, metrics = relay()
    logprobs = TokenFrame(request_id="r", token_ids=[9], text="<9>",
                          logprobs=[TokenLogprob(9, -0.1)])
    offered: list[bool] = []

    def offer(direct: DirectTokens, clock: list[float]) -> None:
        with direct.waiting():
            offered.append(r.offer(frame(4), "d0", direct))
            offered.append(r.offer(TokenFrame(request_id="r", token_ids=[5, 6],
                                              texts=["<5>", "<6>"]), "d0", direct))
            offered.append(r.offer(frame(7, finish=FinishReason.STOP, total=4), "d0", direct))
            offered.append(r.offer(logprobs, "d0", direct))
            offered.append(r.offer(frame(), "d0", direct))
        offered.append(r.offer(frame(8), "d0", direct))  # not waiting

    _, body, direct = await serve_one("1.1", offer)
    assert offered == [True, True, False, False, False, False]
    assert r.token_ids == [4, 5, 6], "refused frames are left for the pull path"
    assert body == (chunk(b"data: first\n\n") + chunk(b"data: <4>\n\n")
                    + chunk(b"data: <5>\n\ndata: <6>\n\n") + b"0\r\n\r\n")
    assert metrics.num_direct_tokens == direct.num_tokens == 3


class PushingBackend:
    """Answers one word per token. The first comes as a batch; each later plain one is
    delivered by a loop callback (as the read callback of a channel delivers it), which
    pushes it through the request's sink when it accepts and leaves it for the next batch
    otherwise; the last comes as a batch with its finish."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.num_pushed = 0

    def context_limit(self) -> int | None:
        return None

    async def generate_batches(self, request: GenerationRequest
                               ) -> AsyncGenerator[list[TokenDelta], None]:
        loop = asyncio.get_running_loop()
        sink = request.sink
        words = self.words
        yield [TokenDelta(text=words[0], num_tokens=1)]
        pending: list[TokenDelta] = []
        for word in words[1:-1]:
            delivered: asyncio.Future[None] = loop.create_future()

            def deliver(delta: TokenDelta = TokenDelta(text=word, num_tokens=1)) -> None:
                if not pending and sink is not None and sink.accepts():
                    sink.push([delta])
                    self.num_pushed += 1
                else:
                    pending.append(delta)
                delivered.set_result(None)

            loop.call_soon(deliver)
            await delivered
            if len(pending) == 2:  # what the pull path takes meanwhile
                yield pending[:]
                pending.clear()
        if pending:
            yield pending
        yield [TokenDelta(text=words[-1], num_tokens=1, finish_reason=FinishReason.STOP)]


@pytest.mark.parametrize("version", [aiohttp.HttpVersion11, aiohttp.HttpVersion10])
def test_a_streamed_answer_carries_pushed_and_pulled_tokens_in_order(
        harness_factory: Callable[..., Harness], version: aiohttp.HttpVersion) -> None:
    words = [f" w{i}" for i in range(12)]
    backend = PushingBackend(words)
    h = harness_factory(backend=backend)

    async def post() -> tuple[int, dict[str, str], bytes]:
        # Connection: close, as an HTTP/1.0 body without a length ends with the connection.
        async with aiohttp.ClientSession(version=version,
                                         timeout=aiohttp.ClientTimeout(total=10)) as session, \
                session.post(h.server.make_url("/v1/completions"),
                             headers={"Connection": "close"}, json={
                                 "model": MODEL, "prompt": "hi", "max_tokens": 20,
                                 "stream": True, "stream_options": {"include_usage": True}}
                             ) as response:
            return response.status, dict(response.headers), await response.read()

    status, headers, raw = h.loop.run_until_complete(post())
    assert status == 200
    assert (headers.get("Transfer-Encoding") == "chunked") is (version == aiohttp.HttpVersion11)
    events = SseDecoder().feed(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == words, "a token lost or reordered"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len(words)  # pushed ones included
    assert backend.num_pushed > 0, "no token took the direct way"
