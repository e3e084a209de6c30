"""`pdserve agent` process: wiring only (the loop itself is agent/control_loop.py).

    config_from_args ─▶ run_agent: uvloop ─▶ serve():
        Redis client + RedisState (only entries bound by the cluster's secret) + AgentState,
        the workers' channels (rpc/), the supervisor's restart line (--supervisor-fd, from
        `pdserve up`), an aiohttp session for the Kubernetes API, the metrics registry,
        GET /health and /metrics on --host:--port ─▶ Observer, Actuator (with the restarter
        of --restart), Audit (--audit-log), the gateways' tally stream (root-cause
        reports, --reports) ─▶ ControlLoop.adopt() (ejections a previous
        agent left) ─▶ tick every --period-s until SIGTERM/SIGINT (--once: a few ticks in
        dry-run, the decisions printed on stdout, then exit)
        ─▶ stop: the role-change task, the leader lease (resigned), the audit file, the
           channels, the session, Redis and the HTTP runner, each within a deadline.

A tick that fails on Redis (unreachable, slow) is counted and logged once per outage; the
agent acts on nothing until Redis answers again (it never acts on a stale view).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.actuator import Actuator
from agent.audit import Audit
from agent.capacity_plan import PlanConfig
from agent.control_loop import AgentConfig, ControlLoop
from agent.health_rules import Thresholds
from agent.observer import Observer
from agent.rebalance import RebalanceConfig
from agent.restarters import RestartMode, make_restarter
from agent.root_cause_window import RootCauseConfig
from agent.root_cause_watch import RootCauseWatch
from protocol.cluster_secret import KeyPurpose, derive_optional_key
from rpc.channel_client import ChannelPool
from state.agent_state import AgentState
from state.redis_state import REDIS_FAILURES, RedisState, connect, raise_if_cancelling
from state.tier_tallies import TallyStream
from telemetry.heartbeat import Heartbeat
from telemetry.metrics import MetricsRegistry
from telemetry.options import INTERNAL_TOKEN_ENV

log = logging.getLogger(__name__)


# option -> (the check on its value, what the message says it must be)
_CHECKS: dict[str, tuple[Callable[[float], bool], str]] = {
    "--period-s": (lambda v: 0 < v <= 60, "in (0, 60]"),
    "--control-timeout-s": (lambda v: 0 < v <= 60, "in (0, 60]"),
    "--lease-margin-s": (lambda v: v > 0, "> 0"),
    "--hung-after-s": (lambda v: v > 0, "> 0"),
    "--slow-factor": (lambda v: v > 1, "> 1"),
    "--slow-for-s": (lambda v: 0 < v <= 600, "in (0, 600]"),
    "--leak-after-s": (lambda v: 1 <= v <= 3600, "in [1, 3600]"),
    "--error-rate": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "--error-min-requests": (lambda v: v >= 1, ">= 1"),
    "--max-eject-fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "--cooldown-s": (lambda v: v > 0, "> 0"),
    "--probation-s": (lambda v: v > 0, "> 0"),
    "--eject-hold-s": (lambda v: v >= 10, ">= 10"),
    "--rebalance-period-s": (lambda v: v > 0, "> 0"),
    "--role-drain-timeout-s": (lambda v: 0 < v <= 3600, "in (0, 3600]"),
    "--plan-horizon-s": (lambda v: 0 < v <= 3600, "in (0, 3600]"),
    "--plan-tpot-ms": (lambda v: 0 < v <= 60_000, "in (0, 60000]"),
    "--plan-prefill-busy": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "--plan-scale-down-s": (lambda v: 0 < v <= 86_400, "in (0, 86400]"),
    "--report-attainment": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "--report-window-s": (lambda v: 1 <= v <= 600, "in [1, 600]"),
}


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """The loop's configuration; ValueError naming the option when a value is nonsense."""
    for option, (ok, must) in _CHECKS.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if not ok(value):
            raise ValueError(f"{option} must be {must}, got {value:g}")
    thresholds = Thresholds(lease_margin_s=args.lease_margin_s, hung_after_s=args.hung_after_s,
                            slow_factor=args.slow_factor, slow_for_s=args.slow_for_s,
                            leak_after_s=args.leak_after_s,
                            error_rate=args.error_rate,
                            error_min_requests=args.error_min_requests)
    window_s = max(30.0, 4 * args.hung_after_s, 2 * args.slow_for_s)
    return AgentConfig(period_s=args.period_s, window_s=window_s,
                       thresholds=thresholds, max_eject_fraction=args.max_eject_fraction,
                       cooldown_s=args.cooldown_s, probation_s=args.probation_s,
                       dry_run=args.dry_run or args.once,
                       rebalance=RebalanceConfig() if args.rebalance == "on" else None,
                       rebalance_period_s=args.rebalance_period_s,
                       role_drain_timeout_s=args.role_drain_timeout_s,
                       plan=PlanConfig(horizon_s=args.plan_horizon_s,
                                       tpot_s=args.plan_tpot_ms / 1000,
                                       prefill_busy=args.plan_prefill_busy,
                                       scale_down_after_s=args.plan_scale_down_s,
                                       act=args.plan_act == "on")
                       if args.plan == "on" else None,
                       root_cause=RootCauseConfig(attainment_target=args.report_attainment,
                                                  recent_s=args.report_window_s)
                       if args.reports == "on" else None)


