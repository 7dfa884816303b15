"""Runs the triton cases of tests/test_optim_ops.py under TRITON_INTERPRET=1 in a subprocess (see test_ops_triton.py
for why: the interpreter must be chosen before llmpar.kernels is imported, and would slow every other CPU test)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
OPS_TESTS = Path(__file__).with_name("test_optim_ops.py")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreted: run test_optim_ops.py")
def test_optim_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("LLMPAR_BACKEND", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton",
                           str(OPS_TESTS)], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"interpreted Triton tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "deselected" in summary, proc.stdout[-2000:]
