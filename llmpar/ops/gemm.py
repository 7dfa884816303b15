"""Linear layer with a fused epilogue: ``y = act(x @ W^T + b) (+ residual)``, and its backward.

    x: [..., K]   weight: [N, K]   bias: [N]   residual, y: [..., N]   main_grad: fp32 [N, K]
    act in ACTIVATIONS: none, gelu_tanh (torch gelu approximate="tanh"), gelu_erf (exact gelu), silu, relu.
Backward with z = x @ W^T + b (the pre-activation, saved in x's dtype when act != none) and dY' = dY * act'(z):
    dX = dY' @ W,   dW = dY'^T @ X (added into ``main_grad`` in fp32 when given),   db = sum_rows dY',   dR = dY.

Backends (see ``_dispatch``), forward: CUDA extension (``llmpar::linear_lt``, cuBLASLt with its bias/GELU/ReLU
epilogues; ``llmpar::linear_lt_aux`` keeps z for gelu_tanh through the GELU_AUX epilogue; for relu, relu(z) itself
serves as ``pre``: same sign) when registered and the call fits it (act none/gelu_tanh/relu, a residual only without
an activation, out_dtype = x.dtype) -> Triton (float32 only where torch allows TF32: else cuBLAS, via torch, beats
its FMA loop) (``llmpar.kernels.gemm``: one GEMM kernel with the bias/activation/
residual epilogue; fp32 accumulate, one rounding to ``out_dtype``) -> torch (the plain composition
``act(F.linear(x, W, b)) + residual``, which autograd differentiates). Backward: CUDA extension
(``llmpar::bias_act_backward``: dY' and db in one pass, then cuBLAS for dX and dW) -> Triton (act' fused into both
GEMMs' operand loads, db in the wgrad kernel) -> torch. Kernel inputs: x and weight in float32/float16/bfloat16
(same dtype), bias in that dtype; others (float64, ...) use torch.

Here: the checks, the autograd Function and the entry points; the backend choice and the forward / backward on each
backend: ``gemm_backends.py``; the activations and the ops' references in plain torch: ``gemm_reference.py``.

``linear_act_rows`` is the chunk entry point: rows [start, end) of x into rows [start, end) of a preallocated out
(and of ``pre_out``), so that an overlapped forward can compute chunk i+1 while chunk i is being reduced;
``linear_act_forward`` (y and pre) and ``linear_act_backward`` (with a hook called as soon as dX exists, before dW)
serve callers that run their own autograd Function, such as the tensor-parallel linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpar.ops.gemm_backends import (  # noqa: F401  (KERNEL_DTYPES, LT_ACTS, the selectors: importable from here)
    KERNEL_DTYPES,
    LT_ACTS,
    run_backward,
    run_forward,
    select_backward_backend,
    select_forward_backend,
)
from llmpar.ops.gemm_reference import (  # noqa: F401  (the references: importable from here as before)
    ACTIVATIONS,
    act_grad_f32,
    bias_act_backward_reference,
    linear_lt_aux_reference,
    linear_lt_reference,
)
from llmpar.ops.gemm_reference import act_torch as _act_torch  # tensor_parallel.linear imports it from here


def _check(x, weight, bias, act, residual, out_dtype, main_grad) -> torch.dtype:
    """Validates the arguments; returns the output dtype."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act={act!r} is not an activation; use one of {', '.join(ACTIVATIONS)}")
    if not x.is_floating_point() or x.dtype != weight.dtype:
        raise TypeError(f"x ({x.dtype}) and weight ({weight.dtype}) must share one floating dtype")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x has shape {tuple(x.shape)} but weight {tuple(weight.shape)} wants a last dim of {weight.shape[1]}"
        )
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual), ("main_grad", main_grad)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    n = weight.shape[0]
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},)")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")
    if residual is not None:
        want = (*x.shape[:-1], n)
        if tuple(residual.shape) != want:
            raise ValueError(f"residual has shape {tuple(residual.shape)}; expected {want}")
        if not residual.is_floating_point():
            raise TypeError(f"residual has dtype {residual.dtype}; expected a floating dtype")
    if main_grad is not None:
        if main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
            raise ValueError(
                f"main_grad must be float32 of shape {tuple(weight.shape)}, got {main_grad.dtype} "
                f"{tuple(main_grad.shape)}"
            )
    if out_dtype is None:
        return x.dtype
    if not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating torch.dtype, got {out_dtype!r}")
    return out_dtype


class _LinearAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, residual2, act, out_dtype, main_grad, backend):
        out, pre = run_forward(x2, weight, bias, residual2, act, out_dtype, backend)
        ctx.save_for_backward(x2, weight, pre)
        ctx.act, ctx.main_grad = act, main_grad
        ctx.has_bias = bias is not None
        ctx.residual_dtype = residual2.dtype if residual2 is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, pre = ctx.saved_tensors
        needs = ctx.needs_input_grad
        backend = select_backward_backend(grad_out, x2)
        dx, dw, db = run_backward(
            grad_out,
            x2,
            weight,
            pre,
            ctx.act,
            has_bias=ctx.has_bias,
            main_grad=ctx.main_grad,
            backend=backend,
            needs=(needs[0], needs[1], needs[2]),
        )
        dr = grad_out.to(ctx.residual_dtype) if ctx.residual_dtype is not None and needs[3] else None
        return dx, dw, db, dr, None, None, None, None


