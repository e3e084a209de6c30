"""The internal control plane: aiohttp helpers for gateway ↔ worker calls.

Bodies are protocol envelopes (common/contract/protocol.py) with content type application/x-msgpack.
A token stream is a chunked response of length-prefixed frames:

    ┌────────────── 4 bytes ─────────────┬──────── length bytes ─────────┐
    │ length, unsigned big-endian        │ msgpack [version, message]    │  repeated
    └────────────────────────────────────┴───────────────────────────────┘

Security: a control server bound to a loopback address may run without a token; bound to any
other address it refuses to start without one (`PDSERVE_INTERNAL_TOKEN`, read by the CLI, not
here). With a token set, every request must carry `Authorization: Bearer <token>`, else 401,
except the probe paths (`/health`, `/ready`, `/metrics`), which reveal no request data and
must answer orchestrators' probes and Prometheus scrapes that carry no token.
Bodies above `max_body_bytes` get 413 before they are read into memory.

Deadlines: `ControlClient.call` has one overall deadline; `ControlClient.stream` has one for
the response headers and one per frame, so a stalled worker is noticed within frame_timeout_s
and the request can fail cleanly instead of hanging.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import ClientSession, ClientTimeout, web

from common.contract.protocol import (MAX_MESSAGE_BYTES, ErrorCode, ErrorFrame, Message, MessageDecoder,
                             ProtocolError, ProtocolVersionError, encode)

INTERNAL_TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
MSGPACK_CONTENT_TYPE = "application/x-msgpack"
FRAMES_CONTENT_TYPE = "application/x-pdserve-frames"
FRAME_HEADER = struct.Struct(">I")
DEFAULT_MAX_BODY_BYTES = 16 << 20


class ControlError(RuntimeError):
    """A control-plane call failed locally (transport, framing, deadline)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, when there was a response


class FrameDeadlineError(ControlError, TimeoutError):
    """No frame (or no response) arrived within its deadline."""


class RemoteError(ControlError):
    """The worker answered with an ErrorFrame."""

    def __init__(self, frame: ErrorFrame, status: int | None = None) -> None:
        super().__init__(f"{frame.code.value}: {frame.message}", status)
        self.frame = frame


class InsecureBindError(ValueError):
    pass


# ---------------------------------------------------------------- server side


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


# The HTTP status an ErrorFrame answer goes out with.
ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400, ErrorCode.PROTOCOL_VERSION: 400, ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.UNKNOWN_REQUEST: 404, ErrorCode.STALE_EPOCH: 409, ErrorCode.TOO_LARGE: 413,
    ErrorCode.OVERLOADED: 503, ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.ABORTED: 499,
    ErrorCode.TRANSFER_FAILED: 502, ErrorCode.PEER_LOST: 502, ErrorCode.INTERNAL: 500,
}


class RequestRejected(Exception):
    """Raised inside a handler to answer with an ErrorFrame (see error_middleware)."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.frame = ErrorFrame(request_id=request_id, code=code, message=message)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    """Every rejection leaves as an ErrorFrame; aiohttp's own 413 would carry plain text."""
    try:
        return await handler(request)
    except RequestRejected as exc:
        return message_response(exc.frame, ERROR_STATUS[exc.frame.code])
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(ErrorCode.TOO_LARGE, exc.text or "request body too large", 413)


# Read-only paths open without the token: liveness, readiness and metrics carry no request
# data, and probes (kubelet, Docker HEALTHCHECK, Prometheus) should not need the secret.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


