"""``deepspeed.runtime.utils`` for DeepSpeed scripts: the helpers their training scripts import from it.

    from llmpar.runtime.utils import set_random_seed, see_memory_usage   # was: from deepspeed.runtime.utils import ...
    set_random_seed(1234)                      # random, numpy and torch (every device), as DeepSpeed seeds them
    see_memory_usage("after init", force=True) # rank 0 logs the accelerator's memory and the host's

``set_random_seed(seed)`` seeds Python's ``random``, numpy's global generator (``seed mod 2**32``) and torch
(``seed mod 2**63``, every device): afterwards the three draw what they draw after DeepSpeed's. The memory helpers
read ``llmpar.accelerator.get_accelerator()`` (CUDA's allocator on a GPU; the process's resident set on the CPU).
DeepSpeed's other helpers of this module (partitioning, its clipping and norm functions) are the engine's job here;
asking for one is an ``AttributeError`` that says so. A DeepSpeed-compatibility module on the top floor (loaded by
``llmpar.runtime`` when ``llmpar.runtime.utils`` is first asked for): nothing inside llmpar imports it.
"""

from __future__ import annotations

import gc
import logging
import random
from typing import Any

import torch
import torch.distributed as dist

from llmpar.accelerator import get_accelerator

logger = logging.getLogger("llmpar")
_GB = 1024**3


def set_random_seed(seed: int) -> None:
    """Seed ``random``, numpy (when installed) and torch with ``seed``, as ``deepspeed.runtime.utils`` does."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional here
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def torch_memory_reserved() -> int:
    """Bytes the accelerator's allocator holds now (the CPU: the process's resident set)."""
    return int(get_accelerator().memory_reserved())


def torch_max_memory_reserved() -> int:
    """The peak of :func:`torch_memory_reserved` since the last reset."""
    return int(get_accelerator().max_memory_reserved())


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, rank 0 logs ``message`` and the memory in use (allocated, its peak, reserved, its peak, in GB;
    the host's used memory when psutil is installed), then resets the peaks, as DeepSpeed's does; without it, nothing
    (DeepSpeed's default)."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    acc = get_accelerator()
    line = (
        f"{message}: MA {acc.memory_allocated() / _GB:.2f} GB Max_MA {acc.max_memory_allocated() / _GB:.2f} GB "
        f"CA {torch_memory_reserved() / _GB:.2f} GB Max_CA {torch_max_memory_reserved() / _GB:.2f} GB"
    )
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        line += f"; CPU virtual memory: used = {(vm.total - vm.available) / _GB:.2f} GB, percent = {vm.percent}%"
    logger.info(line)
    acc.reset_peak_memory_stats()


_ELSEWHERE = {
    "clip_grad_norm_": 'gradient clipping is the config\'s "gradient_clipping" (the engine clips when it steps)',
    "get_global_norm": "the engine's global grad norm is engine.get_global_grad_norm()",
    "partition_uniform": 'pipeline stages are split by the config\'s "pipeline.partition" (llmpar.pipe)',
    "partition_balanced": 'pipeline stages are split by the config\'s "pipeline.partition" (llmpar.pipe)',
    "PartitionedTensor": "not provided",
    "call_to_str": "not provided",
}


def __getattr__(name: str) -> Any:
    why = _ELSEWHERE.get(name)
    if why is None:
        raise AttributeError(f"module 'llmpar.runtime.utils' has no attribute {name!r}")
    raise AttributeError(f"llmpar.runtime.utils has no {name} (DeepSpeed's deepspeed.runtime.utils.{name}): {why}")


__all__ = ["see_memory_usage", "set_random_seed", "torch_max_memory_reserved", "torch_memory_reserved"]
