"""The code blocks of README.md and docs/*.md, as tests/test_docs.py runs them.

A block is a fenced ``python`` or ``json`` block. An HTML comment on the line before the fence (invisible in the
rendered page) says how to run it::

    <!-- docs-test: ranks=2 setup=tp -->        run on 2 ranks, after the setup "tp" of tests/docs_setup.py
    <!-- docs-test: skip: the reason -->        not run here (a GPU, a cluster): the reason is required

Without a comment a ``python`` block runs on one rank with no setup. Every block runs in a fresh namespace in a
scratch working directory shared by its ranks; a ``json`` block must parse, and one that holds DeepSpeed keys must
be a config ``llmpar.initialize`` accepts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MARK = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)```(\w*)(.*)$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    ranks: int = 1
    setup: str | None = None
    skip: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _parse_mark(text: str, where: str) -> dict[str, str]:
    if text.startswith("skip"):
        reason = text[4:].lstrip(": ").strip()
        if not reason:
            raise ValueError(f"{where}: 'docs-test: skip' needs a reason ('skip: why')")
        return {"skip": reason}
    out = {}
    for part in text.split():
        key, eq, value = part.partition("=")
        if not eq or key not in ("ranks", "setup"):
            raise ValueError(f"{where}: docs-test option {part!r} is not known (ranks=N, setup=NAME, skip: why)")
        out[key] = value
    return out


def blocks_of(path: Path) -> list[Block]:
    """The python and json blocks of one Markdown file, with their docs-test marks."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].startswith(indent + "```"):
            j += 1
        if lang in ("python", "json"):
            mark = _MARK.match(lines[i - 1]) if i > 0 else None
            opts = _parse_mark(mark.group(1), f"{path.name}:{i + 1}") if mark else {}
            code = "\n".join(line[len(indent) :] for line in lines[i + 1 : j])
            out.append(
                Block(
                    path,
                    i + 1,
                    lang,
                    code,
                    ranks=int(opts.get("ranks", 1)),
                    setup=opts.get("setup"),
                    skip=opts.get("skip"),
                    options=opts,
                )
            )
        i = j + 1
    return out


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks_of(p)]


def run_block(code: str, filename: str, setup: str | None, workdir: str) -> None:
    """Run one block on this rank (the body tests/test_docs.py sends to the ranks)."""
    import torch

    import docs_setup

    os.makedirs(workdir, exist_ok=True)
    here = os.getcwd()
    os.chdir(workdir)
    try:
        torch.manual_seed(0)
        namespace: dict = {"__name__": "__docs__"}
        if setup is not None:
            namespace.update(docs_setup.SETUPS[setup]())
        exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - the docs' own examples
    finally:
        os.chdir(here)
