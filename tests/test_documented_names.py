"""Every llmpar name the README and the docs pages write out resolves: a dotted ``llmpar.a.b`` in the text (inline
code, tables, code blocks) and each name of a ``from llmpar.x import a, b`` line import as written. A module moved
or a name renamed without its page changes fails here, naming the page."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"(?<![\w/.-])llmpar(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*from (llmpar[\w.]*) import \(?([\w, ]+)\)?", re.M)
# written out but not importable by design (name -> why)
NOT_IMPORTABLE = {
    "llmpar.X": "the renaming rule's placeholder (deepspeed.X -> llmpar.X)",
    "llmpar._C": "the CUDA extension, present only where it was built (make cuda-ext)",
}


def documented_names(pages: list[Path]) -> dict[str, str]:
    """name -> the first page that writes it."""
    found: dict[str, str] = {}
    for page in pages:
        text = page.read_text()
        for m in DOTTED.finditer(text):
            found.setdefault(m.group(0), page.name)
        for m in FROM_IMPORT.finditer(text):
            for name in m.group(2).split(","):
                name = name.strip().split(" as ")[0].strip()
                if name:
                    found.setdefault(f"{m.group(1)}.{name}", page.name)
    return found


def resolves(name: str) -> bool:
    """The longest importable module prefix of ``name``, then attributes for the rest."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


NAMES = documented_names(PAGES)


def test_the_pages_name_llmpar_at_all():
    assert len(NAMES) > 50, sorted(NAMES)


@pytest.mark.parametrize("name", sorted(set(NAMES) - set(NOT_IMPORTABLE)))
def test_documented_name_resolves(name):
    assert resolves(name), f"{NAMES[name]} writes `{name}`, which does not import"


def test_a_renamed_name_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Call `llmpar.initialize` or `llmpar.no_such_function`.\n\n"
        "```python\nfrom llmpar.zero import ZeroOptimizer, Gone\n```\n"
    )
    names = documented_names([page])
    assert set(names) == {
        "llmpar.initialize",
        "llmpar.no_such_function",
        "llmpar.zero",
        "llmpar.zero.ZeroOptimizer",
        "llmpar.zero.Gone",
    }
    assert [n for n in sorted(names) if not resolves(n)] == ["llmpar.no_such_function", "llmpar.zero.Gone"]
