"""`pdserve drill`: fault scenarios against a live cluster under load, and the table that
says whether it recovers (docs/operations.md, "Drills").

    pdserve drill --up-args "--prefill 1 --decode 2"          its own `pdserve up`, with
                                                              fault injection on
    pdserve drill --log-dir DIR --url http://127.0.0.1:8000   a running `pdserve up` on this
                                                              host (its tokens from DIR)

Prints a Markdown table on stdout (progress on stderr), writes JSON with --output, and
exits 1 when a row breaks its expectation, 2 when the drill could not run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from drill.scenario import SCENARIOS

DEFAULT_UP_ARGS = "--prefill 1 --decode 2 --threads-per-worker 1"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "drill", help="run fault scenarios against a cluster under load; print whether it "
                      "recovers",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("the cluster")
    where.add_argument("--up-args", default=None, metavar="ARGS",
                       help="start a `pdserve up` with these options and fault injection "
                            f'on, and stop it at the end (the default, with "{DEFAULT_UP_ARGS}")')
    where.add_argument("--log-dir", default=None, type=Path,
                       help="drill a running `pdserve up` instead: its --log-dir, where it "
                            "wrote the admin token (with --url). The slow, stall and fail scenarios "
                            "also need it started with PDSERVE_FAULT_INJECTION=1 and the "
                            "cluster's token in $PDSERVE_INTERNAL_TOKEN here")
    where.add_argument("--url", default=None,
                       help="the running cluster's gateway URL (with --log-dir)")
    where.add_argument("--ready-timeout-s", type=float, default=600.0,
                       help="how long its own cluster may take to start (default 600)")
    what = p.add_argument_group("scenarios")
    what.add_argument("--scenarios", default=None, metavar="NAME[,NAME...]",
                      help="which to run, in the table's order: "
                           f"{', '.join(s.name for s in SCENARIOS)} (default: every one the "
                           "cluster's layout allows)")
    what.add_argument("--before-s", type=float, default=5.0,
                      help="seconds of load before each fault (default 5)")
    what.add_argument("--after-s", type=float, default=5.0,
                      help="seconds of load after the recovery, whose share within its SLO "
                           "is judged against the share before the fault (default 5)")
    what.add_argument("--recovery-timeout-s", type=float, default=60.0,
                      help="a row fails unless the cluster is whole again this long after "
                           "the fault (default 60)")
    what.add_argument("--fault-s", type=float, default=10.0,
                      help="how long stall-transfer's, delay-decode's and partition-*'s "
                           "fault stays on (default 10; at most 120)")
    what.add_argument("--slow-step-ms", type=int, default=500,
                      help="slow-decode: added to each engine step (default 500)")
    what.add_argument("--stall-layer-ms", type=int, default=300,
                      help="stall-transfer: the wait before each layer pushed (default 300)")
    what.add_argument("--net-delay-ms", type=int, default=100,
                      help="delay-decode: added to the control port's traffic each way "
                           "(default 100)")
    what.add_argument("--net-loss", type=float, default=0.05,
                      help="delay-decode: the share of chunks lost and sent again 200 ms "
                           "late, as TCP would (default 0.05)")
    what.add_argument("--idle-timeout-s", type=float, default=30.0,
                      help="after the load, how long the workers may take to let go of "
                           "their KV blocks and reservations (default 30)")
    load = p.add_argument_group("load")
    load.add_argument("--workload", default="steady",
                      help="bench workload preset or TOML file (default steady: short chat "
                           "in the batch tier, so that nothing is shed for latency)")
    load.add_argument("--rate", type=float, default=1.0,
                      help="open-loop requests per second during each scenario (default 1)")
    load.add_argument("--check-tokens", type=int, default=16,
                      help="max_tokens of the answer checker's fixed prompts, asked one "
                           "after the other throughout (default 16)")
    load.add_argument("--request-timeout-s", type=float, default=120.0,
                      help="a request not done by then is a timeout error (default 120)")
    load.add_argument("--seed", type=int, default=0, help="requests and arrivals seed")
    p.add_argument("--output", default=None, type=Path,
                   help="also write the rows as JSON here (rewritten after each scenario)")
    when = p.add_argument_group("repeating, and where the rows go")
    when.add_argument("--schedule", type=float, default=None, metavar="SECONDS",
                      help="run the scenario list again this long after each round ends, "
                           "until stopped (Ctrl-C) or --rounds: drills on a staging cluster")
    when.add_argument("--rounds", type=int, default=None,
                      help="stop after this many rounds (default: 1, or unlimited with "
                           "--schedule)")
    when.add_argument("--metrics-port", type=int, default=None,
                      help="serve the drill's own metrics (pdserve_drill_*) at "
                           "http://127.0.0.1:PORT/metrics for Prometheus (0: a free port; "
                           "default: none)")
    when.add_argument("--redis-url", default=None,
                      help="the cluster's Redis, where each row goes to the audit log "
                           "(/admin/agent/events; default: $PDSERVE_REDIS_URL, else "
                           "LOG_DIR/redis-url of the `pdserve up` drilled)")
    when.add_argument("--namespace", default="pdserve",
                      help="the cluster's Redis key namespace (default pdserve)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import tempfile

    from drill.main import DrillSetup, drill_main
    from drill.up_cluster import UpCluster
    from protocol.agent_messages import FAULT_INJECTION_ENV
    from telemetry.options import INTERNAL_TOKEN_ENV

    bad = [f"{name} must be {bounds}" for name, ok, bounds in (
        ("--fault-s", 0 < args.fault_s <= 120, "in (0, 120]"),
        ("--net-delay-ms", 0 <= args.net_delay_ms <= 10_000, "in [0, 10000]"),
        ("--net-loss", 0 <= args.net_loss <= 1, "in [0, 1]"),
        ("--schedule", args.schedule is None or args.schedule >= 0, ">= 0"),
        ("--rounds", args.rounds is None or args.rounds >= 1, ">= 1"),
        ("--metrics-port", args.metrics_port is None or 0 <= args.metrics_port <= 65535,
         "in [0, 65535]")) if not ok]
    if bad:
        print(f"pdserve drill: {'; '.join(bad)}", file=sys.stderr)
        return 2
    if (args.log_dir is None) != (args.url is None):
        print("pdserve drill: --log-dir and --url go together", file=sys.stderr)
        return 2
    if args.log_dir is not None and args.up_args is not None:
        print("pdserve drill: --up-args starts its own cluster; not with --log-dir/--url",
              file=sys.stderr)
        return 2
    names = [n.strip() for n in args.scenarios.split(",")] if args.scenarios else None
    if args.log_dir is not None:
        from drill.target_cluster import read_admin_token

        try:
            admin = os.environ.get("PDSERVE_ADMIN_TOKEN") or read_admin_token(args.log_dir)
        except OSError as exc:
            print(f"pdserve drill: no admin token in {args.log_dir}: {exc}", file=sys.stderr)
            return 2
        setup = DrillSetup(args.url, admin, os.environ.get(INTERNAL_TOKEN_ENV), names,
                           redis_url_of(args, args.log_dir), args.namespace)
        return asyncio.run(drill_main(setup, args))
    up_args = DEFAULT_UP_ARGS if args.up_args is None else args.up_args
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-drill-"))
    with UpCluster(up_args, log_dir / "up.log", env={FAULT_INJECTION_ENV: "1"},
                   ready_timeout_s=args.ready_timeout_s, log_dir=log_dir / "logs") as up:
        try:
            up.wait_ready()
        except RuntimeError as exc:
            print(f"pdserve drill: {exc}", file=sys.stderr)
            return 2
        setup = DrillSetup(up.url, up.admin_token, up.token, names,
                           redis_url_of(args, log_dir / "logs"), args.namespace)
        return asyncio.run(drill_main(setup, args))


def redis_url_of(args: argparse.Namespace, log_dir: Path) -> str | None:
    """--redis-url, else $PDSERVE_REDIS_URL, else what `pdserve up` wrote in its log dir;
    with $PDSERVE_REDIS_PASSWORD put in where it carries no password, as every CLI does."""
    from state.redis_access import resolve_url
    from telemetry.options import REDIS_URL_FILE, env_default

    url = args.redis_url or env_default(os.environ, "--redis-url")
    if not url:
        try:
            url = (log_dir / REDIS_URL_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            return None
    return resolve_url(url, os.environ) if url else None
