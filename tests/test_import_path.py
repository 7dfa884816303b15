"""The working directory never changes what ``import kernels`` means.

A clone's root holds ``kernels/`` (llmpar's Triton kernels, installed as ``llmpar.kernels``). ``python -m pytest``,
``python -c`` and ``python script.py`` run from the root put the root first on ``sys.path``; transformers imports
Hugging Face's package named ``kernels`` whenever it is installed, and found our folder instead (an ImportError in
every test that built a transformers model, from a fresh clone's ``make test``).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from multirank import REPO_ROOT, run_ranks, worker_sys_path


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _python(code: str, *flags: str) -> subprocess.CompletedProcess:
    """``python [flags] -c code`` from the clone's root, as the README's commands run (the root first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_transformers_model_builds_from_the_repo_root():
    pytest.importorskip("transformers")
    code = f"""
import os, sys
assert os.path.abspath(sys.path[0] or os.curdir) == {REPO_ROOT!r}, sys.path[:3]  # the root is on the path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1)
model = LlamaForCausalLM(cfg)
x = torch.randint(0, 61, (2, 7))
assert torch.isfinite(model(x).logits).all()
import importlib.metadata
import llmpar.kernels
print(llmpar.kernels.__file__)
try:
    importlib.metadata.distribution("kernels")  # HF's package is installed: transformers imports it
except importlib.metadata.PackageNotFoundError:
    pass
else:
    import kernels
    print(kernels.__file__)
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    ours, *bare = out.stdout.split()
    assert os.path.samefile(ours, os.path.join(REPO_ROOT, "kernels", "__init__.py"))
    if _hf_kernels_installed():  # what transformers imports: the installed package, never our folder
        assert bare and not os.path.abspath(bare[0]).startswith(os.path.join(REPO_ROOT, "kernels") + os.sep), bare


def test_bare_kernels_without_the_package_is_not_found_and_says_why():
    # -S: no site-packages, so no installed `kernels`; the root is still first on the path
    out = _python("import kernels", "-S")
    assert out.returncode != 0
    assert "ModuleNotFoundError: No module named 'kernels'" in out.stderr, out.stderr[-2000:]
    assert "llmpar.kernels" in out.stderr


def test_ranks_do_not_inherit_the_repo_root(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "path", ["", REPO_ROOT, *sys.path])
    kept = worker_sys_path()
    assert REPO_ROOT not in [os.path.abspath(p or os.curdir) for p in kept]
    assert os.path.dirname(os.path.abspath(__file__)) in kept  # the tests' helpers stay importable


def _rank_sys_path() -> list[str]:
    return [os.path.abspath(p or os.curdir) for p in sys.path]


def test_rank_processes_run_without_the_repo_root():
    for path in run_ranks(_rank_sys_path, 2, timeout=60):
        assert REPO_ROOT not in path
