"""One Python function per fused op. Each picks CUDA extension -> Triton -> torch (see ``_dispatch``).

``import llmpar.ops`` defines the ``llmpar::`` ops (schemas, fake impls, CPU references: ``_library``) but never builds
or loads the CUDA extension: that happens on the first op call on CUDA tensors (``_ext.load``); likewise the CPU
extension (``_cpu_ext.load``) on the first ``cpu_adamw_step``.
``backend_report()`` says what can run here without building anything.
"""

from __future__ import annotations

from llmpar.ops import _library  # noqa: F401  (defines the llmpar:: ops before any op can run)
from llmpar.ops._dispatch import BACKENDS, backend_report, select_backend
from llmpar.ops.adamw import MODES, PRECISIONS, adamw_step
from llmpar.ops.attention import attention_bwd, attention_fwd, flash_attention, merge_partials
from llmpar.ops.bucket import pack_bucket, unpack_bucket
from llmpar.ops.cpu_adam import cpu_adamw_step
from llmpar.ops.gemm import ACTIVATIONS, linear_act, linear_act_backward, linear_act_rows
from llmpar.ops.grad_norm import clip_coefficient, grad_norm
from llmpar.ops.grouped_gemm import grouped_mm, grouped_swiglu
from llmpar.ops.moe_permute import permute_rows, unpermute_rows

__all__ = [
    "BACKENDS",
    "backend_report",
    "select_backend",
    "pack_bucket",
    "unpack_bucket",
    "MODES",
    "PRECISIONS",
    "adamw_step",
    "cpu_adamw_step",
    "grad_norm",
    "clip_coefficient",
    "ACTIVATIONS",
    "linear_act",
    "linear_act_rows",
    "linear_act_backward",
    "attention_fwd",
    "attention_bwd",
    "merge_partials",
    "flash_attention",
    "grouped_mm",
    "grouped_swiglu",
    "permute_rows",
    "unpermute_rows",
]
