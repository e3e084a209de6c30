"""`pdserve agent`: the operations agent (docs/operations.md).

Every option can also be set as PDSERVE_<OPTION> (e.g. --redis-url <-> PDSERVE_REDIS_URL);
the command line wins. The internal token comes from PDSERVE_INTERNAL_TOKEN only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from telemetry.log_format import LOG_FORMATS, configure_logging
from telemetry.options import REDIS_INSECURE_HELP, REDIS_URL_HELP, EnvOptions

RESTART_MODES = ("auto", "local", "exit", "kubernetes", "none")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    env = os.environ
    p = subparsers.add_parser(
        "agent", help="run the operations agent: detect, eject, restart, rebalance",
        description="Watch the workers of one cluster (the Redis registry, and each worker's "
                    "health report over its channel), eject a dead, hung, slow or failing worker from routing, "
                    "restart it, re-admit it after a probation, reclaim leaked KV "
                    "reservations and move workers between the prefill and decode roles "
                    "as the traffic shifts. Every decision goes to the audit trail: "
                    "--audit-log, GET /admin/agent/events on the gateway, and the "
                    "counters on this process's /metrics.")

    options = EnvOptions(p, env)
    opt = options.add

    def flag(name: str, help_text: str) -> None:
        options.flag(name, help=help_text)

    opt("--redis-url", help=REDIS_URL_HELP)
    flag("--redis-insecure", REDIS_INSECURE_HELP)
    opt("--namespace", "pdserve", help="Redis key namespace (default pdserve)")
    opt("--host", "127.0.0.1", help="address of this process's /health and /metrics "
                                    "(default 127.0.0.1)")
    opt("--port", "8300", type=int, help="their port; 0 picks a free one (default 8300)")
    opt("--restart", "auto", choices=RESTART_MODES,
        help="how a worker is restarted: local = ask the supervisor that started it and "
             "this agent (`pdserve up`) to kill and start it again; "
             "exit = ask it to exit, its orchestrator restarts it (compose); kubernetes = "
             "delete its pod; auto = local for workers on this host when there is a "
             "supervisor, else exit; none = eject only (default auto)")
    # Set by `pdserve up` only: this process's end of its supervisor's restart line (an
    # inherited descriptor: launcher/restart_line.py), through which --restart local asks
    # for a worker's restart. Not configuration, so no variable and no --help line.
    p.add_argument("--supervisor-fd", type=int, help=argparse.SUPPRESS)
    opt("--kube-namespace", help="with --restart kubernetes: the pods' namespace (default: "
                                 "this pod's own)")
    flag("--dry-run", "decide and record every decision, act on nothing")
    flag("--once", "observe for a few periods, print what would be done now (JSON lines "
                   "on stdout), act on nothing, and exit")
    opt("--audit-log", help="append every decision to this JSON-lines file")
    opt("--heartbeat-file", help="touch this file every second while the event loop turns "
        "(how `pdserve up` finds a frozen agent and restarts it)")
    opt("--period-s", "1.0", type=float, help="control loop period (default 1.0)")
    opt("--control-timeout-s", "1.5", type=float,
        help="deadline of each worker's health report: a worker missing it is not "
             "answering (default 1.5)")
    opt("--lease-margin-s", "1.0", type=float,
        help="a worker that does not answer and whose registry lease has less than this "
             "left is dead (default 1.0)")
    opt("--hung-after-s", "3.0", type=float,
        help="no engine step this long with requests running, or no answer this long: "
             "hung (default 3.0)")
    opt("--slow-factor", "3.0", type=float,
        help="a step time this many times the median of the role's other workers: slow "
             "(default 3.0)")
    opt("--slow-for-s", "10", type=float,
        help="slow only when an outlier at every tick this long (one busy moment of a "
             "shared host is not a slow worker) (default 10)")
    opt("--leak-after-s", "30", type=float,
        help="KV blocks held with nothing running this long: leaked, and reservations "
             "older than this are reclaimed (default 30)")
    opt("--error-rate", "0.5", type=float,
        help="this fraction of a worker's recent requests failed: an error spike (default 0.5)")
    opt("--error-min-requests", "10", type=int,
        help="an error spike needs at least this many recent requests (default 10)")
    opt("--max-eject-fraction", "0.5", type=float,
        help="never eject more than this fraction of a role's workers at once (at least "
             "one of two or more; a dead worker is always restarted) (default 0.5)")
    opt("--cooldown-s", "10", type=float,
        help="no second action on the same worker epoch within this (default 10)")
    opt("--probation-s", "10", type=float,
        help="an ejected or restarted worker is re-admitted after this long of passing "
             "health checks (default 10)")
    opt("--eject-hold-s", "300", type=float,
        help="an ejection lapses this long after the agent last renewed it, so a dead "
             "agent's ejections end by themselves (default 300)")
    opt("--rebalance", "on", choices=("on", "off"),
        help="move workers between the prefill and decode roles as the pools' queues "
             "shift (default on)")
    opt("--rebalance-period-s", "10", type=float,
        help="at most one rebalancing decision per this long (default 10)")
    opt("--role-drain-timeout-s", "30", type=float,
        help="a worker changing role finishes what its new role forbids within this "
             "(default 30)")
    opt("--plan", "on", choices=("on", "off"),
        help="forecast the demand on the pools and publish the workers it needs as the "
             "gauge pdserve_agent_desired_workers{role}, for an autoscaler (default on)")
    opt("--plan-act", "off", choices=("on", "off"),
        help="on: when the pools' pressure asks for no role move, move one worker at a time "
             "toward the plan's prefill/decode split, ahead of the demand (with the "
             "rebalancer's cooldown; needs --rebalance on and --plan on) (default off)")
    opt("--plan-horizon-s", "120", type=float,
        help="size the pools for the demand forecast this far ahead: about the time a new "
             "worker takes to start serving (default 120)")
    opt("--plan-tpot-ms", "50", type=float,
        help="the strictest TPOT target the decode pool is sized to hold (default 50: the "
             "shipped interactive tier's)")
    opt("--plan-prefill-busy", "0.7", type=float,
        help="the busy share a prefill worker is sized for; the rest is its queueing room "
             "(default 0.7)")
    opt("--plan-scale-down-s", "300", type=float,
        help="a smaller worker count is published only once every plan of this long asked "
             "for at most it (default 300)")
    opt("--reports", "on", choices=("on", "off"),
        help="root-cause reports: when a tier's attainment drops, say which stage grew, on "
             "which workers, and which change explains it (GET /admin/agent/reports on the "
             "gateway; default on)")
    opt("--report-attainment", "0.9", type=float,
        help="a tier whose attainment (met / finished requests) over the recent window is "
             "below this gets a root-cause report (default 0.9)")
    opt("--report-window-s", "10", type=float,
        help="the recent window a drop is judged over; the baseline is the 60 s before "
             "(default 10)")
    opt("--log-level", "info", help="debug | info | warning | error")
    opt("--log-format", "text", choices=LOG_FORMATS, help="text lines, or json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format, "agent",
                      "%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.redis_url:
        print("pdserve agent: --redis-url (or PDSERVE_REDIS_URL) is required, e.g. "
              "redis://127.0.0.1:6379/0", file=sys.stderr)
        return 2
    if args.restart == "local" and args.supervisor_fd is None:
        print("pdserve agent: --restart local restarts workers through the supervisor that "
              "started them (`pdserve up` passes --supervisor-fd); use exit, kubernetes or "
              "none", file=sys.stderr)
        return 2
    from agent.main import config_from_args, run_agent

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"pdserve agent: {exc}", file=sys.stderr)
        return 2
    from state.redis_access import RedisAccessError, check_access, resolve_url

    args.redis_url = resolve_url(args.redis_url, os.environ)
    try:
        for line in check_access(args.redis_url, args.redis_insecure):
            logging.getLogger(__name__).warning("%s", line)
    except RedisAccessError as exc:
        print(f"pdserve agent: {exc}", file=sys.stderr)
        return 2
    return run_agent(args, config)
