"""Imports inside llmpar/ops: no module of it imports the package ``llmpar.ops`` itself (only its __init__ gathers the
submodules, which import each other directly), and each submodule imports cleanly first in a fresh process.
(Floors, cycles, module-level state and file sizes of all of llmpar: tests/test_architecture.py.)"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "llmpar" / "ops"


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import in ``path`` (a module of llmpar.ops: relative ones resolved
    against that package)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = ["llmpar", "ops"][: 3 - node.level]
                module = ".".join(base + ([module] if module else []))
            out.append((node.lineno, module, [alias.name for alias in node.names]))
    return out


@pytest.mark.parametrize("path", sorted(OPS.glob("*.py")), ids=lambda p: p.name)
def test_ops_modules_import_submodules_directly(path):
    bad = []
    for line, module, names in _imports(path):
        if path.name != "__init__.py" and module == "llmpar.ops":
            bad.append(f"line {line}: from llmpar.ops import {', '.join(names)} (goes through the package)")
        if module == "llmpar" and "ops" in names:
            bad.append(f"line {line}: from llmpar import ops")
    assert not bad, f"{path.name} imports the package llmpar.ops: import the submodule instead\n" + "\n".join(bad)


def test_the_rule_catches_package_imports(tmp_path):
    sample = tmp_path / "mod.py"
    sample.write_text(
        "from . import _ext\nfrom llmpar.ops import select_backend\nfrom llmpar.ops._ext import load\n"
        "from ._dispatch import select_backend\nfrom .. import ops\n"
    )
    assert [m for _, m, _ in _imports(sample)] == [
        "llmpar.ops",
        "llmpar.ops",
        "llmpar.ops._ext",
        "llmpar.ops._dispatch",
        "llmpar",
    ]


# one interpreter imports torch (and Triton), then forks a child per submodule, which imports that submodule first:
# each child is a fresh llmpar (the parent never imported it) without paying torch's start-up once per module
_FORKED_IMPORTS = r"""
import json, os, sys, traceback

import torch  # noqa: F401
try:
    import triton  # noqa: F401
except ImportError:
    pass
assert not [m for m in sys.modules if m == "llmpar" or m.startswith("llmpar.")], "llmpar imported before the forks"
check, results = sys.argv[1], {}
for name in sys.argv[2:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            exec(check.format(name=name), {})
            msg = ""
        except BaseException:
            msg = traceback.format_exc()
        with os.fdopen(w, "wb") as f:
            f.write(msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    _, status = os.waitpid(pid, 0)
    results[name] = msg or ("" if status == 0 else f"the child exited with status {status}")
print(json.dumps(results))
"""


def test_import_llmpar_ops_in_a_fresh_process_in_any_order():
    """Each submodule imported first, alone, in a fresh llmpar: no cycle leaves a half-initialised module."""
    names = ["llmpar.ops" if p.stem == "__init__" else f"llmpar.ops.{p.stem}" for p in sorted(OPS.glob("*.py"))]
    check = (
        "import {name}, llmpar.ops as ops, torch\n"
        "assert all(hasattr(torch.ops.llmpar, n) for n in ops._library.OPS)\n"
        "assert ops.pack_bucket and ops.linear_act and ops.adamw_step and ops.grad_norm and ops.MODES\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED_IMPORTS, check, *names], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(names)
    failed = {name: msg for name, msg in results.items() if msg}
    assert not failed, "\n".join(f"import {name} first:\n{msg[-2000:]}" for name, msg in failed.items())
