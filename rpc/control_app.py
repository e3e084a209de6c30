"""What a worker's control API is, whichever way a request reaches it: its limits, its
routes by message type, and how a handler refuses a request.

A request reaches a worker over HTTP (rpc/control_server.py: one POST per
call or stream) or over a gateway's persistent channel (rpc/channel_server.py:
one frame opens it); both run the same handlers, registered once with
`control_server.add_call` / `add_stream`, and both turn a `RequestRejected` into an
`ErrorFrame` answer. A stream producer registered with `add_lane_stream` gets
the channel's `FrameLane` for its stream (None over HTTP): a way to send a frame from a
callback, without the producer's task (worker/stream_frames.py).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, Union

from aiohttp import web

from protocol.messages import ErrorCode, ErrorFrame, Message, MessageDecoder
from telemetry.log_format import REQUEST_ID, TRACE_ID

DEFAULT_MAX_BODY_BYTES = 16 << 20

CallHandle = Callable[[Message], Awaitable[Message]]


class FrameLane(Protocol):
    """One channel stream's way out for frames sent outside its producer's task."""

    def send(self, frame: Message) -> bool:
        """Queues `frame` on the stream now (it leaves with this turn's write); False, and
        nothing sent, while the channel is paused or closed or the stream cancelled."""
        ...


# The channel calls a stream's producer with its lane (a producer without one ignores it).
StreamProduce = Callable[[Message, FrameLane], AsyncGenerator[Message, None]]


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


LIMITS = web.AppKey("control_limits", ControlLimits)
CHANNEL_ROUTES = web.AppKey("channel_routes", ChannelRoutes)


# The HTTP status an ErrorFrame answer goes out with.
ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400, ErrorCode.PROTOCOL_VERSION: 400, ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.UNKNOWN_REQUEST: 404, ErrorCode.STALE_EPOCH: 409, ErrorCode.TOO_LARGE: 413,
    ErrorCode.OVERLOADED: 503, ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.ABORTED: 499,
    ErrorCode.TRANSFER_FAILED: 502, ErrorCode.PEER_LOST: 502, ErrorCode.INTERNAL: 500,
}


class RequestRejected(Exception):
    """Raised inside a handler to answer with an ErrorFrame (HTTP: with its status)."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.frame = ErrorFrame(request_id=request_id, code=code, message=message)
        self.status = ERROR_STATUS[code] if status is None else status


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
