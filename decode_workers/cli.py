"""`pdserve decode-worker`: one decode (or colocated) worker (one engine, one device)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from common.worker.options import add_worker_options

    parser = subparsers.add_parser(
        "decode-worker", help="run one decode worker (one engine, one device)",
        description="Reserves KV blocks for prompts prefilled elsewhere, receives their KV, "
                    "and streams the decoded tokens; prefills short prompts itself. "
                    "Registers itself in Redis.")
    add_worker_options(parser, "decode")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from common.worker.main import run_worker
    from decode_workers.main import build_role

    return run_worker(args, "decode", build_role)
