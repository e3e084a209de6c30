"""Refusals (429, 503) are counted by code in /metrics and logged once per burst."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.admission.refusals import RefusalLog
from gateway.api.errors import ApiError
from gateway.api.http_api import error_middleware
from gateway.api.metrics import GatewayMetrics
from gateway.ops.ops_api import METRICS, REFUSALS, count_middleware


def test_a_burst_logs_its_first_refusal_then_a_count_after_the_quiet_time() -> None:
    refusals = RefusalLog(quiet_s=10.0)
    assert refusals.observe(503, "no_kv_blocks", "full", now=0.0) == \
        "refused with 503 no_kv_blocks: full"
    assert [refusals.observe(503, "no_kv_blocks", "full", now=t) for t in (1.0, 5.0, 9.9)] \
        == [None, None, None]
    # Another reason is a burst of its own.
    assert refusals.observe(429, "deadline", "late", now=2.0) == "refused with 429 deadline: late"
    assert refusals.observe(503, "no_kv_blocks", "full", now=10.0) == (
        "refused with 503 no_kv_blocks: full (3 more with this reason since the last line)")
    assert refusals.observe(503, "no_kv_blocks", "full", now=30.0) == \
        "refused with 503 no_kv_blocks: full"


def test_the_middlewares_count_every_refusal_by_code_and_log_one_line(caplog) -> None:
    app = web.Application()
    metrics = app[METRICS] = GatewayMetrics()
    app[REFUSALS] = RefusalLog(quiet_s=3600)
    errors = [ApiError(429, "queue full", code="tier_queue_full"),
              ApiError(503, "no decode worker had free KV cache blocks in time",
                       code="no_kv_blocks"),
              ApiError(503, "no decode worker had free KV cache blocks in time",
                       code="no_kv_blocks"),
              ApiError(400, "bad", code="invalid_value")]

    async def main() -> list[int]:
        statuses = []
        for exc in errors:
            async def handler(req: web.Request, exc: ApiError = exc) -> web.StreamResponse:
                raise exc

            async def inner(req: web.Request) -> web.StreamResponse:
                return await error_middleware(req, handler)

            request = make_mocked_request("POST", "/v1/completions", app=app)
            statuses.append((await count_middleware(request, inner)).status)
        return statuses

    with caplog.at_level(logging.WARNING, logger="gateway.ops.ops_api"):
        assert asyncio.run(main()) == [429, 503, 503, 400]
    assert dict(metrics.refusals) == {(429, "tier_queue_full"): 1, (503, "no_kv_blocks"): 2}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused with 429 tier_queue_full: queue full",
                     "refused with 503 no_kv_blocks: no decode worker had free KV cache "
                     "blocks in time"]
    text = metrics.render(lambda: ())
    assert 'pdserve_gateway_refusals_total{status="503",code="no_kv_blocks"} 2' in text
