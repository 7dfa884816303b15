"""The ``llmpar`` command. Each subcommand lives in its own module, which exposes ``register(subparsers)``."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, in the order `llmpar --help` lists them
_COMMAND_MODULES = (
    "llmpar.env_report",
    "llmpar.train",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
