"""`pdserve prefill-worker` and `pdserve decode-worker`: one worker process each.

Both run the same worker (worker/main.py); the subcommand sets the role it starts in
unless `--role` says else: `prefill-worker` starts as a prefill worker, `decode-worker` as
a decode worker. The role can change later without a restart (the gateway's POST
/admin/workers/{id}/role).
"""

from __future__ import annotations

import argparse

from protocol.messages import Role


def add_prefill_parser(subparsers: argparse._SubParsersAction) -> None:
    from worker.options import add_worker_options

    parser = subparsers.add_parser(
        "prefill-worker", help="run one worker that starts as a prefill worker",
        description="Computes prompts' KV, returns the first token at once, and pushes the "
                    "KV to the decode worker the gateway reserved. Registers itself in "
                    "Redis. Its role can be changed at run time (the gateway's "
                    "POST /admin/workers/ID/role).")
    add_worker_options(parser, Role.PREFILL)
    parser.set_defaults(func=_run, prog=parser.prog)


def add_decode_parser(subparsers: argparse._SubParsersAction) -> None:
    from worker.options import add_worker_options

    parser = subparsers.add_parser(
        "decode-worker", help="run one worker that starts as a decode (or --role) worker",
        description="Reserves KV blocks for prompts prefilled elsewhere, receives their KV, "
                    "and streams the decoded tokens; prefills prompts locally too. With "
                    "--role both it also prefills for other workers. Registers itself in "
                    "Redis. Its role can be changed at run time (the gateway's "
                    "POST /admin/workers/ID/role).")
    add_worker_options(parser, Role.DECODE)
    parser.set_defaults(func=_run, prog=parser.prog)


def _run(args: argparse.Namespace) -> int:
    from worker.main import build_role
    from worker.process import run_worker

    return run_worker(args, build_role)
