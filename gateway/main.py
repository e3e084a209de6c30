"""`pdserve gateway` process: wiring only. Runs the OpenAI-compatible HTTP API on uvloop.

    GatewayConfig ─▶ make_app(): model facts + tokenizer (no weights), tiers, admission gate,
                     WorkerBackend ─▶ ClusterView (Redis registry/load polling, prefix-index
                     mirror, purges) ─▶ the aiohttp app (gateway/api/http_api.py + ops_api.py)
    serve(): GatewayRunner (client hang-up cancels its handler) → print the URL → wait for
             SIGINT/SIGTERM → stop listening → drain (gateway/api/drain.py: running requests
             finish within --drain-timeout-s, the rest end with an error and [DONE])
             → runner.cleanup() runs the cleanup_ctx below.

Lifecycle of the owned resources (one cleanup_ctx, `_owned_resources`): on startup the
channels to the workers (opened on first use), the Redis client, the cluster view (its poll
task and the mirror's task) and the concurrency governor (gateway/admission/capacity.py)
start; the shared-limits sync (gateway/admission/shared_limits.py) and the tier tallies'
publisher (gateway/ops/tier_tally_book.py, the operations agent's view of the requests)
start last; on shutdown
they stop in reverse order (the sync hands this replica's slots back first) and every
pending abort is awaited or cancelled, so no task outlives the app.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from redis.asyncio import Redis

from gateway.admission.admission import AdmissionController
from gateway.admission.capacity import (CapacityBounds, CapacityGovernor, GateState, TtftWindow,
                                        limit_tiers)
from gateway.admission.limit_store import LimitStore
from gateway.admission.rate_limit import TokenRateLimiter
from gateway.admission.shared_limits import SharedLimits
from gateway.admission.tiers import load_tier_config
from gateway.api.admission_gate import AdmissionGate
from gateway.api.grammar_check import GrammarCheck
from gateway.api.http_api import DRAIN, ApiSettings, create_app
from gateway.api.http_server import GatewayRunner
from gateway.api.metrics import GatewayMetrics
from gateway.api.model_files import read_model_info
from gateway.api.prompt_tokenizer import GatewayTokenizer
from gateway.api.request_parsing import RequestLimits
from gateway.api.slo_accounting import SloOutcome
from gateway.ops import cluster_page, startup
from gateway.ops.admin_access import AdminAccess
from gateway.ops.ops_api import install
from gateway.ops.startup import StartupGate
from gateway.ops.tier_tally_book import TierTallyBook
from gateway.routing.retry_policy import RetryLimits
from gateway.upstream.cluster import ClusterView
from gateway.upstream.handoff import UpstreamTimeouts
from gateway.upstream.upstream import WorkerBackend
from protocol.cluster_secret import KeyPurpose, derive_optional_key
from rpc.channel_client import ChannelPool
from state.agent_state import AgentState
from state.prefix_index_mirror import PrefixIndexMirror
from state.redis_state import RedisState, connect
from state.tier_tallies import TallyStream
from telemetry.heartbeat import Heartbeat
from telemetry.start_up_heap import freeze_start_up_heap
from telemetry.tracing import Tracing, start_tracing
from text.grammar import GrammarCompiler

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer_model: str = "default"
    model_name: str | None = None  # None: the model's own name
    tiers_toml: str | None = None  # the tiers file's text
    env: Mapping[str, str] | None = None  # where API keys named by the tiers file are read
    namespace: str = "pdserve"
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int | None = None
    max_running: int = 1024
    max_queued: int = 4096
    internal_token: str | None = None
    admin_token: str | None = None  # the /admin API's (gateway/ops/admin_access.py)
    drain_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    timeouts: UpstreamTimeouts = UpstreamTimeouts()
    retry_limits: RetryLimits = RetryLimits()
    adaptive_admission: bool = True  # False: a fixed limit (max_running), no early shedding
    expect_workers: int = 0  # not ready (/ready, /v1/*) until this many workers registered
    otlp_endpoint: str | None = None  # traces to this OTLP/HTTP base URL (None: off)
    # Admission limits held in Redis, shared with every replica of the cluster (a
    # namespace); the hint is the N of the 1/N fallback while Redis is unreachable.
    shared_limits: bool = True
    replicas_hint: int = 1
    reuse_port: bool = False  # SO_REUSEPORT: several replicas listen on one port
    heartbeat_file: Path | None = None  # touched every second (telemetry/heartbeat.py)


async def make_app(config: GatewayConfig) -> web.Application:
    """The gateway app; call inside the running loop (the session binds to it)."""
    info, engine_tokenizer = read_model_info(config.tokenizer_model)
    tiers = load_tier_config(config.tiers_toml, config.env or {})
    if tiers.is_open:
        log.warning("no API keys configured: the API is open to anyone who can reach %s:%d",
                    config.host, config.port)
        if not config.admin_token:
            log.warning("no admin token (PDSERVE_ADMIN_TOKEN) and no admin API key: role "
                        "changes are off")
    names = [config.model_name or info.name]
    names += [n for n in (info.name, config.tokenizer_model) if n not in names]
    settings = ApiSettings(
        served_models=tuple(names), created_at=int(time.time()),
        limits=RequestLimits(max_model_len=info.max_model_len,
                             max_prompt_tokens=config.max_prompt_tokens,
                             vocab_size=info.vocab_size, max_body_bytes=config.max_body_bytes),
        body_timeout_s=config.body_timeout_s)
    # Only entries bound by the cluster's secret are routed to (protocol/cluster_secret.py).
    state = RedisState(connect(config.redis_url), namespace=config.namespace,
                       entry_key=derive_optional_key(config.internal_token, KeyPurpose.REGISTRY))
    # Its own few connections: a burst of admissions queues for them (within the store's
    # deadline) instead of opening one connection per request.
    limits_client = (connect(config.redis_url, max_connections=16, wait_s=0.25)
                     if config.shared_limits else None)
    shared = (SharedLimits(LimitStore(limits_client, config.namespace), time.monotonic,
                           replicas_hint=config.replicas_hint)
              if limits_client is not None else None)
    gate = AdmissionGate(
        AdmissionController(tuple(tiers.tiers.values()), max_running_total=config.max_running,
                            max_queued_total=config.max_queued, clock=time.monotonic),
        TokenRateLimiter(time.monotonic), shared)
    tokenizer = GatewayTokenizer(engine_tokenizer)
    metrics = GatewayMetrics(tiers.tiers, (o.value for o in SloOutcome))
    cluster = ClusterView(state, PrefixIndexMirror(state), random.Random(),
                          agent_state=AgentState(state))
    channels = ChannelPool(config.internal_token)
    window = TtftWindow()
    backend = WorkerBackend(cluster, tokenizer, channels, metrics,
                            timeouts=config.timeouts, limits=config.retry_limits,
                            ttft_window=window)
    controller = gate.controller
    governor = CapacityGovernor(
        window, {t.name: t.ttft_ms / 1000 for t in tiers.tiers.values()},
        controller.urgent_tiers,
        lambda: GateState(controller.max_running_total, controller.num_running,
                          controller.num_queued, controller.num_queued_urgent(),
                          controller.urgent_wait_s()),
        gate.set_capacity, gate.set_protection,
        CapacityBounds(max_limit=config.max_running),
        limit_tiers=limit_tiers(tiers.tiers.values()))
    tracing = start_tracing("pdserve-gateway", config.otlp_endpoint)
    grammars = GrammarCheck(GrammarCompiler(engine_tokenizer, info.vocab_size))
    app = create_app(settings, tiers, backend, tokenizer, gate, tracing=tracing,
                     grammars=grammars)
    tallies = TierTallyBook(TallyStream(state))
    install(app, cluster, backend, metrics,
            AdminAccess.for_host(config.admin_token, config.host), tallies)
    cluster_page.install(app)
    startup.install(app, StartupGate(config.expect_workers, cluster.num_registered))
    app.cleanup_ctx.append(_owned_resources(cluster, backend, channels, state,
                                            governor, config.adaptive_admission, tracing,
                                            shared, limits_client, tallies))
    return app


def _owned_resources(cluster: ClusterView, backend: WorkerBackend, channels: ChannelPool,
                     state: RedisState, governor: CapacityGovernor, adaptive: bool,
                     tracing: Tracing, shared: SharedLimits | None,
                     limits_client: Redis | None, tallies: TierTallyBook,
                     ) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        await cluster.start()
        if adaptive:
            governor.start()
        if shared is not None:
            shared.start()
        tallies.start()
        try:
            yield
        finally:
            await tallies.stop()  # after the drain: the last requests' tally goes out
            if shared is not None:
                await shared.stop()  # after the drain: hands this replica's slots back
            if limits_client is not None:
                await limits_client.aclose()
            await governor.stop()
            await cluster.stop()
            await backend.aclose()
            await channels.aclose()
            await state.aclose()
            await tracing.shutdown()  # exports the spans still queued

    return ctx


async def serve(config: GatewayConfig, on_listening: Callable[[str], None] = print) -> None:
    """Run until SIGINT or SIGTERM; `on_listening` gets the bound URL (port 0 resolved)."""
    app = await make_app(config)
    # handler_cancellation: a client that hangs up cancels its handler at once, which is
    # what aborts its request on the workers within milliseconds.
    # GatewayRunner: what aiohttp's parser refuses is answered as an OpenAI error too.
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0)
    await runner.setup()
    # What start-up allocated (tokenizer, tiers, modules) lives as long as the process: out
    # of the collector's sight, and the young generation collected less often, so the
    # per-token allocations of many streams do not trigger a collection every few tokens.
    freeze_start_up_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    heartbeat = None if config.heartbeat_file is None else Heartbeat(config.heartbeat_file)
    try:
        if heartbeat is not None:
            heartbeat.start()
        site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port or None)
        await site.start()
        host, port = runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in host else host
        on_listening(f"http://{shown}:{port}")
        await stop.wait()
        log.info("shutting down: draining up to %.0f s", config.drain_timeout_s)
        await site.stop()  # no new connections; kept-alive ones get 503 for new requests
        num_cut = await app[DRAIN].drain(config.drain_timeout_s)
        log.info("drained (%d stream(s) ended early)", num_cut)
    finally:
        if heartbeat is not None:
            await heartbeat.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def run(config: GatewayConfig) -> None:
    import uvloop

    uvloop.run(serve(config, on_listening=lambda url: print(f"pdserve gateway listening on {url}",
                                                             flush=True)))
