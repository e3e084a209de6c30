"""The fast lane: when it takes tokens, what it writes (chunked SSE, byte for byte), what it
counts; and the relay's offer, which hands it only tokens that end nothing."""

from __future__ import annotations

import pytest
from test_relay import frame, relay

from gateway.admission.tiers import TierSpec
from gateway.api.backend import TokenDelta
from gateway.api.fast_lane import FastLane
from gateway.api.slo_accounting import RequestTiming
from protocol.finish_reason import FinishReason
from protocol.messages import TokenFrame, TokenLogprob

TIER = TierSpec("t", priority=0, ttft_ms=500, tpot_ms=50, max_queued=1, max_running=1,
                tokens_per_min=None)


class Transport:
    """What the lane reads of a transport, and the bytes written to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


def encode(text: str) -> bytes:
    return f"data: {text}\n\n".encode()


def lane(chunked: bool = True) -> tuple[FastLane, Transport, list[float]]:
    clock = [10.0]
    timing = RequestTiming(TIER, arrived_s=9.0, first_token_s=9.5, last_token_s=9.5,
                           num_tokens=1)
    fast = FastLane(timing, clock=lambda: clock[0])
    transport = Transport()
    fast.open(transport, encode, chunked)  # type: ignore[arg-type]
    return fast, transport, clock


def test_accepts_only_while_the_handler_waits_and_the_client_keeps_up() -> None:
    fast, transport, _ = lane()
    assert not fast.accepts(), "outside waiting(): the handler may be writing"
    with fast.waiting():
        assert fast.accepts()
        transport.buffered = 1
        assert not fast.accepts(), "a lagging client gets the handler's bounded writes"
        transport.buffered = 0
        transport.closing = True
        assert not fast.accepts()
    fast.close()
    with fast.waiting():
        assert not fast.accepts()


def test_an_unchunked_response_keeps_the_lane_shut() -> None:
    fast, _, _ = lane(chunked=False)
    with fast.waiting():
        assert not fast.accepts()


def test_a_push_is_one_chunk_of_one_event_per_token_and_is_timed() -> None:
    fast, transport, clock = lane()
    with fast.waiting():
        fast.push([TokenDelta(text="a", num_tokens=1)])
        clock[0] = 10.5
        fast.push([TokenDelta(text="bc", num_tokens=1), TokenDelta(text="d", num_tokens=1)])
    assert transport.written == [b"9\r\ndata: a\n\n\r\n",
                                 b"13\r\ndata: bc\n\ndata: d\n\n\r\n"]
    assert fast.num_tokens == 3
    assert fast.timing.num_tokens == 4 and fast.timing.last_token_s == 10.5
    assert fast.timing.first_token_s == 9.5
    fast.check_invariants()


def test_push_without_accepts_is_a_bug() -> None:
    fast, _, _ = lane()
    with pytest.raises(AssertionError):
        fast.push([TokenDelta(text="a", num_tokens=1)])


def test_the_relay_offers_only_tokens_that_end_nothing() -> None:
    r, metrics = relay()
    fast, transport, _ = lane()
    logprobs = TokenFrame(request_id="r", token_ids=[9], text="<9>",
                          logprobs=[TokenLogprob(9, -0.1)])
    with fast.waiting():
        assert r.offer(frame(4), "d0", fast)
        assert r.offer(TokenFrame(request_id="r", token_ids=[5, 6], texts=["<5>", "<6>"]),
                       "d0", fast)
        assert not r.offer(frame(7, finish=FinishReason.STOP, total=4), "d0", fast)
        assert not r.offer(logprobs, "d0", fast)
        assert not r.offer(frame(), "d0", fast)
    assert not r.offer(frame(8), "d0", fast), "the lane is not waiting"
    assert r.token_ids == [4, 5, 6], "refused frames are left for the pull path"
    assert transport.written == [b"b\r\ndata: <4>\n\n\r\n",
                                 b"16\r\ndata: <5>\n\ndata: <6>\n\n\r\n"]
    assert metrics.num_fast_lane_tokens == 3
