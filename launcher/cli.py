"""`pdserve` command line: one subcommand per process kind or tool.

Each subcommand lives in its own module exposing `add_parser(subparsers)`, which registers
its options with argparse and sets `func` (called with the parsed namespace, returning an
exit code). Those modules keep heavy imports (torch, the engine) inside `func`, so
`--help` is fast; this module imports them all, so the import graph shows every command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from agent import cli as agent_cli
from bench import cli as bench_cli
from drill import cli as drill_cli
from engine import generate_cli
from gateway import cli as gateway_cli
from launcher import up_cli, worker_cli

# Every subcommand's `add_parser`, in the order `--help` lists them.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    generate_cli.add_parser,
    bench_cli.add_parser,
    worker_cli.add_prefill_parser,
    worker_cli.add_decode_parser,
    gateway_cli.add_parser,
    agent_cli.add_parser,
    up_cli.add_parser,
    drill_cli.add_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated LLM serving: prefill and decode worker pools behind an "
                    "SLO-aware OpenAI-compatible gateway.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
