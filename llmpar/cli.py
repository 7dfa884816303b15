"""The ``llmpar`` command. Each subcommand lives in its own module, which exposes ``register(subparsers)``.

A subcommand whose module fails to import (a missing optional dependency, a broken install) does not take the
others down: it stays listed and explains the import error when invoked, so ``llmpar env`` always runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

# subcommand modules, in the order `llmpar --help` lists them
_COMMAND_MODULES = (
    "llmpar.env_report",
    "llmpar.train",
    "llmpar.planning.cli",
    "llmpar.checkpoint.cli",
    "llmpar.launch",
)


def _broken(module: str, err: BaseException, sub: argparse._SubParsersAction) -> None:
    name = module.rsplit(".", 1)[-1]
    detail = "".join(traceback.format_exception_only(type(err), err)).strip()

    def fail(args: argparse.Namespace) -> int:
        print(f"llmpar: the module {module} could not be imported: {detail}", file=sys.stderr)
        return 2

    p = sub.add_parser(name, help=f"(unavailable: {detail})", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=fail)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpar", description="llmpar: parallel LLM training on plain PyTorch")
    # DeepSpeed's launcher (and `llmpar launch`) put --local_rank=N right after the program: `--module llmpar.cli`
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - reported when the command is used
            _broken(name, err, sub)
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
