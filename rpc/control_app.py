"""What a worker's control API is: its limits, its routes by message type, and how a
handler refuses a request.

A request reaches a worker over a caller's channel (rpc/channel_server.py: one frame opens
it), dispatched by the message's type to the handler registered with
`control_server.add_call` / `add_stream`; a `RequestRejected` becomes an `ErrorFrame`
answer. A stream's producer also gets the stream's `FrameWriter`: a way to send a frame from
a callback, without waking the producer's task (worker/stream_frames.py uses it for a
decode step's tokens). A handler may ask to hear when its caller's channel closes
(`on_caller_lost`): what a call left behind for a later request of the same caller (a
reservation) need not wait for its own deadline once that caller is gone.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, Union

from aiohttp import web

from protocol.messages import ErrorCode, ErrorFrame, Message, MessageDecoder
from telemetry.log_format import REQUEST_ID, TRACE_ID

DEFAULT_MAX_BODY_BYTES = 16 << 20

CallHandle = Callable[[Message], Awaitable[Message]]


class FrameWriter(Protocol):
    """One stream's way out for frames sent outside its producer's task."""

    def send(self, frame: Message) -> bool:
        """Queues `frame` on the stream now (it leaves with this turn's write); False, and
        nothing sent, while the channel is paused or closed or the stream cancelled. The
        producer keeps the order: it sends here only while it has yielded everything
        before `frame`."""
        ...


# A stream's producer: the request, and the stream's writer (which most producers ignore).
StreamProduce = Callable[[Message, FrameWriter], AsyncGenerator[Message, None]]


@dataclass(slots=True)
class ControlLimits:
    """What one control app accepts; shared by its handlers through the app."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = 10.0
    write_timeout_s: float = 30.0
    open_streams: set[int] = field(default_factory=set)  # ids of running stream answers


@dataclass(slots=True)
class ChannelRoutes:
    """The app's calls and streams by request type, for the channel (which dispatches by
    the message, not by a path). Filled before the server starts; read-only after."""

    calls: dict[type[Message], CallHandle] = field(default_factory=dict)
    streams: dict[type[Message], StreamProduce] = field(default_factory=dict)
    _decoder: MessageDecoder[Message] | None = None

    def add(self, request_type: type[Message], call: CallHandle | None = None,
            stream: StreamProduce | None = None) -> None:
        if request_type in self.calls or request_type in self.streams:
            raise ValueError(f"{request_type.__name__} has a route already")
        if call is not None:
            self.calls[request_type] = call
        if stream is not None:
            self.streams[request_type] = stream
        self._decoder = None

    @property
    def decoder(self) -> MessageDecoder[Message]:
        """Decodes any request type with a route (built once)."""
        if self._decoder is None:
            types = (*self.calls, *self.streams)
            if not types:
                raise ValueError("the control app has no channel routes")
            self._decoder = MessageDecoder(Union[types] if len(types) > 1 else types[0])
        return self._decoder


class Caller(Protocol):
    """The channel a request came on (rpc/channel_server.py's ServerChannel)."""

    def watch_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """`callback` runs once (soon after, not inside) when the channel closes; returns
        the function that forgets it."""
        ...


# Set by the channel for the task serving each request; None outside one (HTTP, tests).
CALLER: ContextVar[Caller | None] = ContextVar("caller", default=None)


def _nothing() -> None:
    pass


def on_caller_lost(callback: Callable[[], None]) -> Callable[[], None]:
    """Called in a handler: `callback` runs once when the channel the request came on
    closes. Returns the function that forgets it (call it once the thing watched ended);
    a request that came on no channel has nothing to watch."""
    caller = CALLER.get()
    return _nothing if caller is None else caller.watch_lost(callback)


LIMITS = web.AppKey("control_limits", ControlLimits)
CHANNEL_ROUTES = web.AppKey("channel_routes", ChannelRoutes)


class RequestRejected(Exception):
    """Raised inside a handler to answer with an ErrorFrame."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.frame = ErrorFrame(request_id=request_id, code=code, message=message)


def token_matches(given: str | None, token: str) -> bool:
    """Constant time, so the comparison is no oracle for the token."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def name_request(message: object) -> None:
    """Log lines of the calling task carry the message's request and trace ids
    (log_format.py)."""
    request_id = getattr(message, "request_id", None)
    if isinstance(request_id, str):
        REQUEST_ID.set(request_id)
    traceparent = getattr(message, "traceparent", None)
    if isinstance(traceparent, str):  # validated by the message's schema
        TRACE_ID.set(traceparent.split("-")[1])
