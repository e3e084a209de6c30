"""The internal control plane, client side: one worker's control API as typed calls.

    call(path, message, response type, timeout)     one message, one answer back
    open_stream(path, message, frames, timeouts)    one message, its answer's frames in batches
    stream(path, message, frame type, timeouts)     the same, frame by frame

Given a `ChannelPool`, a client sends over the worker's channel (one persistent connection
per worker, rpc/channel_client.py) and over HTTP only to a worker that has
none; without one, each call is a POST and a stream is read by the one frame reader,
`rpc/frames.py`'s `stream_frame_batches`. Both send protocol envelopes
(protocol/messages.py). Errors: an ErrorFrame answer raises `RemoteError`; a
refused connection, a cut stream or an undecodable answer raise `ControlError`; a missed
deadline raises `FrameDeadlineError` (control_errors.py).

Deadlines: `call` has one overall deadline; `stream` one for the response headers and the
first frame, and one per later frame, so a stalled worker is noticed within
frame_timeout_s and the request can fail cleanly instead of hanging.

Lifecycle: a client owns its aiohttp session unless one is passed in; `aclose()` closes an
owned session exactly once. Invariant (`check_invariants`): a closed client holds no session.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import aiohttp
from aiohttp import ClientSession, ClientTimeout

from protocol.messages import (MAX_MESSAGE_BYTES, ErrorFrame, Message, MessageDecoder,
                               ProtocolError, encode)
from rpc.channel_client import ChannelPool, ChannelStream
from rpc.errors import ControlError, FrameDeadlineError, RemoteError
from rpc.frames import MSGPACK_CONTENT_TYPE, FrameBatchDecoder, stream_frame_batches

R = TypeVar("R", bound=Message)
F = TypeVar("F", bound=Message)


class FrameBatches(Protocol[F]):
    """Batches of a stream answer's frames: `FrameStream`, or any async generator of them."""

    def __aiter__(self) -> AsyncIterator[list[F]]: ...

    def __anext__(self) -> Awaitable[list[F]]: ...

    async def aclose(self) -> None: ...


