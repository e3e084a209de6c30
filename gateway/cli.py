"""`pdserve gateway`: the OpenAI-compatible gateway in front of the worker pools.

Every option can also be set as PDSERVE_<OPTION> (e.g. --redis-url ↔ PDSERVE_REDIS_URL);
the command line wins. The environment is read when the parser is built, not at import.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from telemetry.log_format import LOG_FORMATS, configure_logging
from telemetry.options import (ADMIN_TOKEN_ENV, INTERNAL_TOKEN_ENV, REDIS_INSECURE_HELP,
                               REDIS_URL_HELP, EnvOptions)
from telemetry.tracing import ENDPOINT_ENV


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    env = os.environ
    p = subparsers.add_parser(
        "gateway", help="run the OpenAI-compatible gateway",
        description="Serve /v1/completions and /v1/chat/completions, routing each request "
                    "to prefill/decode workers found in the Redis registry.")

    options = EnvOptions(p, env)
    opt = options.add

    opt("--host", "127.0.0.1", help="address to bind (default 127.0.0.1)")
    opt("--port", "8000", type=int, help="port to bind; 0 picks a free one (default 8000)")
    opt("--redis-url", help=REDIS_URL_HELP)
    options.flag("--redis-insecure", help=REDIS_INSECURE_HELP)
    opt("--model-name", help="served model id (default: the model's name)")
    opt("--tiers", help="TOML file with SLO tiers and API keys (default: built-in tiers)")
    opt("--tokenizer-model", "default",
        help='model path or "default" whose tokenizer and context length the gateway uses')
    opt("--max-body-bytes", str(4 * 1024 * 1024), type=int, help="request body limit")
    opt("--body-timeout-s", "30", type=float,
        help="a request body must arrive within this, else 408 (default 30)")
    opt("--max-prompt-tokens", type=int, help="prompt length limit (default: context - 1)")
    opt("--max-running", "1024", type=int, help="requests admitted at once, all tiers")
    opt("--max-queued", "4096", type=int, help="requests queued for admission, all tiers")
    opt("--drain-timeout-s", "30", type=float,
        help="on SIGTERM/SIGINT: stop accepting, let running requests finish for this long, "
             "then end each remaining stream with an error event and [DONE] (default 30)")
    opt("--max-attempts", "4", type=int,
        help="attempts per request when workers fail: retries before the first token, "
             "migrations of a running stream to another decode worker after it; 1 turns "
             "both off (default 4)")
    opt("--worker-wait-s", "15", type=float,
        help="with no worker to route a request to (one restarting, say), wait this long "
             "for one before answering 503 (default 15)")
    opt("--expect-workers", "0", type=int,
        help="not ready (/ready and the API answer 503 \"starting\") until this many workers "
             "have registered; `pdserve up` passes the number it starts (default 0: ready "
             "with the first decode worker)")
    opt("--kv-wait-s", "60", type=float,
        help="a decode worker whose KV cache is full queues a request's reservation this "
             "long for free blocks (by tier priority) before the gateway tries elsewhere or "
             "answers 503 (default 60)")
    opt("--admission", "adaptive", choices=("adaptive", "static"),
        help="adaptive: the concurrency limit is cut when a tier misses its TTFT target, and "
             "lower tiers are shed early only while the most urgent tier is predicted or "
             "measured to miss its own; static: --max-running fixed, tiers shed only when "
             "their own deadline cannot be met (default adaptive)")
    opt("--shared-limits", "on", choices=("on", "off"),
        help="on: tier concurrency and queue limits and per-key token rates are held in "
             "Redis, so every gateway replica of the namespace together admits what one "
             "would (one Redis round trip per admission); off: this process's own limits "
             "(default on)")
    opt("--replicas", "1", type=int,
        help="gateway replicas this one is part of; while Redis is unreachable each admits "
             "1/N of every limit on its own, N being the larger of this and the replicas "
             "last seen live in Redis (default 1)")
    options.flag("--reuse-port",
                 help="listen with SO_REUSEPORT, so several replicas share --port and the "
                      "kernel spreads connections among them (`pdserve up --gateways N`)")
    opt("--heartbeat-file", None,
        help="touch this file every second while the event loop turns (how `pdserve up` "
             "finds a frozen gateway and restarts it)")
    opt("--namespace", "pdserve", help="Redis key namespace (default pdserve)")
    opt("--log-level", "info", help="debug | info | warning | error")
    opt("--log-format", "text", choices=LOG_FORMATS,
        help="text lines, or json: one object per line with the request id where there is "
             "one (default text)")
    p.add_argument("--otlp-endpoint",
                   default=env.get("PDSERVE_OTLP_ENDPOINT") or env.get(ENDPOINT_ENV),
                   help="OpenTelemetry traces: OTLP/HTTP base URL to export one trace per "
                        "request to, e.g. http://127.0.0.1:4318 (needs the tracing extra); "
                        f"unset: no traces (default: $PDSERVE_OTLP_ENDPOINT or ${ENDPOINT_ENV})")
    p.add_argument("--internal-token", default=env.get(INTERNAL_TOKEN_ENV),
                   help=f"token for the workers' control API (default: ${INTERNAL_TOKEN_ENV})")
    p.add_argument("--admin-token", default=env.get(ADMIN_TOKEN_ENV),
                   help="the cluster's admin token: role changes need it (or an admin API "
                        "key), and so do the /admin views of a gateway that listens beyond "
                        "loopback or has API keys; unset and no admin key: role changes "
                        f"are off (prefer the {ADMIN_TOKEN_ENV} environment variable to "
                        f"the option; default: ${ADMIN_TOKEN_ENV})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format, "gateway",
                      "%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.redis_url:
        print("pdserve gateway: --redis-url (or PDSERVE_REDIS_URL) is required, e.g. "
              "redis://127.0.0.1:6379/0; `pdserve up` starts one for you", file=sys.stderr)
        return 2
    tiers_toml = None
    if args.tiers:
        try:
            with open(args.tiers, encoding="utf-8") as f:
                tiers_toml = f.read()
        except OSError as exc:
            print(f"pdserve gateway: cannot read --tiers file: {exc}", file=sys.stderr)
            return 2
    from gateway.admission.tiers import TierConfigError
    from gateway.api.model_files import ModelFileError
    from gateway.main import GatewayConfig
    from gateway.main import run as run_gateway
    from gateway.routing.retry_policy import RetryLimits
    from gateway.upstream.handoff import UpstreamTimeouts

    try:
        retry_limits = RetryLimits(max_attempts=args.max_attempts)
    except ValueError as exc:
        print(f"pdserve gateway: --max-attempts: {exc}", file=sys.stderr)
        return 2
    if args.worker_wait_s < 0:
        print("pdserve gateway: --worker-wait-s must be >= 0", file=sys.stderr)
        return 2
    if args.expect_workers < 0:
        print("pdserve gateway: --expect-workers must be >= 0", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("pdserve gateway: --replicas must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.kv_wait_s <= 600:
        print("pdserve gateway: --kv-wait-s must be within 0..600", file=sys.stderr)
        return 2
    from state.redis_access import RedisAccessError, check_access, resolve_url

    redis_url = resolve_url(args.redis_url, os.environ)
    try:
        for line in check_access(redis_url, args.redis_insecure):
            logging.getLogger(__name__).warning("%s", line)
    except RedisAccessError as exc:
        print(f"pdserve gateway: {exc}", file=sys.stderr)
        return 2
    config = GatewayConfig(
        redis_url=redis_url, host=args.host, port=args.port,
        tokenizer_model=args.tokenizer_model, model_name=args.model_name,
        tiers_toml=tiers_toml, env=dict(os.environ), namespace=args.namespace,
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_running=args.max_running, max_queued=args.max_queued,
        retry_limits=retry_limits, drain_timeout_s=args.drain_timeout_s,
        body_timeout_s=args.body_timeout_s,
        timeouts=UpstreamTimeouts(worker_wait_s=args.worker_wait_s,
                                  kv_wait_ms=int(args.kv_wait_s * 1000)),
        adaptive_admission=args.admission == "adaptive", expect_workers=args.expect_workers,
        internal_token=args.internal_token or None, admin_token=args.admin_token or None,
        otlp_endpoint=args.otlp_endpoint or None,
        shared_limits=args.shared_limits == "on", replicas_hint=args.replicas,
        reuse_port=args.reuse_port,
        heartbeat_file=Path(args.heartbeat_file) if args.heartbeat_file else None)
    try:
        run_gateway(config)
    except (ModelFileError, TierConfigError, OSError) as exc:
        print(f"pdserve gateway: {exc}", file=sys.stderr)
        return 1
    return 0
