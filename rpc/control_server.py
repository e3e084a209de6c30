"""The internal control plane, server side: aiohttp helpers for a worker's /internal/* API.

Bodies are protocol envelopes (protocol/messages.py) with content type
application/x-msgpack; a stream answer is a chunked response of length-prefixed frames
(rpc/frames.py).

Security: a control server bound to a loopback address may run without a token; bound to any
other address it refuses to start without one (`PDSERVE_INTERNAL_TOKEN`, read by the CLI, not
here). With a token set, every request must carry `Authorization: Bearer <token>`, else 401,
except the probe paths (`/health`, `/ready`, `/metrics`), which reveal no request data and
must answer orchestrators' probes and Prometheus scrapes that carry no token.
Bodies above `max_body_bytes` get 413 before they are read into memory.

Deadlines: a request body must arrive within `body_timeout_s` (else 408); each frame of a
stream answer must be taken by the peer within `write_timeout_s` (else the stream ends, and
its producer's `finally` aborts the request, as for a peer that hung up).

Lifecycle of a stream answer: request decoded → headers sent → one frame per message the
producer yields → end of body; or the peer goes away / a write times out → the producer is
closed (`aclose`) → gone.

The same port serves gateways' channels (rpc/channel_server.py): one connection
per gateway carrying many requests, to the handlers registered with `add_call` and
`add_stream`, under the same token, size limits and deadlines.

Invariants (`ControlServer.check_invariants`): a stream answer is in `open_streams` exactly
while its handler runs, and its producer is closed exactly once when it leaves.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware

from protocol.messages import (ErrorCode, ErrorFrame, Message, MessageDecoder, ProtocolError,
                               ProtocolVersionError, encode)
from rpc.channel_server import ChannelSite
from rpc.control_app import (CHANNEL_ROUTES, DEFAULT_MAX_BODY_BYTES, ERROR_STATUS, LIMITS,
                             ChannelRoutes, ControlLimits, FrameLane, RequestRejected, name_request,
                             token_matches)
from rpc.frames import FRAMES_CONTENT_TYPE, MSGPACK_CONTENT_TYPE, encode_frame
from telemetry.options import INTERNAL_TOKEN_ENV

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ERROR_STATUS", "LIMITS", "ControlLimits", "ControlServer",
           "InsecureBindError", "RequestRejected", "add_call", "add_stream", "check_bind",
           "error_response", "is_loopback", "make_app", "message_handler", "message_response",
           "read_message", "stream_handler"]

M = TypeVar("M", bound=Message)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class InsecureBindError(ValueError):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname may resolve anywhere: treat as exposed


def check_bind(host: str, token: str | None) -> None:
    if not token and not is_loopback(host):
        raise InsecureBindError(
            f"refusing to serve the internal control API on {host} without a token: "
            f"set {INTERNAL_TOKEN_ENV}, or bind to 127.0.0.1")


def error_response(code: ErrorCode, message: str, status: int,
                   request_id: str | None = None) -> web.Response:
    frame = ErrorFrame(request_id=request_id, code=code, message=message)
    return web.Response(status=status, body=encode(frame), content_type=MSGPACK_CONTENT_TYPE)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every rejection leaves as an ErrorFrame; aiohttp's own 413 would carry plain text."""
    try:
        return await handler(request)
    except RequestRejected as exc:
        return message_response(exc.frame, exc.status)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(ErrorCode.TOO_LARGE, exc.text or "request body too large", 413)


# Read-only paths open without the token: liveness, readiness and metrics carry no request
# data, and probes (kubelet, Docker HEALTHCHECK, Prometheus) should not need the secret.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


def token_middleware(token: str) -> Middleware:
    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PROBE_PATHS and request.method == "GET":
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not token_matches(given, token):
            return error_response(ErrorCode.UNAUTHORIZED, "missing or wrong internal token", 401)
        return await handler(request)

    return check_token


def make_app(token: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             body_timeout_s: float = 10.0, write_timeout_s: float = 30.0) -> web.Application:
    middlewares: list[Middleware] = [token_middleware(token)] if token else []
    middlewares.append(error_middleware)
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[LIMITS] = ControlLimits(max_body_bytes, body_timeout_s, write_timeout_s)
    app[CHANNEL_ROUTES] = ChannelRoutes()
    return app


def add_call(app: web.Application, path: str, request_type: type[M],
             handle: Callable[[M], Awaitable[Message]]) -> None:
    """POST `path` (and the channel, for `request_type`) answers with what `handle` returns."""
    app.router.add_post(path, message_handler(request_type, handle))

    async def call(message: Message) -> Message:
        assert isinstance(message, request_type)  # the channel decoded it by its type
        return await handle(message)

    app[CHANNEL_ROUTES].add(request_type, call=call)


