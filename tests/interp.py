"""Run a test file's Triton tests under the Triton interpreter, in a subprocess.

``triton.jit`` picks its interpreter when a kernel is decorated, so ``TRITON_INTERPRET=1`` must be set before
``llmpar.kernels`` is imported; setting it in the main pytest process would slow every other op. Each file with
interpreted tests has one main-process test that calls :func:`run_interpreted` on itself (or on another file); the
interpreted tests skip in the main process and run here.

The interpreted runs of a session share one worker process (TRITON_INTERPRET=1, started by the first run): each run
is a ``pytest.main`` of its file there, so Python, torch, Triton and llmpar start once, not once per file (~5 s each
on 2 cores). A run that fails retires the worker (the next run starts a fresh one), so a failure cannot leave state
behind for another file; a run past its timeout kills the worker and everything it started.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))


class _Worker:
    """A ``python`` with TRITON_INTERPRET=1 that runs ``pytest.main(args)`` per request (see :func:`_serve`)."""

    def __init__(self) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "LLMPAR_TEST_BUDGET": "0"}  # the caller's test has the budget
        env.pop("LLMPAR_BACKEND", None)
        self.log = tempfile.NamedTemporaryFile(prefix="llmpar-interp-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import interp; interp._serve()"],
            cwd=HERE,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,  # its own process group: a timeout kills the ranks it started too
        )

    def run(self, args: list[str], timeout: float) -> tuple[int, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result within {timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the interpreter worker exited (code {self.proc.wait()})")
                reply = json.loads(line)
                return reply["rc"], reply["out"]
            if self.proc.poll() is not None:
                raise RuntimeError(f"the interpreter worker exited (code {self.proc.returncode})")

    def stderr_tail(self, chars: int = 3000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # and whatever it left running (a rank pool)
        self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


_WORKER: list[_Worker] = []  # the session's worker, while it lives


def worker_cpu() -> float:
    """CPU seconds the live worker has used (tests/suite_rules.py counts them as the running test's own)."""
    from multirank import cpu_seconds

    return sum(cpu_seconds(w.proc.pid) for w in _WORKER)


def close_worker() -> None:
    while _WORKER:
        _WORKER.pop().close()


atexit.register(close_worker)


def run_interpreted(
    path: str, *, timeout: float, select: str | None = None, what: str = "interpreted Triton tests"
) -> str:
    """pytest ``path`` (``-k select``) with TRITON_INTERPRET=1 and no forced backend; fails on any failure or when
    nothing passed. Returns the summary line."""
    args = ["-q", "-p", "no:cacheprovider", str(path)] + (["-k", select] if select else [])
    if not _WORKER:
        _WORKER.append(_Worker())
    worker = _WORKER[0]
    try:
        rc, out = worker.run(args, timeout)
    except (TimeoutError, RuntimeError) as err:
        tail = worker.stderr_tail()
        close_worker()
        raise AssertionError(f"{what}: {err}\n{tail}") from None
    if rc != 0:
        tail = worker.stderr_tail()
        close_worker()  # the next run starts clean
        raise AssertionError(f"{what} failed:\n{out[-6000:]}\n{tail}")
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, out[-2000:]
    return summary


def _serve() -> None:
    """The worker's loop: a JSON list of pytest arguments per line on stdin; for each, one line on stdout with the
    exit code and what pytest printed."""
    import pytest

    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in requests:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = pytest.main(json.loads(line))
        replies.write(json.dumps({"rc": int(rc), "out": out.getvalue()}) + "\n")
