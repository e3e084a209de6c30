"""`pdserve bench`: measure latency, SLO attainment and goodput of any OpenAI-compatible server.

    pdserve bench run --url http://127.0.0.1:8000 --workload mixed --rate 4 --duration 60
    pdserve bench goodput --url http://127.0.0.1:8000 --workload mixed --output goodput.json

`run` drives one load (open loop at --rate, or closed loop at --concurrency) and prints the
per-tier table; `goodput` searches for the highest rate at which every tier keeps its SLO
attainment at or above the target, and prints the curve it measured. Both write JSON with
--output (schema in bench/report.py and goodput.py) and PNGs with --plot DIR.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_ATTAINMENT_TARGET = 0.9


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _add_common(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--url", default="http://127.0.0.1:8000",
                        help="server base URL; /v1 is appended (default: %(default)s)")
    server.add_argument("--api", choices=("chat", "completions"), default="chat",
                        help="endpoint: /v1/chat/completions or /v1/completions "
                             "(default: %(default)s)")
    server.add_argument("--model", default=None,
                        help="model name to send (default: the first one /v1/models lists)")
    server.add_argument("--api-key", default=None,
                        help="Bearer key for classes that set no api_key of their own")
    server.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                        help="extra HTTP header on every request (repeatable)")
    server.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos=true so outputs have exactly the planned length "
                             "(vLLM/SGLang/pdserve extension; plain OpenAI rejects it)")
    server.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature to send (default: the server's)")
    load = parser.add_argument_group("workload and load")
    load.add_argument("--workload", default="chat",
                      help="preset name (chat, rag, mixed, steady, multi_turn, long_chat, "
                           "shared_corpus) or path to a workload TOML file "
                           "(default: %(default)s)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed for requests and arrivals: the same seed sends the same "
                           "requests at the same times (default: %(default)s)")
    load.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson",
                      help="open-loop arrival process (default: %(default)s)")
    load.add_argument("--burstiness", type=_positive_float, default=1.0,
                      help="gamma shape: 1 = Poisson, <1 burstier, >1 smoother "
                           "(default: %(default)s)")
    load.add_argument("--duration", type=_positive_float, default=30.0, metavar="SECONDS",
                      help="stop sending after this long; in-flight requests then get up to "
                           "--request-timeout to finish (default: %(default)s)")
    load.add_argument("--num-requests", type=int, default=None,
                      help="also stop sending after this many requests (default: no limit; "
                           "--duration ends the run). A run this limit ends early says so")
    load.add_argument("--request-timeout", type=_positive_float, default=60.0,
                      metavar="SECONDS",
                      help="a request not finished by then counts as a timeout error "
                           "(default: %(default)s)")
    load.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="local tokenizer.json (or a model directory holding one) to cut "
                           "prompts on exact token counts; default: approximate by words")
    load.add_argument("--tokens-per-word", type=_positive_float, default=1.3,
                      help="words-to-tokens ratio used without --tokenizer "
                           "(default: %(default)s)")
    slo = parser.add_argument_group("SLOs")
    slo.add_argument("--slo", action="append", default=[], metavar="TIER:TTFT_MS:TPOT_MS",
                     help="SLO for a tier, overriding the workload file and the defaults "
                          "(interactive 250:50, standard 1000:100, batch 10000:250); "
                          "repeatable")
    slo.add_argument("--attainment-target", type=float, default=None,
                     help="share of requests per tier that must meet the SLO (default: the "
                          f"workload's, else {DEFAULT_ATTAINMENT_TARGET})")
    out = parser.add_argument_group("output")
    out.add_argument("--output", type=Path, default=None, metavar="FILE.json",
                     help="write the JSON report here")
    out.add_argument("--save-requests", action="store_true",
                     help="include every request's record in the JSON report")
    out.add_argument("--plot", type=Path, default=None, metavar="DIR",
                     help="write PNG plots into DIR (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure latency, SLO attainment and goodput of an OpenAI server",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="bench_command", metavar="MODE")
    run_parser = modes.add_parser(
        "run", help="one load run at a fixed rate or concurrency",
        description="Drive one bounded load run and report per-tier latency, throughput, "
                    "SLO attainment and errors.")
    _add_common(run_parser)
    pace = run_parser.add_mutually_exclusive_group(required=True)
    pace.add_argument("--rate", type=_positive_float, help="open loop: mean requests/s")
    pace.add_argument("--concurrency", type=int,
                      help="closed loop: this many requests in flight at all times")
    run_parser.set_defaults(func=_run_command)
    goodput_parser = modes.add_parser(
        "goodput", help="find the highest rate that meets every tier's SLO attainment",
        description="Bracket then bisect over the open-loop rate (same requests at every "
                    "rate) and report the highest rate at which every tier's SLO "
                    "attainment is at or above the target.")
    _add_common(goodput_parser)
    search = goodput_parser.add_argument_group("search")
    search.add_argument("--start-rate", type=_positive_float, default=1.0,
                        help="first rate tried, req/s (default: %(default)s)")
    search.add_argument("--min-rate", type=_positive_float, default=0.05,
                        help="give up below this rate (default: %(default)s)")
    search.add_argument("--max-rate", type=_positive_float, default=1000.0,
                        help="never try above this rate (default: %(default)s)")
    search.add_argument("--max-runs", type=int, default=8,
                        help="at most this many load runs (default: %(default)s)")
    search.add_argument("--rate-tolerance", type=float, default=0.1,
                        help="stop bisecting when pass and fail rates are within this share "
                             "of the failing rate (default: %(default)s)")
    goodput_parser.set_defaults(func=_goodput_command)
    parser.set_defaults(func=lambda args: (parser.print_help(sys.stderr), 2)[1])


def _run_command(args: argparse.Namespace) -> int:
    from bench.runner import BenchRunner

    try:
        runner = BenchRunner.from_args(args)
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    return runner.run_once(args.rate, args.concurrency)


def _goodput_command(args: argparse.Namespace) -> int:
    from bench.goodput import SearchParams
    from bench.runner import BenchRunner

    try:
        runner = BenchRunner.from_args(args)
        params = SearchParams(start_rate_rps=args.start_rate, min_rate_rps=args.min_rate,
                              max_rate_rps=args.max_rate, max_runs=args.max_runs,
                              rel_tolerance=args.rate_tolerance)
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    return runner.search(params)
