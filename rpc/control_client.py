"""One worker's control API as typed calls, over the worker's channel.

    call(message, response type, timeout)          one message, one answer back
    open_stream(message, frames, timeouts)         one message, its answer's frames in batches
    stream(message, frame type, timeouts)          the same, frame by frame

Every call and stream travels on the worker's channel (one persistent connection per
worker, shared by every caller of the pool: rpc/channel_client.py), dispatched on the worker
by the message's type. Errors: an ErrorFrame answer raises `RemoteError`; a refused
connection, a lost channel or an undecodable answer raise `ControlError`; a missed deadline
raises `FrameDeadlineError` (rpc/errors.py).

Deadlines: `call` has one overall deadline (the channel's connect included); a stream one
for the channel and its first frame, and one per later frame, so a stalled worker is
noticed within frame_timeout_s and the request can fail cleanly instead of hanging.

A client holds nothing but its URL and the pool: the pool owns the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from protocol.messages import Message
from rpc.channel_client import ChannelPool
from rpc.channel_stream import ChannelStream
from rpc.errors import ControlError, FrameDeadlineError
from rpc.frames import FrameDecoder

R = TypeVar("R", bound=Message)
F = TypeVar("F", bound=Message)


class FrameBatches(Protocol[F]):
    """Batches of a stream answer's frames: `FrameStream`, or any async generator of them."""

    def __aiter__(self) -> AsyncIterator[list[F]]: ...

    def __anext__(self) -> Awaitable[list[F]]: ...

    async def aclose(self) -> None: ...


class ControlClient:
    """Calls one worker's control API through `channels`."""

    def __init__(self, base_url: str, channels: ChannelPool) -> None:
        self.base_url = base_url.rstrip("/")
        self.channels = channels
        self._frame_decoders: dict[object, FrameDecoder[Message]] = {}

    async def call(self, message: Message, response_type: type[R], timeout_s: float) -> R:
        """Send one message, return the decoded answer; an ErrorFrame raises RemoteError."""
        what = type(message).__name__
        try:
            async with asyncio.timeout(timeout_s):
                channel = await self.channels.get(self.base_url)
                answers: list[Message] = []
                stream = channel.open(message, self._frames(response_type), timeout_s, timeout_s)
                async with contextlib.aclosing(stream):  # early exit: the worker drops it
                    async for batch in stream:
                        answers += batch
        except TimeoutError as exc:
            raise FrameDeadlineError(f"{self.base_url}: no answer to {what} within "
                                     f"{timeout_s} s") from exc
        if len(answers) != 1 or not isinstance(answers[0], response_type):
            raise ControlError(f"{self.base_url}: {len(answers)} answers to one {what}")
        return answers[0]

    async def stream(self, message: Message, frame_type: object, first_frame_timeout_s: float,
                     frame_timeout_s: float) -> AsyncGenerator[Message, None]:
        """Send one message and yield the frames of the answer until the worker ends it.

        `frame_type` is a message type or a union of them (ErrorFrames always raise
        RemoteError). Wrap in contextlib.aclosing() when leaving the loop early: closing
        the generator tells the worker to drop the stream, which it treats as an abort.
        """
        batches: FrameStream[Message] = self.open_stream(
            message, self._frames(frame_type), first_frame_timeout_s, frame_timeout_s)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for frame in batch:
                    yield frame

    def open_stream(self, message: Message, frames: FrameDecoder[F],
                    first_frame_timeout_s: float, frame_timeout_s: float) -> FrameStream[F]:
        """The answer's frames in batches (read lazily: nothing is sent before the first
        `anext`); `aclose()` before the end aborts the request on the worker."""
        return FrameStream(self, message, frames, first_frame_timeout_s, frame_timeout_s)

    def _frames(self, frame_type: object) -> FrameDecoder[Message]:
        frames = self._frame_decoders.get(frame_type)
        if frames is None:
            frames = self._frame_decoders[frame_type] = FrameDecoder(
                frame_type, self.channels.max_frame_bytes)
        return frames


class FrameStream(Generic[F]):
    """One stream answer's frames in batches. Opened by the first `anext` (so a connect
    error surfaces there); `listen` offers each frame to a callback as it is read, while
    nothing waits to be pulled (rpc/channel_client.py's `ChannelStream.listen`)."""

    def __init__(self, client: ControlClient, message: Message, frames: FrameDecoder[F],
                 first_frame_timeout_s: float, frame_timeout_s: float) -> None:
        self._client = client
        self._message = message
        self._frames = frames
        self._first_frame_timeout_s = first_frame_timeout_s
        self._frame_timeout_s = frame_timeout_s
        self._inner: ChannelStream[F] | None = None
        self._listener: Callable[[F], bool] | None = None
        self._closed = False

    def listen(self, listener: Callable[[F], bool] | None) -> None:
        self._listener = listener
        if self._inner is not None:
            self._inner.listen(listener)

    def __aiter__(self) -> FrameStream[F]:
        return self

    async def __anext__(self) -> list[F]:
        inner = self._inner
        if inner is None:
            inner = self._inner = await self._open()
        return await inner.__anext__()

    async def _open(self) -> ChannelStream[F]:
        if self._closed:
            raise StopAsyncIteration
        client, timeout_s = self._client, self._first_frame_timeout_s
        channel = client.channels.ready(client.base_url)  # the usual case: no wait
        if channel is None:
            try:
                async with asyncio.timeout(timeout_s):
                    channel = await client.channels.get(client.base_url)
            except TimeoutError as exc:
                raise FrameDeadlineError(f"{client.base_url}: no channel within "
                                         f"{timeout_s} s") from exc
        stream = channel.open(self._message, self._frames, timeout_s, self._frame_timeout_s)
        stream.listen(self._listener)
        return stream

    async def aclose(self) -> None:
        self._closed = True
        if self._inner is not None:
            await self._inner.aclose()
