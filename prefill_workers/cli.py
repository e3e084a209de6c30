"""`pdserve prefill-worker`: one prefill worker (one engine, one device)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from common.worker.options import add_worker_options

    parser = subparsers.add_parser(
        "prefill-worker", help="run one prefill worker (one engine, one device)",
        description="Computes prompts' KV, returns the first token at once, and pushes the "
                    "KV to the decode worker the gateway reserved. Registers itself in Redis.")
    add_worker_options(parser, "prefill")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from common.worker.main import run_worker
    from prefill_workers.main import build_role

    return run_worker(args, "prefill", build_role)
