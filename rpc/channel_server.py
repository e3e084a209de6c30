"""The worker's end of channels: many requests over one connection, on the control port
itself (rpc/channel_wire.py has the wire, channel_client.py the caller's end).

    connection ──▶ PortSniffer: first bytes MAGIC? ──yes──▶ ServerChannel
                                                   └─no──▶ aiohttp (probes and /admin)

A ServerChannel runs the handlers the app registered with `control_server.add_call` /
`add_stream`, one task per stream, and writes their frames; a stream's producer may also
send frames through its stream's `StreamFrameWriter` from a callback, while its task waits
(a decode step's tokens: worker/stream_frames.py). Frames written in one turn of the event
loop leave in one socket write (a decode step's tokens for many requests).

Security: the greeting carries the internal token; a server with a token refuses a wrong
or missing one (ErrorFrame UNAUTHORIZED, then close), as the HTTP API answers 401.
A frame over `max_body_bytes` closes the channel (TOO_LARGE first).

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
runs, and the producer is closed exactly once; nothing is written after the close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import cast

from aiohttp import web

from protocol.messages import (ErrorCode, ErrorFrame, Message, MessageDecoder, ProtocolError,
                               ProtocolVersionError, encode)
from rpc.channel_wire import (CONNECTION_STREAM_ID, END, MAGIC, ChannelHello, ChannelWelcome,
                              FrameSplitter, FrameTooLarge, end_frame, frame)
from rpc.control_app import (ChannelRoutes, ControlLimits, RequestRejected, name_request,
                             token_matches)

log = logging.getLogger(__name__)

MAX_STREAMS_PER_CHANNEL = 1 << 16


class ChannelClosed(ConnectionError):
    """The channel went away while a stream was writing."""


class ServerChannel(asyncio.Protocol):
    """One gateway's channel into this worker (see the module docstring)."""

    def __init__(self, routes: ChannelRoutes, limits: ControlLimits, token: str | None,
                 on_lost: Callable[[ServerChannel], None]) -> None:
        self._routes = routes
        self._limits = limits
        self._token = token
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._splitter = FrameSplitter(limits.max_body_bytes)
        self._hello: MessageDecoder[ChannelHello] = MessageDecoder(ChannelHello, 1 << 16)
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
        try:
            if stream_id != CONNECTION_STREAM_ID:
                raise ProtocolError("the channel must open with a greeting")
            hello = self._hello.decode(body)
        except ProtocolError as exc:
            self._refuse(CONNECTION_STREAM_ID, ErrorCode.BAD_REQUEST, str(exc))
            self.close()
            return
        if self._token and not token_matches(hello.token, self._token):
            self._refuse(CONNECTION_STREAM_ID, ErrorCode.UNAUTHORIZED,
                         "missing or wrong internal token")
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

    async def _serve(self, stream_id: int, message: Message) -> None:
        name_request(message)  # this task's log lines carry the request's ids
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


class StreamFrameWriter:
    """One channel stream's FrameWriter (rpc/control_app.py)."""

    __slots__ = ("_channel", "_stream_id")

    def __init__(self, channel: ServerChannel, stream_id: int) -> None:
        self._channel, self._stream_id = channel, stream_id

    def send(self, frame: Message) -> bool:
        return self._channel.send_direct(self._stream_id, frame)


class PortSniffer(asyncio.Protocol):
    """Tells a channel from an HTTP connection by its first bytes, then hands it over."""

    def __init__(self, http: Callable[[], asyncio.Protocol],
                 channel: Callable[[], asyncio.Protocol], first_bytes_timeout_s: float) -> None:
        self._http = http
        self._channel = channel
        self._timeout_s = first_bytes_timeout_s
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self._transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s,
                                                            self._transport.abort)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        if len(buffer) < len(MAGIC) and MAGIC.startswith(buffer):
            self._buffer = buffer  # "P" may still be "POST"
            return
        assert self._transport is not None
        if self._timer is not None:
            self._timer.cancel()
        protocol = self._channel() if buffer.startswith(MAGIC) else self._http()
        self._transport.set_protocol(protocol)
        protocol.connection_made(self._transport)
        protocol.data_received(buffer)

    def eof_received(self) -> bool:
        return False  # closes the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class ChannelSite(web.BaseSite):
    """A TCP site serving the runner's HTTP app and channels on one port."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, routes: ChannelRoutes,
                 limits: ControlLimits, token: str | None) -> None:
        super().__init__(runner)
        self._host, self._port = host, port
        self._routes, self._limits, self._token = routes, limits, token
        self.channels: set[ServerChannel] = set()
        self.bound_port: int | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.bound_port or self._port}"

    async def start(self) -> None:
        await super().start()
        http = self._runner.server
        assert http is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: PortSniffer(http, self._new_channel, self._limits.body_timeout_s),
            self._host, self._port)
        self.bound_port = self._server.sockets[0].getsockname()[1]

    def _new_channel(self) -> ServerChannel:
        channel = ServerChannel(self._routes, self._limits, self._token, self.channels.discard)
        self.channels.add(channel)
        return channel

    async def close_channels(self, timeout_s: float) -> None:
        """Close every channel and wait (bounded) for its streams' producers to close."""
        tasks = [task for channel in self.channels for task in channel.tasks.values()]
        for channel in list(self.channels):
            channel.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
