"""Triton kernels of llmpar, installed as ``llmpar.kernels``. They know nothing of llmpar: llmpar/ops/ wraps them.

Importable without triton: ``HAS_TRITON`` says whether the kernels can run, ``TRITON_IMPORT_ERROR`` why not.
"""
from __future__ import annotations

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR

__all__ = ["HAS_TRITON", "INTERPRETED", "TRITON_IMPORT_ERROR"]
