"""Operator endpoints of the gateway: /health, /ready, /metrics and the /admin API.

    /health          200 while the process serves HTTP
    /ready           200 once at least one decode (or colocated) worker is routable, the
                     workers it expects have registered (gateway/ops/startup.py) and the
                     gateway is not draining, else 503
    /metrics         Prometheus text (gateway/api/metrics.py)
    /admin/workers   {"workers": [{"id", "role", "pid", "epoch", "control_url", "state",
                                   "load": {"num_running", "num_waiting", "kv_blocks_used",
                                            "kv_blocks_total", "host_blocks_used",
                                            "host_blocks_total", ...}}]}
                     (host_blocks_*: the worker's host KV tier; total 0: it has none;
                     moe_*: a mixture-of-experts model's busiest expert over the mean in
                     its worst layer, that layer and expert, the busiest rank's over the
                     mean with --ep, and its expert switches; absent for a dense model)
                     state: "ready" | "draining" | "ejected" (the operations agent keeps
                     it out of routing: "ejection" says why) | "expired" (lease lapsed,
                     not yet purged)
    POST /admin/workers/{id}/role   {"role", "drain_timeout_s"}: change a worker's role
                     (gateway/ops/role_admin.py)
    /admin/agent/events?limit=N   {"events": [...]}: the operations agent's last N
                     decisions (default 100, at most 1000), newest first
    /admin/agent/reports?limit=N  {"reports": [...]}: its last N root-cause reports
                     (agent/root_cause.py; default 20, at most 1000), newest first
    /admin/state     {"num_active", "num_background_tasks", "num_queued", "num_running",
                      "redis_connected", "invariant_error"}: the gateway's own bookkeeping,
                     its invariants checked on the spot (null: all hold)

Who may call /admin (gateway/ops/admin_access.py): the GET views are open on a gateway
that listens on loopback only and has no API keys, else need an admin key or the
cluster's admin token; a role change always needs one of those, as JSON, and no foreign
Origin (401/403, 415, 403).

`install(app, ...)` adds the routes and the outermost middleware that counts every answer
by endpoint and status (after error rendering, so 4xx/5xx are seen as the client sees them),
and every refusal (429, 503, before or after the stream's headers) by its error code, with
one warning line per burst of one code (gateway/admission/refusals.py); it also ends each request's
trace and keeps it in the request history the cluster page shows (gateway/ops/cluster_page.py)
and in the tier tally the operations agent reads (gateway/ops/tier_tally_book.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import msgspec
from aiohttp import web

from gateway.admission.refusals import RefusalLog
from gateway.api.errors import ApiError, invalid_request
from gateway.api.http_api import DRAIN, GATE, TIERS, Handler, bearer_key
from gateway.api.metrics import GatewayMetrics
from gateway.api.responses import REFUSAL, SENT_RESPONSE, SLO_TIMING, TRACE
from gateway.api.slo_accounting import SloOutcome, slo_outcome
from gateway.ops.admin_access import AdminAccess, AdminCall, AdminRequest, admin_refusal
from gateway.ops.request_history import RequestHistory
from gateway.ops.role_admin import MAX_BODY_BYTES, change_worker_role, json_answer
from gateway.ops.startup import STARTUP
from gateway.ops.tier_tally_book import TierTallyBook
from gateway.upstream.cluster import ClusterView, WorkerEntry
from gateway.upstream.upstream import WorkerBackend
from protocol.messages import Role
from protocol.root_cause_report import RootCauseReport
from protocol.worker_load import StepModel, WorkerLoad
from state.agent_state import AgentEvent, AgentState, Ejection
from state.redis_state import REDIS_FAILURES, raise_if_cancelling

CLUSTER = web.AppKey("cluster", ClusterView)
UPSTREAM = web.AppKey("upstream", WorkerBackend)
METRICS = web.AppKey("metrics", GatewayMetrics)
REFUSALS = web.AppKey("refusals", RefusalLog)
HISTORY = web.AppKey("request_history", RequestHistory)
TALLIES = web.AppKey("tier_tallies", TierTallyBook)
ADMIN = web.AppKey("admin_access", AdminAccess)
FINISHED = frozenset({SloOutcome.MET, SloOutcome.MISSED_TTFT, SloOutcome.MISSED_TPOT,
                      SloOutcome.MISSED_BOTH})
log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_AGENT_EVENTS = 1000
_COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})


class WorkerRow(msgspec.Struct):
    id: str
    role: str | None
    pid: int | None
    epoch: int | None
    control_url: str | None
    state: str
    load: dict[str, float] | None  # num_running, num_waiting, kv_blocks_used, kv_blocks_total,
    #                              host_blocks_used, host_blocks_total,
    #                              num_queued_prefill_tokens, num_decoding, prefill_tokens_per_s
    device: str | None = None
    sm_share_percent: int | None = None  # CUDA MPS share of the GPU's SMs (None: no MPS)
    kv_dtype: str | None = None  # its KV pool's dtype (None: not told)
    step_model: StepModel | None = None  # the fitted step time the router predicts with
    kv_send_bytes_per_s: float | None = None
    ejection: Ejection | None = None


class WorkerList(msgspec.Struct):
    workers: list[WorkerRow]


def install(app: web.Application, cluster: ClusterView, backend: WorkerBackend,
            metrics: GatewayMetrics, access: AdminAccess,
            tallies: TierTallyBook | None = None) -> None:
    app[CLUSTER], app[UPSTREAM], app[METRICS], app[ADMIN] = cluster, backend, metrics, access
    app[REFUSALS], app[HISTORY] = RefusalLog(), RequestHistory()
    if tallies is not None:
        app[TALLIES] = tallies
    app.middlewares.insert(0, count_middleware)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/admin/workers", handle_admin_workers)
    app.router.add_get("/admin/state", handle_admin_state)
    app.router.add_get("/admin/agent/events", handle_agent_events)
    app.router.add_get("/admin/agent/reports", handle_agent_reports)
    app.router.add_post("/admin/workers/{worker_id}/role", handle_admin_role)


@web.middleware
async def count_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    path = request.path if request.path in _COUNTED_PATHS else "other"
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        # The client hung up and aiohttp cancelled the handler: a stream whose headers went
        # out was answered all the same (often in full, [DONE] included).
        sent = request.get(SENT_RESPONSE)
        if sent is not None and sent.prepared:
            request.app[METRICS].observe_request(path, sent.status)
        _account(request, client_gone=True)
        raise
    request.app[METRICS].observe_request(path, response.status)
    _account(request, client_gone=False)
    return response


def _account(request: web.Request, client_gone: bool) -> None:
    """Count the request's refusal (and log it once per burst) and its SLO outcome."""
    metrics = request.app[METRICS]
    refusal = request.get(REFUSAL)
    status_code = None
    if refusal is not None:
        status_code = (refusal.status, refusal.code or refusal.type)
        metrics.observe_refusal(*status_code)
        line = request.app[REFUSALS].observe(*status_code, refusal.message, time.monotonic())
        if line is not None:
            log.warning("%s", line)
    timing = request.get(SLO_TIMING)
    if timing is not None:
        outcome = slo_outcome(timing, status_code, client_gone)
        metrics.observe_slo(timing.tier.name, outcome.value, timing.ttft_s)
        trace = request.get(TRACE)
        if trace is not None:
            error = None if outcome in FINISHED else status_code[1] if status_code else \
                outcome.value
            record = trace.finish(timing, outcome, error)
            if HISTORY in request.app:  # (unit-test apps may leave the history out)
                request.app[HISTORY].observe(record, time.time())
            if TALLIES in request.app:
                request.app[TALLIES].observe(record)


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    cluster, draining = request.app[CLUSTER], request.app[DRAIN].draining
    num_decode, startup = cluster.num_decode_workers(), request.app[STARTUP]
    ready = num_decode > 0 and not draining and startup.is_open
    body = {"ready": ready, "decode_workers": num_decode, "draining": draining,
            "redis_connected": cluster.redis_connected, **startup.status()}
    shared = request.app[GATE].shared
    if shared is not None:
        body["admission_limits"] = shared.status()
    return web.json_response(body, status=200 if ready else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    app = request.app
    text = app[METRICS].render(lambda: _gauges(app))
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


def _gauges(app: web.Application) -> Iterator[tuple[str, str, str, float]]:
    controller = app[GATE].controller
    for tier in sorted(app[TIERS].tiers):
        yield ("pdserve_gateway_queue_depth", "Requests waiting for admission.",
               f'tier="{tier}"', controller.num_queued_in(tier))
        yield ("pdserve_gateway_running", "Requests admitted and not finished.",
               f'tier="{tier}"', controller.num_running_in(tier))
    cluster = app[CLUSTER]
    counts: dict[Role, int] = {}
    for info in cluster.workers.values():
        if not info.draining:
            counts[info.role] = counts.get(info.role, 0) + 1
    for role in Role:
        yield ("pdserve_gateway_workers", "Routable workers by role.", f'role="{role.value}"',
               counts.get(role, 0))
    yield ("pdserve_gateway_redis_connected", "1 while registry polls succeed.", "",
           int(cluster.redis_connected))
    yield ("pdserve_gateway_channels", "Open channels to workers (one persistent "
           "connection each, carrying every request to that worker).", "",
           app[UPSTREAM].channels.num_channels)
    shared = app[GATE].shared
    if shared is not None:
        yield ("pdserve_gateway_limits_shared", "1 while admission limits are shared in "
               "Redis by every gateway replica, 0 while this replica admits 1/N of each "
               "limit on its own (Redis unreachable).", "", int(shared.mode == "shared"))
        yield ("pdserve_gateway_replicas", "Gateway replicas sharing the limits (the N of "
               "the 1/N fallback).", "", shared.num_replicas)


async def handle_admin_role(request: web.Request) -> web.Response:
    require_admin(request, AdminCall.CHANGE)
    backend = request.app[UPSTREAM]
    body = await request.content.read(MAX_BODY_BYTES + 1)
    changed = await change_worker_role(request.app[CLUSTER], backend.clients.get,
                                       request.match_info["worker_id"], body)
    return json_answer(changed)


async def handle_admin_workers(request: web.Request) -> web.Response:
    require_admin(request, AdminCall.READ)
    rows = [worker_row(entry) for entry in request.app[CLUSTER].entries()]
    return web.Response(body=msgspec.json.encode(WorkerList(workers=rows)),
                        content_type="application/json")


class AgentEvents(msgspec.Struct):
    events: list[AgentEvent]


async def handle_agent_events(request: web.Request) -> web.Response:
    require_admin(request, AdminCall.READ)
    count = _limit(request, 100)
    events = await _from_redis(_agent_state(request).recent_events(count))
    return web.Response(body=msgspec.json.encode(AgentEvents(events=events)),
                        content_type="application/json")


class AgentReports(msgspec.Struct):
    reports: list[RootCauseReport]


async def handle_agent_reports(request: web.Request) -> web.Response:
    require_admin(request, AdminCall.READ)
    count = _limit(request, 20)
    reports = await _from_redis(_agent_state(request).recent_reports(count))
    return web.Response(body=msgspec.json.encode(AgentReports(reports=reports)),
                        content_type="application/json")


async def _from_redis(read: Awaitable[T]) -> T:
    """What `read` returns; Redis unreachable: a 503 the client can retry."""
    try:
        return await read
    except REDIS_FAILURES as exc:
        raise_if_cancelling(exc)
        raise ApiError(503, f"Redis is unreachable: {exc}", code="redis_unavailable") from None


def _limit(request: web.Request, default: int) -> int:
    raw = request.query.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_AGENT_EVENTS:
        raise invalid_request(f"limit must be an integer in [1, {MAX_AGENT_EVENTS}]",
                              param="limit")
    return int(raw)


def _agent_state(request: web.Request) -> AgentState:
    agent_state = request.app[CLUSTER].agent_state
    if agent_state is None:
        raise ApiError(404, "This gateway reads no agent state.", code="not_found")
    return agent_state


class GatewayState(msgspec.Struct):
    num_active: int  # generations in progress upstream
    num_background_tasks: int  # aborts still being sent
    num_queued: int  # waiting for admission, all tiers
    num_running: int  # admitted, all tiers
    redis_connected: bool
    invariant_error: str | None


async def handle_admin_state(request: web.Request) -> web.Response:
    app = request.app
    require_admin(request, AdminCall.READ)
    backend, gate, cluster = app[UPSTREAM], app[GATE], app[CLUSTER]
    error = None
    try:
        backend.check_invariants()
        gate.check_invariants()
        cluster.check_invariants()
        app[DRAIN].check_invariants()
        app[HISTORY].check_invariants()
    except AssertionError as exc:
        error = f"AssertionError: {exc}"
    state = GatewayState(num_active=backend.num_active,
                         num_background_tasks=backend.num_background_tasks,
                         num_queued=gate.controller.num_queued,
                         num_running=gate.controller.num_running,
                         redis_connected=cluster.redis_connected, invariant_error=error)
    return web.Response(body=msgspec.json.encode(state), content_type="application/json")


def require_admin(request: web.Request, call: AdminCall) -> None:
    """Raise the ApiError that refuses `call` to this request, if any."""
    facts = AdminRequest(credential=bearer_key(request), host=request.headers.get("Host"),
                         origin=request.headers.get("Origin"),
                         content_type=request.content_type)
    refusal = admin_refusal(call, facts, request.app[ADMIN], request.app[TIERS])
    if refusal is not None:
        raise refusal


def worker_row(entry: WorkerEntry) -> WorkerRow:
    info, load = entry.info, entry.load
    state = "expired" if info is None else "draining" if info.draining else \
        "ejected" if entry.ejection is not None else "ready"
    return WorkerRow(
        id=entry.worker_id, role=info.role.value if info else None,
        pid=(info.pid or None) if info else None, epoch=info.epoch if info else None,
        control_url=info.control_url if info else None, state=state,
        load=_load_fields(load.load) if load else None,
        device=info.device if info else None,
        sm_share_percent=(info.sm_share_percent or None) if info else None,
        kv_dtype=(info.kv_dtype or None) if info else None,
        step_model=load.load.step_model if load else None,
        kv_send_bytes_per_s=(load.load.kv_send_bytes_per_s or None) if load else None,
        ejection=entry.ejection)


def _load_fields(load: WorkerLoad) -> dict[str, float]:
    return {"num_running": load.num_running, "num_waiting": load.num_waiting,
            "kv_blocks_used": load.num_kv_blocks_used,
            "kv_blocks_total": load.num_kv_blocks_total,
            "host_blocks_used": load.num_host_blocks_used,
            "host_blocks_total": load.num_host_blocks_total,
            "num_queued_prefill_tokens": load.num_queued_prefill_tokens,
            "num_decoding": load.num_decoding,
            "prefill_tokens_per_s": round(load.prefill_tokens_per_s, 1), **_moe_fields(load)}


def _moe_fields(load: WorkerLoad) -> dict[str, float]:
    """The expert load of the worst MoE layer (none for a dense model)."""
    if not load.moe_imbalance:
        return {}
    layer = max(range(len(load.moe_imbalance)), key=load.moe_imbalance.__getitem__)
    return {"moe_imbalance": round(load.moe_imbalance[layer], 2), "moe_layer": layer,
            "moe_hottest": load.moe_hottest[layer] if layer < len(load.moe_hottest) else -1,
            "moe_rank_imbalance": round(max(load.moe_rank_imbalance, default=0.0), 2),
            "moe_rebalances": load.num_expert_rebalances}