class ControlClient:
    """Calls one worker's control API."""

    def __init__(self, base_url: str, token: str | None = None,
                 session: ClientSession | None = None,
                 max_frame_bytes: int = MAX_MESSAGE_BYTES,
                 channels: ChannelPool | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.channels = channels
        self.max_frame_bytes = max_frame_bytes
        self._token = token
        self._headers = {"Content-Type": MSGPACK_CONTENT_TYPE}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._owns_session = session is None
        self._session = session
        self._closed = False
        self._frame_decoders: dict[object, FrameBatchDecoder[Message]] = {}

    def _get_session(self) -> ClientSession:
        if self._closed:
            raise ControlError(f"control client of {self.base_url} is closed")
        if self._session is None:
            self._session = ClientSession()
        return self._session

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def call(self, path: str, message: Message, response_type: type[R],
                   timeout_s: float) -> R:
        """Send one message, return the decoded answer; an ErrorFrame raises RemoteError."""
        if self.channels is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    channel = await self.channels.get(self.base_url)
                    if channel is not None:
                        answers: list[Message] = []
                        stream = channel.open(message, self._frames(response_type), timeout_s,
                                              timeout_s)
                        async with contextlib.aclosing(stream):  # early exit: worker drops it
                            async for batch in stream:
                                answers += batch
                        if len(answers) != 1 or not isinstance(answers[0], response_type):
                            raise ControlError(f"{path}: {len(answers)} answers to one call")
                        return answers[0]
            except TimeoutError as exc:
                raise FrameDeadlineError(f"{path}: no answer within {timeout_s} s") from exc
        decoder: MessageDecoder[R | ErrorFrame] = MessageDecoder(ErrorFrame | response_type,
                                                                 self.max_frame_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._get_session().post(
                        self.base_url + path, data=encode(message), headers=self._headers,
                        timeout=ClientTimeout(total=None)) as response:
                    body = await response.content.read(self.max_frame_bytes + 1)
                    try:
                        answer = decoder.decode(body)
                    except ProtocolError as exc:
                        raise ControlError(f"HTTP {response.status} with an undecodable body: "
                                           f"{exc}", response.status) from exc
                    if isinstance(answer, ErrorFrame):
                        raise RemoteError(answer, response.status)
                    return answer
        except TimeoutError as exc:
            raise FrameDeadlineError(f"{path}: no answer within {timeout_s} s") from exc
        except aiohttp.ClientError as exc:  # refused, reset, cut mid-body: the peer is gone
            raise ControlError(f"{path}: {type(exc).__name__}: {exc}") from exc

    async def stream(self, path: str, message: Message, frame_type: object,
                     first_frame_timeout_s: float, frame_timeout_s: float
                     ) -> AsyncGenerator[Message, None]:
        """POST one message and yield the frames of the answer until the worker ends it.

        `frame_type` is a message type or a union of them (ErrorFrames always raise
        RemoteError). Wrap in contextlib.aclosing() when leaving the loop early: closing
        the generator drops the connection, which the worker sees as an abort.
        """
        batches: FrameStream[Message] = self.open_stream(
            path, message, self._frames(frame_type), first_frame_timeout_s, frame_timeout_s)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for frame in batch:
                    yield frame

    def open_stream(self, path: str, message: Message, frames: FrameBatchDecoder[F],
                    first_frame_timeout_s: float, frame_timeout_s: float) -> FrameStream[F]:
        """The answer's frames in batches (read lazily: nothing is sent before the first
        `anext`); `aclose()` before the end aborts the request on the worker."""
        return FrameStream(self, path, message, frames, first_frame_timeout_s, frame_timeout_s)

    def _frames(self, frame_type: object) -> FrameBatchDecoder[Message]:
        frames = self._frame_decoders.get(frame_type)
        if frames is None:
            frames = self._frame_decoders[frame_type] = FrameBatchDecoder(
                frame_type, self.max_frame_bytes)
        return frames

    def check_invariants(self) -> None:
        if self._closed:
            assert self._session is None, "a closed control client still holds its session"


class FrameStream(Generic[F]):
    """One stream answer's frames in batches, over the worker's channel where it has one,
    else over HTTP. Opened by the first `anext` (so a connect error surfaces there, as a
    refused POST does); `listen` takes effect on a channel only (it returns False on HTTP,
    where every frame is pulled)."""

    def __init__(self, client: ControlClient, path: str, message: Message,
                 frames: FrameBatchDecoder[F], first_frame_timeout_s: float,
                 frame_timeout_s: float) -> None:
        self._client = client
        self._path = path
        self._message = message
        self._frames = frames
        self._first_frame_timeout_s = first_frame_timeout_s
        self._frame_timeout_s = frame_timeout_s
        self._inner: ChannelStream[F] | AsyncGenerator[list[F], None] | None = None
        self._listener: Callable[[F], bool] | None = None
        self._closed = False

    def listen(self, listener: Callable[[F], bool] | None) -> bool:
        self._listener = listener
        inner = self._inner
        if isinstance(inner, ChannelStream):
            return inner.listen(listener)
        return inner is None and self._client.channels is not None

    def __aiter__(self) -> FrameStream[F]:
        return self

    async def __anext__(self) -> list[F]:
        inner = self._inner
        if inner is None:
            inner = self._inner = await self._open()
        return await inner.__anext__()

    async def _open(self) -> ChannelStream[F] | AsyncGenerator[list[F], None]:
        if self._closed:
            raise StopAsyncIteration
        client, timeout_s = self._client, self._first_frame_timeout_s
        channels = client.channels
        if channels is not None:
            channel = channels.ready(client.base_url)  # the usual case: no wait
            if channel is None:
                try:
                    async with asyncio.timeout(timeout_s):
                        channel = await channels.get(client.base_url)
                except TimeoutError as exc:
                    raise FrameDeadlineError(f"{client.base_url}: no channel within "
                                             f"{timeout_s} s") from exc
            if channel is not None:
                stream = channel.open(self._message, self._frames, timeout_s,
                                      self._frame_timeout_s)
                stream.listen(self._listener)
                return stream
        return stream_frame_batches(client._get_session(), client.base_url + self._path,
                                    self._message, self._frames, timeout_s,
                                    self._frame_timeout_s, client._token)

    async def aclose(self) -> None:
        self._closed = True
        if self._inner is not None:
            await self._inner.aclose()
