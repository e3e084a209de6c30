"""One request's answer on a worker channel (rpc/channel_client.py has the channel).

A stream's frames are decoded in the connection's read callback. A consumer pulls them in
batches (`async for batch in stream`), or registers a listener (`listen`) that is offered
each frame as it is read, while nothing is waiting to be pulled; a frame the listener
takes is never pulled, one it refuses is queued for the consumer, and so is every later
one until the queue is empty again: frames reach the one or the other exactly once, in
wire order. This is how a token reaches a client without waking a task
(gateway/api/stream_writer.py).

Errors: an ErrorFrame raises RemoteError after the frames before it were pulled; a failed
stream raises what failed it (ControlError for a lost channel); no frame within the
stream's timeout FrameDeadlineError. Deadlines: the first frame within its first timeout
of the open, each later one within its frame timeout of the one before (one timer per
stream, moved only when it fires early).

Lifecycle: open → frames ... → ended (its end frame), failed or closed: done, and dropped
from its channel exactly once (`StreamHost.drop`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from protocol.messages import ErrorFrame, Message, ProtocolError
from rpc.errors import ControlError, FrameDeadlineError, RemoteError
from rpc.frames import FrameDecoder

F = TypeVar("F", bound=Message)


class StreamHost(Protocol):
    """What a stream needs of its channel."""

    loop: asyncio.AbstractEventLoop

    def drop(self, stream_id: int, cancel: bool) -> None:
        """The stream is done here; `cancel`: tell the worker to drop it too."""
        ...


class ChannelStream(Generic[F]):
    """One request's answer on a channel (see the module docstring)."""

    __slots__ = ("_channel", "stream_id", "_decoder", "_what", "_loop", "_pending", "_waiter",
                 "_done", "_error", "_listener", "_last_frame_s", "_timeout_s",
                 "_frame_timeout_s", "_timer")

    def __init__(self, channel: StreamHost, stream_id: int, decoder: FrameDecoder[F],
                 first_frame_timeout_s: float, frame_timeout_s: float, what: str) -> None:
        self._channel = channel
        self.stream_id = stream_id
        self._decoder = decoder
        self._what = what
        self._loop = channel.loop
        self._pending: list[F | ErrorFrame] = []
        self._waiter: asyncio.Future[None] | None = None
        self._done = False  # ended, failed or closed: nothing more arrives
        self._error: BaseException | None = None
        self._listener: Callable[[F], bool] | None = None
        self._last_frame_s = self._loop.time()
        self._timeout_s = first_frame_timeout_s
        self._frame_timeout_s = frame_timeout_s
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(
            self._last_frame_s + first_frame_timeout_s, self._check_deadline)

    def listen(self, listener: Callable[[F], bool] | None) -> bool:
        """Offer each frame to `listener` as it is read (None: stop); True: supported."""
        self._listener = listener
        return True

    # ---------------------------------------------------------------- the channel's side

    def on_body(self, body: bytes | memoryview, now: float) -> None:
        try:
            item = self._decoder.decode(body)
        except ProtocolError as exc:
            self.fail(ControlError(f"{self._what}: undecodable frame: {exc}"))
            return
        self._last_frame_s = now
        if self._timeout_s != self._frame_timeout_s:  # the first frame: later ones' timeout
            self._timeout_s = self._frame_timeout_s
            if self._timer is not None and now + self._timeout_s < self._timer.when():
                self._timer.cancel()
                self._timer = self._loop.call_at(now + self._timeout_s, self._check_deadline)
        listener = self._listener
        if listener is not None and not self._pending and type(item) is not ErrorFrame \
                and listener(item):  # type: ignore[arg-type]
            return
        self._pending.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_end(self) -> None:
        self._finish(None, cancel=False)

    def fail(self, error: BaseException) -> None:
        self._finish(error, cancel=True)

    def _finish(self, error: BaseException | None, cancel: bool) -> None:
        if self._done:
            return
        self._done, self._error, self._listener = True, error, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._channel.drop(self.stream_id, cancel)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check_deadline(self) -> None:
        self._timer = None
        if self._done:
            return
        deadline = self._last_frame_s + self._timeout_s
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check_deadline)
            return
        self.fail(FrameDeadlineError(
            f"{self._what}: no frame within {self._timeout_s:g} s (stream stalled)"))

    # ---------------------------------------------------------------- the consumer's side

    def __aiter__(self) -> ChannelStream[F]:
        return self

    async def __anext__(self) -> list[F]:
        while True:
            pending = self._pending
            if pending:
                for i, item in enumerate(pending):
                    if type(item) is ErrorFrame:
                        break
                else:
                    self._pending = []
                    return pending  # type: ignore[return-value]
                if i:
                    self._pending = pending[i:]
                    return pending[:i]  # type: ignore[return-value]
                self._pending = []
                self._finish(None, cancel=False)
                assert isinstance(item, ErrorFrame)
                raise RemoteError(item)
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def aclose(self) -> None:
        """Stop reading; before the end, the worker is told to drop the stream."""
        self._pending = []
        self._finish(None, cancel=True)

    @property
    def is_done(self) -> bool:
        return self._done
