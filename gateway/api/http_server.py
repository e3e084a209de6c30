"""The gateway's HTTP server: aiohttp's, with the errors aiohttp answers itself rendered as
OpenAI-style errors too.

A request aiohttp's parser refuses (a control character in a header value, a header line
too long, Content-Length beside Transfer-Encoding) never reaches the app, its middlewares
or its routes: the connection's `RequestHandler.handle_error` answers it, by default with a
plain-text 400 that echoes the offending bytes, and logs an ERROR with a traceback per
request. Here it gets the JSON body every other error has (gateway/api/errors.py), no
echo of what it sent, and one DEBUG line: a malformed request is the client's mistake,
not the gateway's. Anything else that reaches `handle_error` (a handler that escaped the
error middleware: a bug) keeps its ERROR and traceback and is answered as an OpenAI 500.

    GatewayRunner(app)  ─▶ _make_server(): the app's own server (startup run as aiohttp
                           runs it), re-made as a GatewayServer with the same arguments
    GatewayServer()     ─▶ one GatewayRequestHandler per connection
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_request import BaseRequest

from gateway.api.errors import ERROR_TYPES, ApiError, internal_error

log = logging.getLogger(__name__)


class GatewayRequestHandler(web.RequestHandler):
    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The answer to a request aiohttp could not hand to the app; the connection
        closes after it (as aiohttp's own answer does)."""
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; cannot send the error too")
        error = bad_request_error(status, exc, message)
        if error.status >= 500:
            log.error("unhandled error in a request from %s", request.remote, exc_info=exc)
        else:
            log.debug("refused a malformed HTTP request from %s: %s", request.remote,
                      error.message)
        response = web.Response(status=error.status, body=error.body_bytes(),
                                content_type="application/json", headers=error.headers())
        response.force_close()
        return response


def bad_request_error(status: int, exc: BaseException | None, message: str | None
                      ) -> ApiError:
    """The OpenAI-style error for what aiohttp refused (side-effect free): its reason up to
    the first colon (after it, aiohttp quotes the client's bytes back)."""
    if status >= 500:
        return internal_error()
    detail = exc.message if isinstance(exc, HttpProcessingError) else message
    reason = str(detail or "").strip().split(":", 1)[0].strip() or HTTPStatus(400).phrase
    return ApiError(status if status in ERROR_TYPES else 400,
                    f"The request is not valid HTTP: {reason}.", code="bad_http_request")


class GatewayServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer protocol errors as OpenAI errors."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return GatewayServer(server.request_handler, request_factory=server.request_factory,
                             handler_cancellation=server.handler_cancellation,
                             loop=server._loop, **server._kwargs)