def add_stream(app: web.Application, path: str, request_type: type[M],
               produce: Callable[[M], AsyncGenerator[Message, None]]) -> None:
    """POST `path` (and the channel, for `request_type`) streams what `produce` yields."""
    add_lane_stream(app, path, request_type, lambda message, lane: produce(message))


def add_lane_stream(app: web.Application, path: str, request_type: type[M],
                    produce: Callable[[M, FrameLane | None], AsyncGenerator[Message, None]]
                    ) -> None:
    """As add_stream, and `produce` also gets the stream's FrameLane over the channel (None
    over HTTP, where every frame goes through the handler's own loop)."""
    app.router.add_post(path, stream_handler(request_type, lambda message: produce(message,
                                                                                   None)))

    def stream(message: Message, lane: FrameLane) -> AsyncGenerator[Message, None]:
        assert isinstance(message, request_type)
        return produce(message, lane)

    app[CHANNEL_ROUTES].add(request_type, stream=stream)


async def read_message(request: web.Request, decoder: MessageDecoder[M]) -> M:
    """The request body as a message; raises RequestRejected (400, 408) or 413 past the limit."""
    timeout_s = request.app[LIMITS].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            body = await request.read()  # aiohttp raises 413 past client_max_size
    except TimeoutError:
        raise RequestRejected(ErrorCode.BAD_REQUEST, f"request body not received within "
                              f"{timeout_s} s", status=408) from None
    try:
        return decoder.decode(body)
    except ProtocolVersionError as exc:
        raise RequestRejected(ErrorCode.PROTOCOL_VERSION, str(exc)) from exc
    except ProtocolError as exc:
        raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from exc


def message_response(message: Message, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(message), content_type=MSGPACK_CONTENT_TYPE)


def message_handler(request_type: type[M], handle: Callable[[M], Awaitable[Message]]) -> Handler:
    """An aiohttp handler: decode one message, answer with the message `handle` returns."""
    decoder: MessageDecoder[M] = MessageDecoder(request_type)

    async def handler(request: web.Request) -> web.StreamResponse:
        message = await read_message(request, decoder)
        name_request(message)
        reply = await handle(message)
        status = ERROR_STATUS[reply.code] if isinstance(reply, ErrorFrame) else 200
        return message_response(reply, status)

    return handler


def stream_handler(request_type: type[M],
                   produce: Callable[[M], AsyncGenerator[Message, None]]) -> Handler:
    """An aiohttp handler writing each message `produce` yields as one frame.

    When the client goes away (or stops reading for write_timeout_s) the write fails and
    the generator is closed (aclose), so the producer's `finally` is where a worker aborts
    the request and frees its blocks.
    """
    decoder: MessageDecoder[M] = MessageDecoder(request_type)

    async def handler(request: web.Request) -> web.StreamResponse:
        message = await read_message(request, decoder)
        name_request(message)
        limits = request.app[LIMITS]
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        response.enable_chunked_encoding()
        await response.prepare(request)
        frames = produce(message)
        key = id(frames)
        limits.open_streams.add(key)
        try:
            async for frame in frames:
                async with asyncio.timeout(limits.write_timeout_s):
                    await response.write(encode_frame(frame))
        finally:
            limits.open_streams.discard(key)
            await frames.aclose()
        await response.write_eof()
        return response

    return handler


class ControlServer:
    """Runs one aiohttp app on host:port (0 picks a free port); start/stop own the runner."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, shutdown_timeout_s: float = 2.0) -> None:
        check_bind(host, token)
        self.app = app
        self.host = host
        self.requested_port = port
        self.shutdown_timeout_s = shutdown_timeout_s
        self.token = token
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._site: ChannelSite | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("control server not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def num_open_streams(self) -> int:
        return len(self.app[LIMITS].open_streams) if LIMITS in self.app else 0

    async def start(self) -> str:
        # handler_cancellation: a client that hangs up cancels its handler at once, which is
        # how a gateway-side abort or deadline reaches a streaming worker handler.
        runner = web.AppRunner(self.app, shutdown_timeout=self.shutdown_timeout_s,
                               access_log=None, handler_cancellation=True)
        await runner.setup()
        # One port for both: HTTP, and gateways' channels (rpc/channel_server.py).
        site = ChannelSite(runner, self.host, self.requested_port, self.app[CHANNEL_ROUTES],
                           self.app[LIMITS], self.token)
        await site.start()
        self._runner, self._site = runner, site
        self.port = site.bound_port
        return self.url

    @property
    def num_channels(self) -> int:
        return len(self._site.channels) if self._site is not None else 0

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        site, self._site = self._site, None
        if site is not None:
            await site.close_channels(self.shutdown_timeout_s)
        if runner is not None:
            await runner.cleanup()

    def check_invariants(self) -> None:
        if self._site is not None:
            for channel in self._site.channels:
                channel.check_invariants()
        if self._runner is None:
            assert self.num_open_streams == 0, \
                f"{self.num_open_streams} stream answers outlived the server"
