"""The caller's end of worker channels: one persistent connection per worker, many
requests on it (rpc/channel_wire.py has the wire, channel_server.py the worker's end). The
gateway and the operations agent reach workers only this way.

    ChannelPool.get(url) ─▶ Channel (connected and greeted once, again after a loss)
    Channel.open(message) ─▶ ChannelStream: the answer's frames, in batches

A stream's frames are decoded in the connection's read callback and pulled in batches, or
offered to a listener (rpc/channel_stream.py).

Trust: nothing but the greeting is sent (never a request; the token never travels) until
the worker proved it holds the cluster's token and serves the address dialled
(rpc/channel_greeting.py); one that does not raises PeerUnverifiedError.

Errors: an ErrorFrame raises RemoteError after the
frames before it were pulled; a lost connection ControlError (for every stream on it); no
frame within the stream's timeout FrameDeadlineError. `aclose()` before the end tells the
worker to drop the stream (it aborts the request). A request larger than the worker takes
(its welcome's `max_frame_bytes`) is refused by `open` with RemoteError TOO_LARGE and never
sent: the worker would close the whole channel on it, failing every other stream there.

Deadlines: connecting and the greeting within `connect_timeout_s`; each stream's first
frame within its first timeout of the open, each later one within its frame timeout of
the one before (one timer per stream, moved only when it fires early).

Invariants (`Channel.check_invariants`): a stream is in its channel's table exactly while
it is neither ended, failed nor closed; a closed channel holds no stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar, cast
from urllib.parse import urlsplit

from protocol.cluster_secret import KeyPurpose, derive_optional_key
from protocol.messages import (MAX_MESSAGE_BYTES, ErrorCode, ErrorFrame, Message, MessageDecoder,
                               ProtocolError, encode)
from rpc.channel_greeting import CallerGreeting
from rpc.channel_stream import ChannelStream
from rpc.channel_wire import (CONNECTION_STREAM_ID, MAGIC, MAX_STREAM_ID, ChannelChallenge,
                              ChannelWelcome, FrameSplitter, FrameTooLarge, end_frame, endpoint,
                              frame)
from rpc.errors import ControlError, FrameDeadlineError, PeerUnverifiedError, RemoteError
from rpc.frames import FrameDecoder

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Message)


class Channel(asyncio.Protocol):
    """One connection to one worker's control port, carrying many streams."""

    def __init__(self, what: str, max_frame_bytes: int, greeting: CallerGreeting) -> None:
        self.loop = asyncio.get_running_loop()
        self.what = what
        self.closed = False
        self._splitter = FrameSplitter(max_frame_bytes)
        self._greeting: MessageDecoder[ChannelChallenge | ChannelWelcome | ErrorFrame] = \
            MessageDecoder(ChannelChallenge | ChannelWelcome | ErrorFrame, 1 << 16)
        self._greeter = greeting
        self._welcome: asyncio.Future[ChannelWelcome] = self.loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, ChannelStream[Message]] = {}
        self._next_id = 1
        self.peer_max_frame_bytes: int | None = None  # the worker's, from its welcome

    @classmethod
    async def connect(cls, url: str, token: str | None, timeout_s: float,
                      max_frame_bytes: int = MAX_MESSAGE_BYTES) -> Channel:
        """A greeted channel to the control server at `url` (http://host:port), whose
        worker proved it holds `token` (None: no token, nothing proved either way)."""
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ControlError(f"not a control URL with a host and port: {url!r}")
        greeting = CallerGreeting(derive_optional_key(token, KeyPurpose.CHANNEL),
                                  endpoint(parts.hostname, parts.port))
        loop = asyncio.get_running_loop()
        channel: Channel | None = None
        try:
            async with asyncio.timeout(timeout_s):
                _, channel = await loop.create_connection(
                    lambda: cls(url, max_frame_bytes, greeting), parts.hostname, parts.port)
                assert channel._transport is not None
                channel._transport.write(MAGIC + frame(CONNECTION_STREAM_ID, greeting.hello()))
                await channel._welcome
        except TimeoutError as exc:
            if channel is not None:
                channel.close()
            raise FrameDeadlineError(f"{url}: no channel within {timeout_s:g} s") from exc
        except OSError as exc:
            raise ControlError(f"{url}: {type(exc).__name__}: {exc}") from exc
        except ControlError:
            if channel is not None:
                channel.close()
            raise
        return channel

    def open(self, message: Message, decoder: FrameDecoder[F], first_frame_timeout_s: float,
             frame_timeout_s: float) -> ChannelStream[F]:
        """Send `message` as a new stream; its answer comes as the stream's frames. Raises
        ControlError on a closed channel, RemoteError TOO_LARGE (nothing sent) for a message
        over the worker's frame limit."""
        if self.closed or self._transport is None or self._transport.is_closing():
            raise ControlError(f"{self.what}: the channel is closed")
        body = encode(message)
        limit = self.peer_max_frame_bytes
        if limit is not None and len(body) > limit:
            # As the worker would answer it, but for this request alone: a frame over its
            # limit makes the worker close the channel, and every stream on it with it.
            request_id = getattr(message, "request_id", None)
            raise RemoteError(ErrorFrame(
                request_id=request_id if isinstance(request_id, str) else None,
                code=ErrorCode.TOO_LARGE, message=f"{type(message).__name__} of {len(body)} "
                f"bytes exceeds the worker's limit of {limit}"))
        stream_id = self._next_id
        if stream_id > MAX_STREAM_ID:
            self.close()  # numbers are never reused: the next request opens a new channel
            raise ControlError(f"{self.what}: the channel ran out of stream ids")
        self._next_id = stream_id + 1
        stream: ChannelStream[F] = ChannelStream(self, stream_id, decoder,
                                                 first_frame_timeout_s, frame_timeout_s,
                                                 self.what)
        self._streams[stream_id] = stream  # type: ignore[assignment]
        self._transport.write(frame(stream_id, body))
        return stream

    def drop(self, stream_id: int, cancel: bool) -> None:
        """The stream is done here; `cancel`: tell the worker to drop it too."""
        if self._streams.pop(stream_id, None) is not None and cancel and not self.closed \
                and self._transport is not None and not self._transport.is_closing():
            self._transport.write(end_frame(stream_id))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._welcome.done() and not self._splitter.has_partial_frame \
                and data.startswith(b"HTTP/"):
            # An HTTP server (not a worker's control port) answered the greeting.
            self._lost(ControlError(f"{self.what}: not a worker's control port (it answered "
                                    f"the channel's greeting with HTTP)"))
            return
        try:
            frames = self._splitter.feed(data)
        except FrameTooLarge as exc:
            self._lost(ControlError(f"{self.what}: {exc}"))
            return
        now = self.loop.time()
        streams = self._streams
        for stream_id, body in frames:
            stream = streams.get(stream_id)
            if stream is not None:
                if body:
                    stream.on_body(body, now)
                else:
                    stream.on_end()
            elif stream_id == CONNECTION_STREAM_ID:
                self._on_greeting(body)
            # else: a stream this side closed already; its late frames are dropped

    def _on_greeting(self, body: bytes | memoryview) -> None:
        if self._welcome.done():
            if body:  # the worker refuses something on the connection itself
                log.warning("%s: the worker closed the channel: %r", self.what, bytes(body)[:200])
            return
        try:
            answer = self._greeting.decode(body)
            if not isinstance(answer, ErrorFrame) and \
                    isinstance(answer, ChannelChallenge) == self._greeter.answered:
                raise ProtocolError(f"{type(answer).__name__} out of the greeting's order")
            # The worker's proof is checked before ours leaves; if wrong, nothing more does.
            proof = self._greeter.answer(answer) if isinstance(answer, ChannelChallenge) \
                else None
        except ProtocolError as exc:
            self._lost(ControlError(f"{self.what}: bad greeting: {exc}"))
            return
        except PeerUnverifiedError as exc:
            self._lost(PeerUnverifiedError(f"{self.what}: {exc}"))
            return
        if isinstance(answer, ErrorFrame):
            self._welcome.set_exception(RemoteError(answer))
        elif proof is not None:
            assert self._transport is not None
            self._transport.write(frame(CONNECTION_STREAM_ID, proof))
        elif isinstance(answer, ChannelWelcome):
            self.peer_max_frame_bytes = answer.max_frame_bytes
            self._welcome.set_result(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(ControlError(f"{self.what}: channel lost"
                                f"{': ' + str(exc) if exc else ' (closed by the worker)'}"))

    def _lost(self, error: ControlError) -> None:
        if not self.closed:
            self.closed = True
            self.close()
        if not self._welcome.done():
            self._welcome.set_exception(error)
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._streams.clear()

    def check_invariants(self) -> None:
        for stream_id, stream in self._streams.items():
            assert not stream.is_done, f"{self.what}: stream {stream_id} is done but listed"
        if self.closed:
            assert not self._streams, f"{self.what}: a closed channel holds streams"


class ChannelPool:
    """One channel per worker control URL: opened on first use, again after a loss.

    Lifecycle: connects are tasks the pool owns (one per URL at a time, shared by every
    caller waiting for it); `aclose()` cancels them and closes every channel.
    """

    def __init__(self, token: str | None, connect_timeout_s: float = 5.0,
                 max_frame_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._channels: dict[str, Channel] = {}
        self._connecting: dict[str, asyncio.Task[Channel]] = {}

    def ready(self, url: str) -> Channel | None:
        """The open channel to `url`, if there is one now (no wait)."""
        channel = self._channels.get(url)
        if channel is not None and channel.closed:
            del self._channels[url]  # lost: the next get() connects again
            return None
        return channel

    async def get(self, url: str) -> Channel:
        """The channel to `url`, connecting when needed. Raises ControlError (refused,
        reset, refused greeting) or FrameDeadlineError (no channel within the pool's
        connect timeout), like any call to a worker."""
        channel = self.ready(url)
        if channel is not None:
            return channel
        task = self._connecting.get(url)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                Channel.connect(url, self.token, self.connect_timeout_s, self.max_frame_bytes))
            self._connecting[url] = task
            task.add_done_callback(lambda done: self._connected(url, done))
        return await asyncio.shield(task)

    def _connected(self, url: str, task: asyncio.Task[Channel]) -> None:
        self._connecting.pop(url, None)
        if task.cancelled():
            return
        if task.exception() is None:  # retrieved here, whoever else waits for it
            self._channels[url] = task.result()

    @property
    def num_channels(self) -> int:
        return sum(not c.closed for c in self._channels.values())

    async def aclose(self) -> None:
        for task in list(self._connecting.values()):
            task.cancel()
        await asyncio.gather(*self._connecting.values(), return_exceptions=True)
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def check_invariants(self) -> None:
        for channel in self._channels.values():
            channel.check_invariants()
