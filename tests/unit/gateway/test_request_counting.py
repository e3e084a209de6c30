"""`pdserve_gateway_requests_total` counts a stream the client hung up on after its headers
went out (aiohttp then cancels the handler), with the status the client saw."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.api.metrics import GatewayMetrics
from gateway.api.responses import SENT_RESPONSE
from gateway.ops.ops_api import METRICS, count_middleware


def _request(path: str) -> tuple[web.Request, GatewayMetrics]:
    app = web.Application()
    metrics = app[METRICS] = GatewayMetrics()
    return make_mocked_request("POST", path, app=app), metrics


@pytest.mark.parametrize("prepared", [True, False])
def test_a_cancelled_stream_is_counted_only_if_its_headers_went_out(prepared: bool) -> None:
    async def main() -> None:
        request, metrics = _request("/v1/completions")

        async def handler(req: web.Request) -> web.StreamResponse:
            response = req[SENT_RESPONSE] = web.StreamResponse()
            if prepared:
                await response.prepare(req)
            raise asyncio.CancelledError  # the client hung up

        with pytest.raises(asyncio.CancelledError):
            await count_middleware(request, handler)
        assert dict(metrics.requests) == ({("/v1/completions", 200): 1} if prepared else {})

    asyncio.run(main())


def test_an_answered_request_is_counted_once_by_its_status() -> None:
    async def main() -> None:
        request, metrics = _request("/v1/nothing-here")

        async def handler(req: web.Request) -> web.StreamResponse:
            return web.Response(status=404)

        await count_middleware(request, handler)
        assert dict(metrics.requests) == {("other", 404): 1}

    asyncio.run(main())
