"""Run a test file's Triton tests under the Triton interpreter, in a subprocess.

``triton.jit`` picks its interpreter when a kernel is decorated, so ``TRITON_INTERPRET=1`` must be set before
``llmpar.kernels`` is imported; setting it in the main pytest process would slow every other op. Each file with
interpreted tests has one main-process test that calls :func:`run_interpreted` on itself (or on another file); the
interpreted tests skip in the main process and run here.
"""

from __future__ import annotations

import os
import subprocess
import sys

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(
    path: str, *, timeout: float, select: str | None = None, what: str = "interpreted Triton tests"
) -> str:
    """pytest ``path`` (``-k select``) with TRITON_INTERPRET=1 and no forced backend; fails on any failure or when
    nothing passed. Returns the summary line."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("LLMPAR_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    if select:
        cmd += ["-k", select]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(os.path.abspath(__file__))
    )
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, proc.stdout[-2000:]
    return summary
