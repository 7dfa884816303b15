"""Runs the triton cases of tests/test_optim_ops.py under TRITON_INTERPRET=1 in a subprocess (see test_ops_triton.py
for why: the interpreter must be chosen before llmpar.kernels is imported, and would slow every other CPU test)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from interp import run_interpreted

pytest.importorskip("triton")
OPS_TESTS = Path(__file__).with_name("test_optim_ops.py")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreted: run test_optim_ops.py")
def test_optim_triton_kernels_under_interpreter():
    summary = run_interpreted(OPS_TESTS, timeout=400, select="triton")
    assert "deselected" in summary, summary
