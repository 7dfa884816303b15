"""``python -m llmpar.launch [flags] script.py [args]``: the same as ``llmpar launch``, without loading the other
subcommands (and torch) in the launching process."""

from __future__ import annotations

import sys

from llmpar.launch.cli import build_parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` as ``llmpar launch``'s flags and run it; returns the exit status."""
    args = build_parser().parse_args(["launch", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
