"""``deepspeed.accelerator`` for DeepSpeed scripts: ``get_accelerator()``, a thin object over ``torch.cuda`` on a GPU
machine and over the host (CPU) otherwise, with DeepSpeed's method names and meanings.

    from llmpar.accelerator import get_accelerator          # was: from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    device = torch.device(acc.device_name(), local_rank)    # cuda:<local_rank>, or cpu
    acc.set_device(local_rank); acc.manual_seed_all(1234)
    peak = acc.max_memory_allocated(); acc.reset_peak_memory_stats()
    dtype = torch.bfloat16 if acc.is_bf16_supported() else torch.float16

Which one: ``DS_ACCELERATOR`` (``cuda`` or ``cpu``, as DeepSpeed reads it) when set, else CUDA when
``torch.cuda.is_available()``, else the CPU. On the CPU (DeepSpeed's CPU accelerator semantics): streams and events
are no-op stand-ins, ``synchronize`` / ``empty_cache`` / ``set_device`` do nothing, ``pin_memory`` returns the tensor,
the memory statistics are the process's resident set size (``/proc/self/status``: ``VmRSS`` now, ``VmHWM`` peak;
``reset_peak_memory_stats`` resets the peak through ``/proc/self/clear_refs`` where the kernel allows it, otherwise
the peak stays the process's), and the communication backend is gloo. DeepSpeed's op builders
(``create_op_builder``) are not provided: llmpar builds its own ops (``llmpar.ops``).
A DeepSpeed-compatibility module: nothing inside llmpar imports it.
"""

from __future__ import annotations

from llmpar.accelerator.abstract_accelerator import Accelerator, DeepSpeedAccelerator
from llmpar.accelerator.cpu_accelerator import CpuAccelerator
from llmpar.accelerator.cuda_accelerator import CudaAccelerator
from llmpar.accelerator.real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
