"""The fault matrix (tests/FAULTS.md) names only tests that exist, and every fault test file appears in it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROW = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _matrix_refs() -> list[tuple[str, str]]:
    return ROW.findall((TESTS / "FAULTS.md").read_text())


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
    }


def test_every_test_the_matrix_names_exists() -> None:
    refs = _matrix_refs()
    assert len(refs) >= 20, f"FAULTS.md lists only {len(refs)} tests: its rows are not being read"
    missing = []
    for file, name in refs:
        path = TESTS.parent / file
        if not path.is_file() or name not in _test_names(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"tests/FAULTS.md names tests that do not exist: {missing}"


def test_every_fault_test_file_is_in_the_matrix() -> None:
    listed = {file for file, _ in _matrix_refs()}
    files = {p.relative_to(TESTS.parent).as_posix() for p in TESTS.rglob("test_faults*.py")}
    assert files, "no tests/**/test_faults*.py found"
    assert files <= listed, f"fault test files missing from tests/FAULTS.md: {sorted(files - listed)}"