def linear_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str = "none",
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    main_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(x @ weight^T + bias) (+ residual)`` in ``out_dtype`` (default x.dtype); differentiable.

    x: [..., K], weight: [N, K], bias: [N], residual: [..., N] -> [..., N].
    main_grad: fp32 [N, K]; when given, the backward adds dW into it (fp32, no rounding to weight's dtype, like
    Megatron's gradient_accumulation_fusion) and returns no gradient for ``weight``. With nothing to differentiate
    (grad mode off, or no input requiring grad) the fused kernels do not write the pre-activation.
    """
    out_dtype = _check(x, weight, bias, act, residual, out_dtype, main_grad)
    k, n = weight.shape[1], weight.shape[0]
    lead = x.shape[:-1]
    backend = select_forward_backend(x, weight, act, residual, out_dtype)
    if backend == "torch" and main_grad is None:  # the plain composition; autograd differentiates it
        y = _act_torch(F.linear(x, weight, bias), act)
        if residual is not None:
            y = y + residual
        return y.to(out_dtype)
    r2 = residual.reshape(-1, n) if residual is not None else None
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, residual))):
        with torch.no_grad():  # no backward can follow: no autograd node, no pre-activation written
            y, _ = run_forward(x.reshape(-1, k), weight, bias, r2, act, out_dtype, backend, keep_pre=False)
        return y.reshape(*lead, n)
    y = _LinearAct.apply(x.reshape(-1, k), weight, bias, r2, act, out_dtype, main_grad, backend)
    return y.reshape(*lead, n)


def linear_act_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str = "none",
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, pre) of ``linear_act`` for 2-D x [M, K]; not differentiable (the caller owns autograd).

    pre: [M, N] in x's dtype, what ``linear_act_backward`` takes act' from (the pre-activation z, or relu(z) for relu
    on the CUDA backend, which has the same sign); None for act none."""
    out_dtype = _check(x, weight, bias, act, residual, out_dtype, None)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, in], got shape {tuple(x.shape)}")
    backend = select_forward_backend(x, weight, act, residual, out_dtype)
    with torch.no_grad():
        return run_forward(x, weight, bias, residual, act, out_dtype, backend)


def linear_act_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor,
    start: int,
    end: int,
    act: str = "none",
    residual: torch.Tensor | None = None,
    pre_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [start, end) of ``linear_act``: out[start:end] = act(x[start:end] @ W^T + b) (+ residual[start:end]).

    x: [M, K], out: [M, N] (its dtype is the output dtype), residual: [M, N], pre_out: [M, N] in x's dtype, gets the
    rows of ``pre`` (see ``linear_act_forward``) for ``linear_act_backward``. Not differentiable (the caller owns
    autograd). Returns ``out[start:end]``. Chunks computed one by one equal the full call.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    _check(x, weight, bias, act, residual, out.dtype, None)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, in] for the row-range entry point, got shape {tuple(x.shape)}")
    m, n = x.shape[0], weight.shape[0]
    if out.shape != (m, n):
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {(m, n)}")
    if pre_out is not None and (pre_out.shape != (m, n) or pre_out.dtype != x.dtype):
        raise ValueError(f"pre_out must be {x.dtype} of shape {(m, n)}, got {pre_out.dtype} {tuple(pre_out.shape)}")
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= m):
        raise ValueError(f"rows [{start}, {end}) are not a range within [0, {m}]")
    rows = slice(start, end)
    if start == end:
        return out[rows]
    rs = residual[rows] if residual is not None else None
    backend = select_forward_backend(x, weight, act, residual, out.dtype, rows=end - start)
    with torch.no_grad():
        run_forward(
            x[rows],
            weight,
            bias,
            rs,
            act,
            out.dtype,
            backend,
            out=out[rows],
            pre_out=pre_out[rows] if pre_out is not None else None,
        )
    return out[rows]


def linear_act_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor | None,
    *,
    act: str = "none",
    has_bias: bool = False,
    main_grad: torch.Tensor | None = None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    on_grad_input=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dX, dW, db) of ``linear_act`` for 2-D grad_out [M, N], x [M, K], pre [M, N] (None when act is none).

    needs: which of (dX, dW, db) to compute (the others come back None); dW is None when accumulated into
    ``main_grad``; db is None without bias. ``on_grad_input(dX)`` is called as soon as dX exists, before the weight
    gradient is computed (an input-gradient all-reduce can overlap it). Not differentiable.
    """
    _check(x, weight, None, act, None, None, main_grad)
    if act != "none" and pre is None:
        raise ValueError(f"act={act!r} needs the pre-activation (pre_out of linear_act_rows)")
    if grad_out.shape != (x.shape[0], weight.shape[0]) or x.dim() != 2:
        raise ValueError(f"grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} must be [M, N] and [M, K]")
    backend = select_backward_backend(grad_out, x)
    with torch.no_grad():
        return run_backward(
            grad_out,
            x,
            weight,
            pre,
            act,
            has_bias=has_bias,
            main_grad=main_grad,
            backend=backend,
            needs=tuple(bool(v) for v in needs),
            on_grad_input=on_grad_input,
        )
