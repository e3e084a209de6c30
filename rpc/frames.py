"""The frame stream of the control plane: its wire format, and its one reader.

A worker answers a stream request (rpc/control_server.py's `stream_handler`)
with a chunked body of length-prefixed frames:

    ┌────────────── 4 bytes ─────────────┬──────── length bytes ─────────┐
    │ length, unsigned big-endian        │ msgpack [version, message]    │  repeated
    └────────────────────────────────────┴───────────────────────────────┘

`stream_frame_batches` reads it for every client (the gateway's relay and
`ControlClient.stream`) in batches, every complete frame one socket read delivered,
because on the relay path the cost is paid once per token:

    readany() ─▶ b"[len|frame][len|frame][len|fr"   ─▶ yields [frame, frame]
                                          └ kept ─┘     (the tail waits for the next read)

  * one `readany()` per batch (whatever the connection has buffered, across HTTP chunks);
  * one typed msgspec decode per frame (envelope and message together); only a frame
    that fails it is decoded again by `MessageDecoder`, to raise the precise
    `ProtocolError` / `ProtocolVersionError`;
  * one deadline watchdog per stream (a `loop.call_at` handle): arming it for a wait is
    an attribute store; the handle is moved only when it fires early, at most once per
    `frame_timeout_s`. On expiry it fails the response's reader with
    `FrameDeadlineError`, which the pending `readany()` raises.

Lifecycle: opened (POST sent, headers within `first_frame_timeout_s`) → streaming
(batches; each wait for data bounded by the current timeout) → ended (clean EOF after a
whole frame), failed (ErrorFrame → `RemoteError`, cut stream → `ControlError`, deadline →
`FrameDeadlineError`) or closed early (`aclose()`: the connection is dropped, which the
worker treats as an abort). A connection whose answer was read to its end is reused.

Invariants: frames are yielded exactly once and in wire order; a yielded batch is never
empty; an ErrorFrame is never yielded (it raises, after the frames before it in the same
read were yielded); the watchdog handle is cancelled when the stream ends, however.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncGenerator
from typing import Generic, TypeVar

import aiohttp
import msgspec
from aiohttp import ClientResponse, ClientSession, ClientTimeout

from protocol.messages import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ErrorFrame, Message,
                               MessageDecoder, ProtocolError, encode)
from rpc.errors import ControlError, FrameDeadlineError, RemoteError

MSGPACK_CONTENT_TYPE = "application/x-msgpack"
FRAMES_CONTENT_TYPE = "application/x-pdserve-frames"
FRAME_HEADER = struct.Struct(">I")
_HEADER_SIZE = FRAME_HEADER.size
_unpack_length = FRAME_HEADER.unpack_from

F = TypeVar("F", bound=Message)


def encode_frame(message: Message) -> bytes:
    body = encode(message)
    return FRAME_HEADER.pack(len(body)) + body


class FrameWatchdog:
    """Fails a response's reader when one wait for data outlasts its timeout.

    `wait(timeout_s)` before awaiting the socket, `done()` after: a few attribute stores
    and one `loop.time()`. The timer handle sits at or before the live deadline (moved
    earlier when the timeout shrinks); when it fires early it re-arms itself at the live one.
    """

    def __init__(self, response: ClientResponse, what: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._response = response
        self._what = what
        self._deadline: float | None = None  # None: not waiting
        self._timeout_s = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = 0.0  # when the handle fires

    def wait(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._deadline = deadline = self._loop.time() + timeout_s
        if self._handle is None or deadline < self._armed_at:
            # Moved earlier only when the timeout shrinks (first frame -> next frames).
            if self._handle is not None:
                self._handle.cancel()
            self._armed_at = deadline
            self._handle = self._loop.call_at(deadline, self._fire)

    def done(self) -> None:
        self._deadline = None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        deadline = self._deadline
        if deadline is None:
            return  # not waiting now; the next wait() re-arms
        if self._loop.time() < deadline:
            self._armed_at = deadline
            self._handle = self._loop.call_at(deadline, self._fire)
            return
        self._response.content.set_exception(FrameDeadlineError(
            f"{self._what}: no frame within {self._timeout_s} s (stream stalled)"))


class FrameBatchDecoder(Generic[F]):
    """Splits bytes into frames and decodes them; keeps an incomplete tail for the next feed.

    `frame_type` is a message type or a union of them; the frames come out as F or
    ErrorFrame. One per stream; `fresh()` makes the next one sharing the typed msgspec
    decoders, which cost more to build than a whole short stream costs to decode.
    """

    def __init__(self, frame_type: object, max_frame_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.frame_type = frame_type
        self.max_frame_bytes = max_frame_bytes
        self._fast: msgspec.msgpack.Decoder[tuple[int, F | ErrorFrame]] = \
            msgspec.msgpack.Decoder(tuple[int, ErrorFrame | frame_type])  # type: ignore[valid-type]
        self._precise: MessageDecoder[F | ErrorFrame] = MessageDecoder(ErrorFrame | frame_type,
                                                                       max_frame_bytes)
        self._tail = b""

    def fresh(self) -> FrameBatchDecoder[F]:
        """A decoder for another stream: same types and limit, no buffered bytes."""
        other: FrameBatchDecoder[F] = object.__new__(FrameBatchDecoder)
        other.frame_type, other.max_frame_bytes = self.frame_type, self.max_frame_bytes
        other._fast, other._precise, other._tail = self._fast, self._precise, b""
        return other

    @property
    def has_partial_frame(self) -> bool:
        return bool(self._tail)

    def feed(self, data: bytes) -> list[F | ErrorFrame]:
        """Every frame completed by `data`, in order (ErrorFrames included)."""
        if self._tail:
            data = self._tail + data
        elif len(data) > _HEADER_SIZE and _unpack_length(data, 0)[0] == len(data) - _HEADER_SIZE:
            # A paced stream's usual read: exactly one whole frame.
            if len(data) - _HEADER_SIZE > self.max_frame_bytes:
                raise ControlError(f"frame of {len(data) - _HEADER_SIZE} bytes exceeds "
                                   f"{self.max_frame_bytes}")
            return [self.decode_one(data[_HEADER_SIZE:])]
        frames: list[F | ErrorFrame] = []
        view = memoryview(data)
        pos, size = 0, len(data)
        while pos + _HEADER_SIZE <= size:
            (length,) = _unpack_length(data, pos)
            if length > self.max_frame_bytes:
                raise ControlError(f"frame of {length} bytes exceeds {self.max_frame_bytes}")
            end = pos + _HEADER_SIZE + length
            if end > size:
                break
            frames.append(self.decode_one(view[pos + _HEADER_SIZE:end]))
            pos = end
        self._tail = data[pos:] if pos < size else b""
        return frames

    def decode_whole(self, body: bytes) -> F | ErrorFrame:
        """A non-stream answer's body (one envelope, no length prefix)."""
        return self._precise.decode(body)

    def decode_one(self, body: bytes | memoryview) -> F | ErrorFrame:
        """One frame's body (its envelope), however it was delimited."""
        try:
            version, message = self._fast.decode(body)
        except (msgspec.DecodeError, ValueError):
            # Let the envelope-first decoder say precisely what is wrong (version, field).
            return self._precise.decode(body)
        if version != PROTOCOL_VERSION:
            return self._precise.decode(body)  # raises ProtocolVersionError
        return message


