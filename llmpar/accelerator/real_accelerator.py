"""``get_accelerator()``: this process's accelerator (``llmpar.accelerator``)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from llmpar.accelerator.abstract_accelerator import Accelerator
from llmpar.accelerator.cpu_accelerator import CpuAccelerator
from llmpar.accelerator.cuda_accelerator import CudaAccelerator

_KINDS = ("cuda", "cpu")


@functools.lru_cache(maxsize=None)
def _accelerator(kind: str) -> Accelerator:
    return CudaAccelerator() if kind == "cuda" else CpuAccelerator()


def get_accelerator() -> Accelerator:
    """This process's accelerator: ``DS_ACCELERATOR`` (cuda | cpu) when set, else CUDA when available, else the CPU
    (the same object on every call)."""
    kind = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if kind and kind not in _KINDS:
        raise ValueError(f"environment variable DS_ACCELERATOR={kind!r}: llmpar runs on {' or '.join(_KINDS)}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("environment variable DS_ACCELERATOR='cuda' but torch.cuda.is_available() is False")
    return _accelerator(kind or ("cuda" if torch.cuda.is_available() else "cpu"))


def is_current_accelerator_supported() -> bool:
    return True


def set_accelerator(accel_obj: Any) -> None:
    raise NotImplementedError(
        "set_accelerator is not provided: llmpar picks CUDA or the CPU (DS_ACCELERATOR=cuda|cpu chooses)"
    )


__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
