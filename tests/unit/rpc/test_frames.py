"""A stream's frames as the caller reads them: the channel's splitter delimits them
(rpc/channel_wire.py), `FrameDecoder` types each body. Pure: no sockets (the streams
themselves run over real servers in test_channel.py and test_control_server.py)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.messages import (PROTOCOL_VERSION, AbortResponse, DecodeResponseFrame, ErrorCode,
                               ErrorFrame, FinishReason, PrefillResult, ProtocolError,
                               ProtocolVersionError, TokenFrame, TransferStatus, encode)
from rpc.channel_wire import FrameSplitter, FrameTooLarge, end_frame, frame
from rpc.frames import FrameDecoder

pytestmark = pytest.mark.timeout(30)

DECODE_FRAMES: FrameDecoder[TokenFrame] = FrameDecoder(DecodeResponseFrame)


def token(i: int, finish: FinishReason | None = None) -> TokenFrame:
    return TokenFrame(request_id="r", token_ids=[i], text=f" t{i}", finish_reason=finish)


def test_a_body_decodes_to_its_own_type_or_an_error_frame() -> None:
    error = ErrorFrame(request_id="r", code=ErrorCode.PEER_LOST, message="gone", retryable=True)
    last = token(3, FinishReason.STOP)
    for message in (token(1), last, error):
        body = encode(message)
        decoded = DECODE_FRAMES.decode(body)
        assert decoded == message and type(decoded) is type(message)
        # The channel hands the decoder views into its read buffer.
        assert DECODE_FRAMES.decode(memoryview(b"xx" + body)[2:]) == message


def test_a_union_of_frame_types_decodes_each_member() -> None:
    decoder: FrameDecoder[PrefillResult | TokenFrame] = FrameDecoder(PrefillResult | TokenFrame)
    result = PrefillResult(request_id="r", first_token_id=5, num_prompt_tokens=3,
                           num_cached_tokens=0, transfer_status=TransferStatus.PENDING)
    assert decoder.decode(encode(result)) == result
    assert decoder.decode(encode(token(2))) == token(2)


def test_another_protocol_version_is_refused_by_name() -> None:
    body = msgspec.msgpack.encode((PROTOCOL_VERSION + 98, token(1)))
    with pytest.raises(ProtocolVersionError, match=str(PROTOCOL_VERSION + 98)):
        DECODE_FRAMES.decode(body)


@pytest.mark.parametrize("body, says", [
    (b"\xc1garbage", "envelope"),  # not msgpack at all
    (msgspec.msgpack.encode([PROTOCOL_VERSION]), "envelope"),  # no message in the envelope
    (encode(AbortResponse(request_id="r", found=True)), "TokenFrame"),  # not this stream's type
    (msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "token_frame", "request_id": "r",
                                                "token_ids": ["x"]})), "TokenFrame"),
])
def test_anything_else_is_a_protocol_error_saying_what_is_wrong(body: bytes, says: str) -> None:
    with pytest.raises(ProtocolError, match=says) as info:
        DECODE_FRAMES.decode(body)
    assert not isinstance(info.value, ProtocolVersionError)


@settings(max_examples=200, deadline=None)
@given(num_frames=st.integers(1, 12), cuts=st.lists(st.integers(0, 600), max_size=8))
def test_every_frame_once_in_order_however_the_bytes_are_cut(num_frames: int,
                                                             cuts: list[int]) -> None:
    # Two streams interleaved on one channel, each ended by an empty frame.
    sent = [(1 + i % 2, token(i)) for i in range(num_frames)]
    wire = b"".join(frame(sid, encode(m)) for sid, m in sent) + end_frame(1) + end_frame(2)
    points = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    splitter = FrameSplitter(1 << 16)
    got: list[tuple[int, bytes | memoryview]] = []
    for start, end in zip(points, points[1:]):
        got += splitter.feed(wire[start:end])
    assert not splitter.has_partial_frame
    assert [(sid, DECODE_FRAMES.decode(body)) for sid, body in got[:-2]] == sent
    assert [(sid, bytes(body)) for sid, body in got[-2:]] == [(1, b""), (2, b"")]


def test_a_frame_over_the_limit_is_refused_before_it_is_buffered() -> None:
    splitter = FrameSplitter(16)
    assert splitter.feed(frame(1, b"x" * 16)) == [(1, b"x" * 16)]
    with pytest.raises(FrameTooLarge, match="exceeds 16"):
        splitter.feed(frame(1, b"x" * 17)[:9])  # the header and one byte are enough to know
