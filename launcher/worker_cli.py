"""`pdserve prefill-worker` and `pdserve decode-worker`: one worker process each.

Both run the same any-role worker (worker/main.py); the subcommand sets the role it
starts in: `prefill-worker` starts as a prefill worker, `decode-worker --role R` as R
(decode, colocated, both or prefill). The role can change later without a restart
(POST /internal/role, or the gateway's POST /admin/workers/{id}/role).
"""

from __future__ import annotations

import argparse


def add_prefill_parser(subparsers: argparse._SubParsersAction) -> None:
    from worker.options import add_worker_options

    parser = subparsers.add_parser(
        "prefill-worker", help="run one worker that starts as a prefill worker",
        description="Computes prompts' KV, returns the first token at once, and pushes the "
                    "KV to the decode worker the gateway reserved. Registers itself in "
                    "Redis. Its role can be changed at run time (POST /internal/role).")
    add_worker_options(parser, "prefill")
    parser.set_defaults(func=lambda args: _run(args, "prefill"))


def add_decode_parser(subparsers: argparse._SubParsersAction) -> None:
    from worker.options import add_worker_options

    parser = subparsers.add_parser(
        "decode-worker", help="run one worker that starts as a decode (or --role) worker",
        description="Reserves KV blocks for prompts prefilled elsewhere, receives their KV, "
                    "and streams the decoded tokens; prefills prompts locally too. With "
                    "--role both it also prefills for other workers. Registers itself in "
                    "Redis. Its role can be changed at run time (POST /internal/role).")
    add_worker_options(parser, "decode")
    parser.set_defaults(func=lambda args: _run(args, "decode"))


def _run(args: argparse.Namespace, kind: str) -> int:
    from worker.main import build_role
    from worker.process import run_worker

    return run_worker(args, kind, build_role)