def token_middleware(token: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check_token(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        if request.path in PROBE_PATHS and request.method == "GET":
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: no token oracle
            return error_response(ErrorCode.UNAUTHORIZED, "missing or wrong internal token", 401)
        return await handler(request)

    return check_token


def make_app(token: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    middlewares = [token_middleware(token)] if token else []
    middlewares.append(error_middleware)
    return web.Application(client_max_size=max_body_bytes, middlewares=middlewares)


async def read_message(request: web.Request, decoder: MessageDecoder) -> Any:
    """The request body as a message; raises RequestRejected (400) or 413 past the limit."""
    body = await request.read()  # aiohttp raises 413 past client_max_size
    try:
        return decoder.decode(body)
    except ProtocolVersionError as exc:
        raise RequestRejected(ErrorCode.PROTOCOL_VERSION, str(exc)) from exc
    except ProtocolError as exc:
        raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from exc


def message_response(message: Message, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(message), content_type=MSGPACK_CONTENT_TYPE)


def encode_frame(message: Message) -> bytes:
    body = encode(message)
    return FRAME_HEADER.pack(len(body)) + body


def message_handler(request_type: Any, handle: Callable[[Any], Awaitable[Message]]
                    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler: decode one message, answer with the message `handle` returns."""
    decoder = MessageDecoder(request_type)

    async def handler(request: web.Request) -> web.StreamResponse:
        reply = await handle(await read_message(request, decoder))
        status = ERROR_STATUS[reply.code] if isinstance(reply, ErrorFrame) else 200
        return message_response(reply, status)

    return handler


def stream_handler(request_type: Any, produce: Callable[[Any], AsyncIterator[Message]]
                   ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler writing each message `produce` yields as one frame.

    When the client goes away the write fails and the iterator is closed (aclose), so the
    producer's `finally` is where a worker aborts the request and frees its blocks.
    """
    decoder = MessageDecoder(request_type)

    async def handler(request: web.Request) -> web.StreamResponse:
        message = await read_message(request, decoder)
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        response.enable_chunked_encoding()
        await response.prepare(request)
        frames = produce(message)
        try:
            async for frame in frames:
                await response.write(encode_frame(frame))
        finally:
            await frames.aclose()  # type: ignore[attr-defined]
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
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("control server not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        # handler_cancellation: a client that hangs up cancels its handler at once, which is
        # how a gateway-side abort or deadline reaches a streaming worker handler.
        runner = web.AppRunner(self.app, shutdown_timeout=self.shutdown_timeout_s,
                               access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.requested_port)
        await site.start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self.url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


# ---------------------------------------------------------------- client side


class ControlClient:
    """Calls one worker's control API. Owns its session unless one is passed in."""

    def __init__(self, base_url: str, token: str | None = None,
                 session: ClientSession | None = None,
                 max_frame_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_frame_bytes = max_frame_bytes
        self._headers = {"Content-Type": MSGPACK_CONTENT_TYPE}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._owns_session = session is None
        self._session = session

    def _get_session(self) -> ClientSession:
        if self._session is None:
            self._session = ClientSession()
        return self._session

    async def aclose(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def call(self, path: str, message: Message, response_type: Any,
                   timeout_s: float) -> Any:
        """POST one message, return the decoded answer; an ErrorFrame raises RemoteError."""
        decoder = MessageDecoder(ErrorFrame | response_type, self.max_frame_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._get_session().post(
                        self.base_url + path, data=encode(message), headers=self._headers,
                        timeout=ClientTimeout(total=None)) as response:
                    body = await response.content.read(self.max_frame_bytes + 1)
                    return _raise_if_error(_decode_body(decoder, body, response.status),
                                           response.status)
        except TimeoutError as exc:
            raise FrameDeadlineError(f"{path}: no answer within {timeout_s} s") from exc
        except aiohttp.ClientError as exc:  # refused, reset, cut mid-body: the peer is gone
            raise ControlError(f"{path}: {type(exc).__name__}: {exc}") from exc

    async def stream(self, path: str, message: Message, frame_type: Any,
                     first_frame_timeout_s: float, frame_timeout_s: float) -> AsyncIterator[Any]:
        """POST one message and yield the frames of the answer until the worker ends it.

        Raises FrameDeadlineError when the first frame takes longer than
        first_frame_timeout_s or any later one longer than frame_timeout_s, RemoteError for an
        ErrorFrame. Wrap in contextlib.aclosing() when leaving the loop early: closing the
        generator drops the connection, which the worker sees as an abort.
        """
        decoder = MessageDecoder(ErrorFrame | frame_type, self.max_frame_bytes)
        timeout_s = first_frame_timeout_s
        try:
            async with asyncio.timeout(first_frame_timeout_s):
                response = await self._get_session().post(
                    self.base_url + path, data=encode(message), headers=self._headers,
                    timeout=ClientTimeout(total=None))
        except TimeoutError as exc:
            raise FrameDeadlineError(f"{path}: no response within {timeout_s} s") from exc
        except aiohttp.ClientError as exc:
            raise ControlError(f"{path}: {type(exc).__name__}: {exc}") from exc
        try:
            if response.content_type != FRAMES_CONTENT_TYPE:
                body = await asyncio.wait_for(response.content.read(self.max_frame_bytes + 1),
                                              frame_timeout_s)
                _raise_if_error(_decode_body(decoder, body, response.status), response.status)
                raise ControlError(f"{path}: HTTP {response.status} without a frame stream",
                                   response.status)
            while True:
                try:
                    async with asyncio.timeout(timeout_s):
                        frame = await self._read_frame(response, decoder)
                except TimeoutError as exc:
                    raise FrameDeadlineError(
                        f"{path}: no frame within {timeout_s} s (stream stalled)") from exc
                except aiohttp.ClientError as exc:  # the worker died mid-stream
                    raise ControlError(f"{path}: stream broken: {type(exc).__name__}: {exc}") \
                        from exc
                if frame is None:
                    return
                yield _raise_if_error(frame, response.status)
                timeout_s = frame_timeout_s
        finally:
            response.close()  # an early exit must drop the connection, not reuse it

    async def _read_frame(self, response: Any, decoder: MessageDecoder) -> Any:
        try:
            header = await response.content.readexactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ControlError("frame stream cut inside a frame header") from exc
            return None  # clean end of stream
        (length,) = FRAME_HEADER.unpack(header)
        if length > self.max_frame_bytes:
            raise ControlError(f"frame of {length} bytes exceeds {self.max_frame_bytes}")
        try:
            body = await response.content.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ControlError("frame stream cut inside a frame") from exc
        return decoder.decode(body)


def _decode_body(decoder: MessageDecoder, body: bytes, status: int) -> Any:
    try:
        return decoder.decode(body)
    except ProtocolError as exc:
        raise ControlError(f"HTTP {status} with an undecodable body: {exc}", status) from exc


def _raise_if_error(message: Any, status: int) -> Any:
    if isinstance(message, ErrorFrame):
        raise RemoteError(message, status)
    return message
