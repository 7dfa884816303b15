"""The fake (meta) impls of the ``llmpar::`` ops (``_library.py`` registers them) and the argument checks they share
with the CPU references (``_references.py``): what each op returns (shapes, dtypes, strides) without computing it, so
FakeTensor, torch.compile and the Meta device trace the ops with no GPU and no kernel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmpar.ops.gemm import ACTIVATIONS, LT_ACTS

ADAMW_CHUNK = 4096  # LLMPAR_ADAMW_CHUNK of csrc/adamw.cuh: elements per block of sum_squares, one partial each
_LT_CODES = tuple(ACTIVATIONS.index(a) for a in LT_ACTS)


# ----------------------------------------------------------------------------------- checks (fake and CPU reference)


def check_bias_act(grad: torch.Tensor, pre: torch.Tensor, act: int) -> None:
    if grad.dim() != 2:
        raise ValueError(f"bias_act_backward: grad must be 2-D [M, N], got shape {tuple(grad.shape)}")
    if pre.shape != grad.shape:
        raise ValueError(f"bias_act_backward: pre {tuple(pre.shape)} must match grad {tuple(grad.shape)}")
    if not 0 <= act < len(ACTIVATIONS):
        raise ValueError(
            f"bias_act_backward: act={act} is not an activation code (0..{len(ACTIVATIONS) - 1}: "
            f"{', '.join(ACTIVATIONS)})"
        )


def check_linear_lt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int, residual: torch.Tensor | None
) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"linear_lt: x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_lt: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K")
    if x.dtype != weight.dtype:
        raise TypeError(f"linear_lt: x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    if act not in _LT_CODES:
        raise ValueError(
            f"linear_lt: act={act} has no cuBLASLt epilogue; it takes "
            f"{', '.join(f'{c} ({ACTIVATIONS[c]})' for c in _LT_CODES)}"
        )
    n = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype != x.dtype):
        raise ValueError(f"linear_lt: bias must be [{n}] in {x.dtype}, got {tuple(bias.shape)} in {bias.dtype}")
    if residual is not None:
        if act != 0:
            raise ValueError("linear_lt: a residual is added before the epilogue's activation; only act 0 takes one")
        if tuple(residual.shape) != (x.shape[0], n) or residual.dtype != x.dtype:
            raise ValueError(
                f"linear_lt: residual must be [{x.shape[0]}, {n}] in {x.dtype}, got "
                f"{tuple(residual.shape)} in {residual.dtype}"
            )


# ------------------------------------------------------------------------------------------------------ fakes


def fake_none(*args: Any) -> None:
    """The mutating ops return nothing: their fake impl only has to exist."""
    return None


def fake_sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    # (an empty list never gets here: with no tensor the dispatcher has no device to dispatch on)
    blocks = sum(-(-t.numel() // ADAMW_CHUNK) for t in tensors)
    return tensors[0].new_empty((torch.sym_max(blocks, 1),), dtype=torch.float32)


def fake_bias_act_backward(grad: torch.Tensor, pre: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_bias_act(grad, pre, act)
    return pre.new_empty(grad.shape), grad.new_empty((grad.shape[1],), dtype=torch.float32)


def fake_linear_lt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int, residual: torch.Tensor | None
) -> torch.Tensor:
    check_linear_lt(x, weight, bias, act, residual)
    return x.new_empty((x.shape[0], weight.shape[0]))


def aux_buffer(x: torch.Tensor, n: int) -> torch.Tensor:
    """[M, ceil(N / 8) * 8] in x's dtype: cuBLASLt's GELU aux matrix, whose [M, N] view is linear_lt_aux's z."""
    return x.new_empty((x.shape[0], (n + 7) // 8 * 8))


def fake_linear_lt_aux(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_linear_lt(x, weight, bias, 1, None)
    n = weight.shape[0]
    return x.new_empty((x.shape[0], n)), aux_buffer(x, n).narrow(1, 0, n)
