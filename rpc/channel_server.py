"""The worker's end of channels: many requests over one connection, on the control port
itself (rpc/channel_wire.py has the wire, channel_client.py the caller's end).

    connection ──▶ PortSniffer: first bytes MAGIC? ──yes──▶ ServerChannel
                                                   └─no──▶ aiohttp (probes and /admin)
                   (rpc/channel_site.py)

A ServerChannel runs the handlers the app registered with `control_server.add_call` /
`add_stream`, one task per stream, and writes their frames; a stream's producer may also
send frames through its stream's `StreamFrameWriter` from a callback, while its task waits
(a decode step's tokens: worker/stream_frames.py). Frames written in one turn of the event
loop leave in one socket write (a decode step's tokens for many requests).

Security: the greeting (rpc/channel_wire.py) is a challenge both ways over the cluster's
channel key: this worker proves it holds the token and serves the endpoint the caller
dialled, then the caller proves it; a server with a token refuses a wrong or missing proof
(ErrorFrame UNAUTHORIZED, then close), as the HTTP API answers 401. No handler runs and no
frame but the greeting's is read before that. A frame over `max_body_bytes` closes the
channel (TOO_LARGE first).

Deadlines: the greeting, and every frame once its first bytes came, must arrive whole within
`body_timeout_s`, else the channel is closed; a gateway that takes none of our bytes for
`write_timeout_s` while they pile up past the transport's high-water mark has its channel
closed. Closing cancels every stream, and a cancelled stream's producer is closed (its
`finally` aborts the request and frees its blocks), as when an HTTP client hangs up.

Lifecycle of a stream: opened by a request frame → task running (a call: one answer; a
stream: a frame per message produced) → its end frame; or cancelled (the gateway's empty
frame, or the channel closed) → its producer closed → gone.

Invariants (`ServerChannel.check_invariants`): a stream's task is in `tasks` exactly
while it runs; a stream answer is in the app's `open_streams` exactly while its producer
runs, and the producer is closed exactly once; nothing is written after the close; a
watcher of the channel's loss runs at most once, and none is held after the close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import cast

from protocol.messages import (ErrorCode, ErrorFrame, Message, MessageDecoder, ProtocolError,
                               ProtocolVersionError, encode)
from rpc.channel_greeting import WorkerGreeting
from rpc.channel_wire import (CONNECTION_STREAM_ID, END, MAGIC, ChannelHello, ChannelProof,
                              ChannelWelcome, FrameSplitter, FrameTooLarge, end_frame, frame)
from rpc.control_app import CALLER, ChannelRoutes, ControlLimits, RequestRejected, name_request

log = logging.getLogger(__name__)

MAX_STREAMS_PER_CHANNEL = 1 << 16


class ChannelClosed(ConnectionError):
    """The channel went away while a stream was writing."""


class ServerChannel(asyncio.Protocol):
    """One gateway's channel into this worker (see the module docstring)."""

    def __init__(self, routes: ChannelRoutes, limits: ControlLimits, key: bytes | None,
                 served_endpoint: str, on_lost: Callable[[ServerChannel], None]) -> None:
        """`key`: the cluster's channel key (None: no token, nothing proved);
        `served_endpoint`: host:port of the control URL this worker registered."""
        self._routes = routes
        self._limits = limits
        self._greeter = WorkerGreeting(key, served_endpoint)
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._splitter = FrameSplitter(limits.max_body_bytes)
        self._greeting: MessageDecoder[ChannelHello | ChannelProof] = MessageDecoder(
            ChannelHello | ChannelProof, 1 << 16)
        self._transport: asyncio.Transport | None = None
        self._magic_seen = False
        self._greeted = False
        self._closing = False  # close() was called
        self._closed = False  # the connection is gone
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self._out: list[bytes] = []
        self._flush_handle: asyncio.Handle | None = None
        self._paused = False
        self._resumed: asyncio.Future[None] | None = None
        # Armed while a greeting or a frame is incomplete: it must arrive whole in time.
        self._incomplete: asyncio.TimerHandle | None = None
        # What handlers asked to hear of this channel's loss (control_app.on_caller_lost).
        self._lost_watchers: dict[int, Callable[[], None]] = {}
        self._next_watcher = 0

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self._transport = cast(asyncio.Transport, transport)
        self._incomplete = self._loop.call_later(self._limits.body_timeout_s, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if not self._magic_seen:  # the sniffer hands over the first bytes, magic included
            self._magic_seen = True
            data = data[len(MAGIC):]
        if self._closing:
            return
        try:
            frames = self._splitter.feed(data)
        except FrameTooLarge as exc:
            self._refuse(CONNECTION_STREAM_ID, ErrorCode.TOO_LARGE, str(exc))
            self.close()
            return
        for stream_id, body in frames:
            if not self._greeted:
                self._greet(stream_id, body)
            elif stream_id == CONNECTION_STREAM_ID or (body and stream_id in self.tasks):
                log.warning("channel: protocol violation (stream %d); closing", stream_id)
                self.close()
            elif not body:
                task = self.tasks.get(stream_id)
                if task is not None:
                    task.cancel()  # the gateway dropped the stream: abort it
            else:
                self._open(stream_id, body)
            if self._closing:
                return
        if self._greeted:
            self._watch_incomplete()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        for handle in (self._incomplete, self._flush_handle):
            if handle is not None:
                handle.cancel()
        self._out.clear()
        for task in self.tasks.values():
            task.cancel()
        watchers, self._lost_watchers = self._lost_watchers, {}
        for callback in watchers.values():
            self._loop.call_soon(callback)
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_exception(ChannelClosed("the channel closed"))
            self._resumed.exception()  # retrieved: a writer may not be waiting
        self._on_lost(self)

    def close(self) -> None:
        """Close the channel: every stream is cancelled (its producer closed)."""
        self._closing = True
        if self._transport is not None and not self._transport.is_closing():
            self._flush()
            self._transport.close()

    # ---------------------------------------------------------------- requests

    def _greet(self, stream_id: int, body: bytes | memoryview) -> None:
        """One frame of the greeting: the hello (answered with this side's challenge and
        proof), then the caller's proof (answered with the welcome, or refused)."""
        try:
            if stream_id != CONNECTION_STREAM_ID:
                raise ProtocolError("the channel must open with a greeting")
            message = self._greeting.decode(body)
            if isinstance(message, ChannelHello) == self._greeter.challenged:
                raise ProtocolError(f"{type(message).__name__} out of the greeting's order")
        except ProtocolError as exc:
            self._refuse(CONNECTION_STREAM_ID, ErrorCode.BAD_REQUEST, str(exc))
            self.close()
            return
        if isinstance(message, ChannelHello):
            self._send(CONNECTION_STREAM_ID, self._greeter.challenge(message))
            return
        if not self._greeter.admits(message):
            self._refuse(CONNECTION_STREAM_ID, ErrorCode.UNAUTHORIZED,
                         "missing or wrong proof of the internal token")
            self.close()
            return
        self._greeted = True
        if self._incomplete is not None:
            self._incomplete.cancel()
            self._incomplete = None
        self._send(CONNECTION_STREAM_ID,
                   encode(ChannelWelcome(max_frame_bytes=self._limits.max_body_bytes)))

    def _open(self, stream_id: int, body: bytes | memoryview) -> None:
        try:
            message = self._routes.decoder.decode(body)
        except ProtocolVersionError as exc:
            self._refuse(stream_id, ErrorCode.PROTOCOL_VERSION, str(exc))
            return
        except ProtocolError as exc:
            self._refuse(stream_id, ErrorCode.BAD_REQUEST, str(exc))
            return
        if len(self.tasks) >= MAX_STREAMS_PER_CHANNEL:
            self._refuse(stream_id, ErrorCode.OVERLOADED,
                         f"more than {MAX_STREAMS_PER_CHANNEL} streams on one channel")
            return
        task = self._loop.create_task(self._serve(stream_id, message))
        self.tasks[stream_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(stream_id, None))

    def watch_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """control_app.Caller's: `callback` runs once when this channel closes."""
        if self._closed:
            self._loop.call_soon(callback)
            return lambda: None
        key, self._next_watcher = self._next_watcher, self._next_watcher + 1
        self._lost_watchers[key] = callback

        def forget() -> None:
            self._lost_watchers.pop(key, None)

        return forget

    async def _serve(self, stream_id: int, message: Message) -> None:
        name_request(message)  # this task's log lines carry the request's ids
        CALLER.set(self)  # this task's own context: its handler's on_caller_lost
        try:
            call = self._routes.calls.get(type(message))
            if call is not None:
                self._send(stream_id, encode(await call(message)))
            else:
                produce = self._routes.streams[type(message)]
                out = StreamFrameWriter(self, stream_id)
                await self._stream(stream_id, produce(message, out))
            self._send(stream_id, END)
        except RequestRejected as exc:
            self._send(stream_id, encode(exc.frame))
            self._send(stream_id, END)
        except ChannelClosed:
            pass  # nobody is left to tell
        except Exception as exc:
            log.exception("channel: %s failed", type(message).__name__)
            self._refuse(stream_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _stream(self, stream_id: int, frames: AsyncGenerator[Message, None]) -> None:
        open_streams = self._limits.open_streams
        key = id(frames)
        open_streams.add(key)
        try:
            async for item in frames:
                self._send(stream_id, encode(item))
                if self._paused:
                    await self._wait_resumed()
        finally:
            open_streams.discard(key)
            await frames.aclose()

    # ---------------------------------------------------------------- writing

    def send_direct(self, stream_id: int, message: Message) -> bool:
        """A StreamFrameWriter's send: `message` on a running, uncancelled stream while the
        channel takes data; False otherwise (the producer's own path then carries it)."""
        task = self.tasks.get(stream_id)
        if self._closed or self._closing or self._paused or task is None or task.cancelling():
            return False
        self._send(stream_id, encode(message))
        return True

    def _send(self, stream_id: int, body: bytes) -> None:
        """Queued for this turn's one write. Raises ChannelClosed once the channel is gone."""
        if self._closed:
            raise ChannelClosed("the channel closed")
        self._out.append(frame(stream_id, body) if body else end_frame(stream_id))
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        out = self._out
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    async def _wait_resumed(self) -> None:
        if self._resumed is None:
            self._resumed = self._loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._resumed), self._limits.write_timeout_s)
        except TimeoutError:
            log.warning("channel: the gateway took no data for %.0f s; closing it",
                        self._limits.write_timeout_s)
            if self._transport is not None:
                self._transport.abort()
            raise ChannelClosed("the gateway stopped reading") from None

    def _refuse(self, stream_id: int, code: ErrorCode, message: str) -> None:
        if self._closed:
            return
        self._send(stream_id, encode(ErrorFrame(code=code, message=message)))
        if stream_id != CONNECTION_STREAM_ID:
            self._send(stream_id, END)

    # ---------------------------------------------------------------- deadlines

    def _watch_incomplete(self) -> None:
        if self._splitter.has_partial_frame:
            if self._incomplete is None:
                self._incomplete = self._loop.call_later(self._limits.body_timeout_s,
                                                         self._too_slow)
        elif self._incomplete is not None:
            self._incomplete.cancel()
            self._incomplete = None

    def _too_slow(self) -> None:
        self._incomplete = None
        log.warning("channel: a %s did not arrive whole within %.0f s; closing it",
                    "frame" if self._greeted else "greeting", self._limits.body_timeout_s)
        if self._transport is not None:
            self._transport.abort()

    def check_invariants(self) -> None:
        for stream_id, task in self.tasks.items():
            assert not task.done(), f"stream {stream_id}'s finished task is still listed"
        if self._closed:
            assert not self._out, "bytes queued after the channel closed"
            assert not self._lost_watchers, "a loss watcher outlived the channel's close"


class StreamFrameWriter:
    """One channel stream's FrameWriter (rpc/control_app.py)."""

    __slots__ = ("_channel", "_stream_id")

    def __init__(self, channel: ServerChannel, stream_id: int) -> None:
        self._channel, self._stream_id = channel, stream_id

    def send(self, frame: Message) -> bool:
        return self._channel.send_direct(self._stream_id, frame)
