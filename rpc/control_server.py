"""A worker's control server: the channel for calls and streams, HTTP for probes and admin.

One port serves both (rpc/channel_server.py tells them apart by the first bytes):

    channel   every call and stream from the gateway and the operations agent: handlers
              registered with `add_call` / `add_stream`, by request message type
    HTTP      GET /health, /ready, /metrics (probes and scrapes: no request data) and
              /admin/* (a worker's state, for operators and tests)

Security: a control server bound to a loopback address may run without a token; bound to any
other address it refuses to start without one (`PDSERVE_INTERNAL_TOKEN`, read by the CLI, not
here). With a token set, a channel's greeting must prove it (rpc/channel_greeting.py: the
worker proves it first; a caller that cannot gets UNAUTHORIZED and the channel closes) and
every HTTP request must carry `Authorization: Bearer <token>`, else 401,
except the probe paths (`/health`, `/ready`, `/metrics`), which must answer orchestrators'
probes and Prometheus scrapes that carry no token. HTTP bodies above `max_body_bytes` get
413 before they are read into memory; a channel frame above it closes the channel.

Deadlines: a channel's greeting, and each frame once begun, must arrive whole within
`body_timeout_s`; a caller that takes none of a stream's frames for `write_timeout_s` while
they pile up has its channel closed, and every stream's producer on it is closed (its
`finally` aborts the request, as for a caller that hung up).

Invariants (`ControlServer.check_invariants`): a stream answer is in `open_streams` exactly
while its producer runs, and its producer is closed exactly once when it leaves.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware

from protocol.messages import ErrorCode, ErrorFrame, Message, encode
from rpc.channel_site import ChannelSite
from rpc.control_app import (CHANNEL_ROUTES, DEFAULT_MAX_BODY_BYTES, LIMITS, ChannelRoutes,
                             ControlLimits, FrameWriter, RequestRejected, token_matches)
from telemetry.options import INTERNAL_TOKEN_ENV

__all__ = ["DEFAULT_MAX_BODY_BYTES", "LIMITS", "ControlLimits", "ControlServer", "FrameWriter",
           "InsecureBindError", "RequestRejected", "add_call", "add_stream", "check_bind",
           "error_response", "is_loopback", "make_app"]

MSGPACK_CONTENT_TYPE = "application/x-msgpack"
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
    """A body over the limit leaves as an ErrorFrame; aiohttp's own 413 carries plain text."""
    try:
        return await handler(request)
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


def add_call(app: web.Application, request_type: type[M],
             handle: Callable[[M], Awaitable[Message]]) -> None:
    """A channel frame carrying a `request_type` is answered with what `handle` returns."""

    async def call(message: Message) -> Message:
        assert isinstance(message, request_type)  # the channel decoded it by its type
        return await handle(message)

    app[CHANNEL_ROUTES].add(request_type, call=call)


def add_stream(app: web.Application, request_type: type[M],
               produce: Callable[[M, FrameWriter], AsyncGenerator[Message, None]]) -> None:
    """A channel frame carrying a `request_type` opens a stream of what `produce` yields;
    `produce` also gets the stream's FrameWriter (rpc/control_app.py). When the caller
    drops the stream (or its channel closes), the generator is closed (aclose), so the
    producer's `finally` is where a worker aborts the request and frees its blocks."""

    def stream(message: Message, out: FrameWriter) -> AsyncGenerator[Message, None]:
        assert isinstance(message, request_type)
        return produce(message, out)

    app[CHANNEL_ROUTES].add(request_type, stream=stream)


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
        runner = web.AppRunner(self.app, shutdown_timeout=self.shutdown_timeout_s,
                               access_log=None, handler_cancellation=True)
        await runner.setup()
        # One port for both: channels, and HTTP for probes and admin (rpc/channel_server.py).
        site = ChannelSite(runner, self.host, self.requested_port, self.app[CHANNEL_ROUTES],
                           self.app[LIMITS], self.token)
        await site.start()
        self._runner, self._site = runner, site
        self.port = site.bound_port
        return self.url

    def advertise(self, port: int) -> str:
        """Callers dial `port` from now on (a fault proxy's, rpc/fault_proxy.py, forwarding
        here): the URL names it and channels prove it; returns the URL."""
        if self._site is None:
            raise RuntimeError("control server not started")
        self._site.advertised_port = self.port = port
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
