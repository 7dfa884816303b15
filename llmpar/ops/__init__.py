"""One Python function per fused op. Each picks CUDA extension -> Triton -> torch (see ``_dispatch``).

``import llmpar.ops`` never builds or loads the CUDA extension: that happens on the first op call on CUDA tensors
(``_ext.load``). ``backend_report()`` says what can run here without building anything.
"""
from __future__ import annotations

from ._dispatch import BACKENDS, backend_report, select_backend
from .adamw import PRECISIONS, adamw_step
from .bucket import pack_bucket, unpack_bucket
from .gemm import ACTIVATIONS, linear_act, linear_act_backward, linear_act_rows
from .grad_norm import clip_coefficient, grad_norm

__all__ = ["BACKENDS", "backend_report", "select_backend", "pack_bucket", "unpack_bucket", "PRECISIONS", "adamw_step",
           "grad_norm", "clip_coefficient", "ACTIVATIONS", "linear_act", "linear_act_rows", "linear_act_backward"]
