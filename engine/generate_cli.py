"""`pdserve generate`: single-process generation with the default or a given model."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text from a prompt in one process")
    parser.add_argument("prompt", help="the prompt text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("pdserve generate: not available yet")
