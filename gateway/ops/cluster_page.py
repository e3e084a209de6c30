"""The live cluster page: `GET /dashboard` (a static page, its script and style, shipped in
gateway/static/, no CDN) and `GET /admin/cluster`, the JSON the page polls every 2 s.

    /dashboard             the page; holds no data, so it is served without a key
    /dashboard/{asset}     app.js, app.css
    /admin/cluster         {"now_unix_ms", "models", "workers": [/admin/workers rows],
                            "tiers": [{"name", "priority", "ttft_ms", "tpot_ms", "queued",
                                       "running"}],
                            "bucket_s", "window_s" (what the counts cover: the
                            buckets, or the gateway's uptime when shorter), "attainment": [{"start_unix_s", "tiers": {tier:
                                       {"met", "missed", "refused", "failed"}}}],
                            "recent": [requests that missed, newest first, with stages],
                            "agent_events": [],
                            "agent_reports": [the operations agent's latest root-cause
                                              report per tier, newest first (Redis away:
                                              none)]}
                           open on a loopback-only gateway without API keys, else
                           behind an admin key or the cluster's admin token
                           (gateway/ops/admin_access.py; the page asks for it, or reads it
                           from the URL's #key=... fragment, which no server or proxy log
                           sees)

The page sends the key as `Authorization: Bearer`; the answers carry a strict
Content-Security-Policy (scripts and styles from this origin only).
"""

from __future__ import annotations

import time
from importlib import resources

import msgspec
from aiohttp import web

from gateway.api.http_api import GATE, SETTINGS, TIERS
from gateway.api.request_trace import RequestRecord
from gateway.ops.admin_access import AdminCall
from gateway.ops.ops_api import CLUSTER, HISTORY, WorkerRow, require_admin, worker_row
from gateway.ops.request_history import Bucket
from protocol.root_cause_report import RootCauseReport
from state.agent_state import AgentState
from state.redis_state import REDIS_FAILURES, raise_if_cancelling

REPORTS_READ = 50  # the last reports searched for each tier's latest
ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class TierRow(msgspec.Struct):
    name: str
    priority: int
    ttft_ms: float
    tpot_ms: float
    queued: int
    running: int


class ClusterSnapshot(msgspec.Struct):
    now_unix_ms: int
    models: list[str]
    workers: list[WorkerRow]
    tiers: list[TierRow]
    bucket_s: int
    window_s: float
    attainment: list[Bucket]
    recent: list[RequestRecord]
    agent_events: list[dict[str, object]]  # the operations agent's decisions (none yet)
    agent_reports: list[RootCauseReport] = []


def install(app: web.Application) -> None:
    app.router.add_get("/dashboard", handle_page)
    app.router.add_get("/dashboard/{asset}", handle_asset)
    app.router.add_get("/admin/cluster", handle_cluster)


def _static(name: str) -> bytes:
    return resources.files("gateway").joinpath("static", name).read_bytes()


async def handle_page(request: web.Request) -> web.Response:
    return web.Response(body=_static("dashboard.html"), content_type="text/html",
                        charset="utf-8", headers=SECURITY_HEADERS)


async def handle_asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    if name not in ASSETS:  # a fixed list: no path from the URL reaches the file system
        raise web.HTTPNotFound()
    return web.Response(body=_static(name), content_type=ASSETS[name], charset="utf-8",
                        headers=SECURITY_HEADERS)


async def _latest_reports(agent_state: AgentState | None) -> list[RootCauseReport]:
    """The latest report of each tier, newest first (best effort: the page polls on)."""
    if agent_state is None:
        return []
    try:
        reports = await agent_state.recent_reports(REPORTS_READ, timeout_s=0.5)
    except REDIS_FAILURES as exc:
        raise_if_cancelling(exc)
        return []
    latest: dict[str, RootCauseReport] = {}
    for report in reports:
        latest.setdefault(report.tier, report)
    return list(latest.values())


async def handle_cluster(request: web.Request) -> web.Response:
    app = request.app
    require_admin(request, AdminCall.READ)
    controller, now = app[GATE].controller, time.time()
    tiers = [TierRow(name=t.name, priority=t.priority, ttft_ms=t.ttft_ms, tpot_ms=t.tpot_ms,
                     queued=controller.num_queued_in(t.name),
                     running=controller.num_running_in(t.name))
             for t in sorted(app[TIERS].tiers.values(), key=lambda t: (t.priority, t.name))]
    history = app[HISTORY]
    snapshot = ClusterSnapshot(
        now_unix_ms=int(now * 1000), models=list(app[SETTINGS].served_models[:1]),
        workers=[worker_row(entry) for entry in app[CLUSTER].entries()], tiers=tiers,
        bucket_s=history.bucket_s, window_s=history.window_s(now),
        attainment=history.attainment(now),
        recent=history.recent(), agent_events=[],
        agent_reports=await _latest_reports(app[CLUSTER].agent_state))
    return web.Response(body=msgspec.json.encode(snapshot), content_type="application/json",
                        headers=SECURITY_HEADERS)
