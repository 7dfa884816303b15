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

__all__ = ["HAS_TRITON", "INTERPRETED", "TRITON_IMPORT_ERROR", "tl", "triton"]
