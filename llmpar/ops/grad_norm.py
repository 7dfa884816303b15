"""Global gradient norm in one pass over many tensors, and the clip coefficient / found-inf flag AdamW applies inside
its step (so clipping costs no second pass over the grads and no ``.item()``).

    norm      = sqrt(sum_i sum_j float32(grads[i][j])^2)          (float32 0-d tensor on the grads' device)
    gscale    = min(1, max_norm / (norm + 1e-6))                  (torch.nn.utils.clip_grad_norm_'s coefficient)
    found_inf = 1.0 if norm is not finite else 0.0

Backends (``_dispatch``): CUDA extension (``llmpar::sum_squares``, per-block partials) -> Triton
(``llmpar.kernels.adamw.sum_squares``) -> torch (``torch._foreach_norm`` in float32). Both kernels take one dtype per
launch: one launch per grad dtype.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from llmpar.ops._dispatch import select_backend

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` together (float32 0-d tensor on their device). No host sync."""
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
        raise TypeError(f"grads must be a list or tuple of tensors, got {type(grads).__name__}")
    grads = list(grads)
    if not grads:
        raise ValueError("grads is empty: the norm of nothing has no device")
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise TypeError(f"grads[{i}] must be a floating-point tensor, got {getattr(g, 'dtype', type(g).__name__)}")
        if g.device != grads[0].device:
            raise ValueError(f"grads[{i}] is on {g.device} but grads[0] on {grads[0].device}; norm per device")
    device = grads[0].device
    live = [g for g in grads if g.numel() > 0]
    if not live:
        return torch.zeros((), dtype=torch.float32, device=device)
    unfit = None
    if any(g.dtype not in _KERNEL_DTYPES for g in live):
        unfit = "a grad dtype outside float32/bfloat16/float16"
    elif any(not g.is_contiguous() for g in live):
        unfit = "some grads are not contiguous"
    backend = select_backend(device, kernel_unfit=unfit, op="grad_norm")
    with torch.no_grad():
        if backend == "torch":
            norms = torch._foreach_norm(live, 2, dtype=torch.float32)
            return torch.linalg.vector_norm(torch.stack(norms))
        # both kernels take one dtype per launch (a model with fp32 norms and bf16 matrices has two): one per dtype
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in live:
            by_dtype.setdefault(g.dtype, []).append(g)
        if backend == "cuda":
            partials = [torch.ops.llmpar.sum_squares(gs) for gs in by_dtype.values()]
        else:
            from llmpar.kernels import adamw as triton_adamw

            partials = [triton_adamw.sum_squares(gs) for gs in by_dtype.values()]
        return (torch.cat(partials) if len(partials) > 1 else partials[0]).sum().sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gscale, found_inf) from a norm tensor, on its device, no host sync (see the module docstring)."""
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, numbers.Real)
        or not (math.isfinite(max_norm) and max_norm > 0)
    ):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}")
    norm = norm.to(torch.float32)
    found_inf = (~torch.isfinite(norm)).to(torch.float32)
    gscale = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    return gscale, found_inf