async def stream_frame_batches(session: ClientSession, url: str, message: Message,
                               frames: FrameBatchDecoder[F], first_frame_timeout_s: float,
                               frame_timeout_s: float, token: str | None = None
                               ) -> AsyncGenerator[list[F], None]:
    """POST `message` to `url`; yield lists of the answer's frames until the worker ends it.

    `frames` says what the frames are (its `fresh()` copy decodes this stream). Errors: an
    ErrorFrame raises RemoteError (after the frames before it in the same read were
    yielded); a refused connection or a cut stream ControlError; a missed deadline
    FrameDeadlineError. An early `aclose()` drops the connection (the worker's abort).
    """
    headers = {"Content-Type": MSGPACK_CONTENT_TYPE}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    decoder = frames.fresh()
    max_frame_bytes = decoder.max_frame_bytes
    try:
        async with asyncio.timeout(first_frame_timeout_s):
            response = await session.post(url, data=encode(message), headers=headers,
                                          timeout=ClientTimeout(total=None))
    except TimeoutError as exc:
        raise FrameDeadlineError(f"{url}: no response within {first_frame_timeout_s} s") from exc
    except aiohttp.ClientError as exc:  # refused or reset: the worker is gone
        raise ControlError(f"{url}: {type(exc).__name__}: {exc}") from exc
    watchdog = FrameWatchdog(response, url)
    try:
        if response.content_type != FRAMES_CONTENT_TYPE:
            try:
                body = await asyncio.wait_for(response.content.read(max_frame_bytes + 1),
                                              frame_timeout_s)
                answer = decoder.decode_whole(body)
            except ProtocolError as exc:
                raise ControlError(f"HTTP {response.status} with an undecodable body: {exc}",
                                   response.status) from exc
            if isinstance(answer, ErrorFrame):
                raise RemoteError(answer, response.status)
            raise ControlError(f"{url}: HTTP {response.status} without a frame stream",
                               response.status)
        content = response.content
        timeout_s = first_frame_timeout_s
        while True:
            watchdog.wait(timeout_s)
            try:
                data = await content.readany()
            except aiohttp.ClientError as exc:  # the worker died mid-stream
                raise ControlError(f"{url}: stream broken: {type(exc).__name__}: {exc}") from exc
            finally:
                watchdog.done()
            if not data:
                if decoder.has_partial_frame:
                    raise ControlError("frame stream cut inside a frame")
                return
            batch = decoder.feed(data)
            if not batch:
                continue
            timeout_s = frame_timeout_s
            good: list[F] = []
            for frame in batch:
                if isinstance(frame, ErrorFrame):
                    if good:
                        yield good
                    raise RemoteError(frame, response.status)
                good.append(frame)
            yield good
    finally:
        watchdog.cancel()
        if response.content.is_eof() and not decoder.has_partial_frame:
            # The worker finished its answer (often the end-of-body chunk came with the
            # last frame): the connection goes back to the pool, saving the next request
            # a TCP handshake. release() still closes it if aiohttp deems it unusable.
            response.release()
        else:
            response.close()  # an early exit must drop the connection: the worker's abort
