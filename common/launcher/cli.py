"""`pdserve` command line: one subcommand per process kind or tool.

Each subcommand lives in its own module exposing `add_parser(subparsers)`, which registers
its options with argparse and sets `func` (called with the parsed namespace, returning an
exit code). Modules keep heavy imports (torch, the engine) inside `func`, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module path) for every subcommand, in the order `--help` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "engine.generate_cli",
    "benchmarks.bench_cli",
    "prefill_workers.cli",
    "decode_workers.cli",
    "gateway.cli",
    "common.launcher.up_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated LLM serving: prefill and decode worker pools behind an "
                    "SLO-aware OpenAI-compatible gateway.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
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
