"""Triton, if importable, for every kernel module: ``HAS_TRITON`` says whether kernels can run, ``TRITON_IMPORT_ERROR``
why not, ``INTERPRETED`` whether the kernels are decorated under the interpreter (``TRITON_INTERPRET=1`` must be set
before this module is first imported: triton.jit picks the interpreter when a function is decorated)."""

from __future__ import annotations

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = f"triton is not importable ({exc})"

__all__ = ["HAS_TRITON", "INTERPRETED", "TRITON_IMPORT_ERROR", "pinned_to_device", "tl", "triton"]


def pinned_to_device(table, device, op: str):
    """The int64 host ``table`` on ``device`` through pinned memory, asynchronously (the caching host allocator keeps
    the pinned copy alive until the copy has run, then reuses it). Refused under CUDA graph capture with a
    RuntimeError saying why: a replay would read the pinned buffer again, by then another call's table (the CUDA
    extension ops refuse the same way, csrc/capture_check.h)."""
    import torch

    if device.type == "cpu":
        return table
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op} (Triton) cannot run under CUDA graph capture: it copies a per-call table of tensor addresses from "
            "a temporary pinned host buffer, which a graph replay would read after a later call reused it. Run it "
            "outside the captured region (eagerly), or capture the torch backend (LLMPAR_BACKEND=torch) instead"
        )
    return table.pin_memory().to(device, non_blocking=True)