def run_agent(args: argparse.Namespace, config: AgentConfig) -> int:
    import uvloop

    return uvloop.run(serve(args, config))


async def serve(args: argparse.Namespace, config: AgentConfig) -> int:
    token = os.environ.get(INTERNAL_TOKEN_ENV) or None
    # The restart line `pdserve up` gave this process (launcher/restart_line.py), if any.
    supervisor = None if args.supervisor_fd is None else \
        socket.socket(fileno=args.supervisor_fd)
    metrics = MetricsRegistry()
    # The agent acts only on entries bound by the cluster's secret (protocol/cluster_secret.py).
    state = RedisState(connect(args.redis_url), args.namespace,
                       entry_key=derive_optional_key(token, KeyPurpose.REGISTRY))
    agent_state = AgentState(state)
    session = aiohttp.ClientSession()
    channels = ChannelPool(token)
    audit = Audit(agent_state, metrics, Path(args.audit_log) if args.audit_log else None,
                  echo=sys.stdout if args.once else None)
    runner: web.AppRunner | None = None
    heartbeat: Heartbeat | None = None
    loop_ = None
    try:
        audit.open()
        restarter = make_restarter(RestartMode(args.restart), session, channels,
                                   args.kube_namespace, supervisor)
        actuator = Actuator(agent_state, restarter, channels, eject_hold_s=args.eject_hold_s)
        observer = Observer(state, channels, control_timeout_s=args.control_timeout_s)
        watch = None if config.root_cause is None else \
            RootCauseWatch(config.root_cause, TallyStream(state))
        loop_ = ControlLoop(observer, actuator, audit, config, metrics, watch)
        if args.once:
            return await _once(loop_, config)
        runner = await _start_http(metrics, args.host, args.port)
        if args.heartbeat_file:
            heartbeat = Heartbeat(Path(args.heartbeat_file))
            heartbeat.start()
        await _run(loop_, config)
        return 0
    finally:
        if heartbeat is not None:
            await heartbeat.stop()
        if loop_ is not None:
            await loop_.stop()
            if loop_.is_leader and not config.dry_run:
                try:
                    await agent_state.resign(loop_.agent_id, timeout_s=1.0)
                except REDIS_FAILURES:
                    pass  # the lease lapses by itself
        audit.close()
        await channels.aclose()
        await session.close()
        await state.aclose()
        if runner is not None:
            await runner.cleanup()
        if supervisor is not None:
            supervisor.close()


async def _start_http(metrics: MetricsRegistry, host: str, port: int) -> web.AppRunner:
    app = web.Application(client_max_size=4096)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def render(request: web.Request) -> web.Response:
        return web.Response(text=metrics.render(), content_type="text/plain")

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", render)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    print(f"pdserve agent: /metrics on http://{bound[0]}:{bound[1]}", file=sys.stderr,
          flush=True)
    return runner


async def _run(loop_: ControlLoop, config: AgentConfig) -> None:
    stop = asyncio.Event()
    running = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        running.add_signal_handler(signum, stop.set)
    adopted = False
    failing = False
    next_at = time.monotonic()
    while not stop.is_set():
        try:
            if not adopted:
                await loop_.adopt()
                adopted = True
            await loop_.tick()
            if failing:
                log.info("Redis answers again: acting on the cluster")
            failing = False
        except REDIS_FAILURES as exc:
            raise_if_cancelling(exc)
            loop_.ticks.inc(result="redis_failed")
            if not failing:
                log.warning("Redis unreachable (%r): acting on nothing until it answers", exc)
            failing = True
        next_at = max(next_at + config.period_s, time.monotonic())
        try:
            async with asyncio.timeout(max(0.0, next_at - time.monotonic())):
                await stop.wait()
        except TimeoutError:
            pass


async def _once(loop_: ControlLoop, config: AgentConfig) -> int:
    """A few ticks (enough for the windowed rules), decisions printed as they are made."""
    num_ticks = max(2, math.ceil(config.thresholds.hung_after_s / config.period_s) + 1)
    for index in range(num_ticks):
        try:
            await loop_.tick()
        except REDIS_FAILURES as exc:
            raise_if_cancelling(exc)
            print(f"pdserve agent: Redis unreachable: {exc}", file=sys.stderr)
            return 1
        if index + 1 < num_ticks:
            await asyncio.sleep(config.period_s)
    registry = loop_.observer.registry
    print(f"pdserve agent: {len(registry.workers)} live worker(s), "
          f"{len(loop_.out_ids)} ejected; nothing was done (--once)", file=sys.stderr)
    return 0
