"""Which backend runs a fused linear (``gemm.py``), and its forward and backward on each: the CUDA extension
(cuBLASLt epilogues, ``llmpar::bias_act_backward`` + cuBLAS), the Triton GEMM (``llmpar.kernels.gemm``: act' fused into
both backward GEMMs' operand loads) or torch. ``select_forward_backend`` / ``select_backward_backend`` ask
``_dispatch.select_backend`` with why a call does not fit a kernel (dtype, empty product, no cuBLASLt epilogue) and
when Triton would lose to cuBLAS (float32 without TF32); ``run_forward`` / ``run_backward`` run 2-D calls on the
chosen one. Checks of the arguments are ``gemm.py``'s."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpar.ops._dispatch import select_backend, tf32_allowed
from llmpar.ops.gemm_reference import ACTIVATIONS, act_grad_torch, act_torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}  # same codes as llmpar.kernels.gemm.ACTS
LT_ACTS = ("none", "gelu_tanh", "relu")  # activations with a cuBLASLt epilogue (llmpar::linear_lt)


def _ext_ops():
    """Where the extension ops live (on CPU tensors they run the references registered in ``_library``; tests wrap
    them to see that the CUDA path calls them)."""
    return torch.ops.llmpar


def _kernel_unfit(x, residual, out_dtype, m, k, n) -> str | None:
    for name, dtype in (
        ("x", x.dtype),
        ("out_dtype", out_dtype),
        ("residual", residual.dtype if residual is not None else torch.float32),
    ):
        if dtype not in KERNEL_DTYPES:
            return f"{name} dtype {dtype} (kernels take float32, float16, bfloat16)"
    if m == 0 or k == 0 or n == 0:
        return f"an empty product (M={m}, K={k}, N={n})"
    return None


def _lt_unfit(x, act, residual, out_dtype) -> str | None:
    """Why ``llmpar::linear_lt`` cannot serve this forward, or None."""
    if act not in LT_ACTS:
        return f"act={act!r} has no cuBLASLt epilogue (it has {', '.join(LT_ACTS)})"
    if residual is not None and act != "none":
        return "cuBLASLt adds a residual before the activation; a residual goes with act='none' only"
    if out_dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return f"out_dtype and residual must be x's dtype {x.dtype} for cuBLASLt"
    return None


def select_forward_backend(x, weight, act="none", residual=None, out_dtype=None, rows=None) -> str:
    """The backend of ``linear_act``'s forward for these (checked) arguments: cuda, triton or torch.

    rows: the rows computed (default: all of x's)."""
    out_dtype = out_dtype or x.dtype
    m = x.numel() // max(x.shape[-1], 1) if rows is None else rows
    unfit = _kernel_unfit(x, residual, out_dtype, m, weight.shape[1], weight.shape[0])
    ops = ("linear_lt", "bias_act_backward") + (("linear_lt_aux",) if act == "gelu_tanh" else ())
    return select_backend(
        x.device,
        kernel_unfit=unfit,
        op="linear_act",
        cuda_ops=ops,
        cuda_unfit=_lt_unfit(x, act, residual, out_dtype),
        triton_slow=_triton_slow(x),
    )


def select_backward_backend(grad_out, x) -> str:  # x: [M, K], grad_out: [M, N]
    """The backend of ``linear_act``'s backward: CUDA (bias_act_backward + cuBLAS), Triton or torch."""
    m, k = x.shape
    unfit = _kernel_unfit(x, None, grad_out.dtype, m, k, grad_out.shape[-1])
    return select_backend(
        x.device,
        kernel_unfit=unfit,
        op="linear_act_backward",
        cuda_ops=("bias_act_backward",),
        triton_slow=_triton_slow(x),
    )


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result (no rounding to a's dtype): cuBLAS with fp32 output where torch offers it."""
    if a.dtype == torch.float32 or a.device.type != "cuda":
        return a.float() @ b.float()
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return a.float() @ b.float()


def _triton_slow(x: torch.Tensor) -> str | None:
    """Why the Triton GEMM would lose to torch here (the dispatcher then prefers torch), or None."""
    if x.dtype == torch.float32 and x.device.type == "cuda" and not tf32_allowed():
        return (
            "float32 without TF32 (torch.backends.cuda.matmul.fp32_precision): Triton would multiply on the FMA "
            "units, cuBLAS is faster"
        )
    return None


def run_forward(x2, weight, bias, r2, act, out_dtype, backend, *, out=None, pre_out=None, keep_pre=True):
    """(y, pre) for 2-D x2: y = act(x2 W^T + b) (+ r2) (into ``out`` when given), pre = what the backward takes
    act' from (None for act none; z, or relu(z) for relu on the CUDA backend), copied into ``pre_out`` when given.
    ``keep_pre=False``: no backward will run, pre is not written (an M x N store the fused kernels skip) and is None."""
    m, n = x2.shape[0], weight.shape[0]
    keep_pre = keep_pre and act != "none"  # saved for act'(pre) in backward: cheaper than re-running the GEMM
    if backend == "triton":
        from llmpar.kernels import gemm as kernels

        out = torch.empty(m, n, dtype=out_dtype, device=x2.device) if out is None else out
        pre = (
            (pre_out if pre_out is not None else torch.empty(m, n, dtype=x2.dtype, device=x2.device))
            if keep_pre
            else None
        )
        kernels.linear_fwd(x2, weight, bias, r2, out, pre, _ACT_CODE[act], allow_tf32=tf32_allowed())
        return out, pre
    if backend == "cuda" and act == "none" and bias is None and r2 is None and out is not None:
        return torch.matmul(x2, weight.t(), out=out), None  # a plain GEMM straight into the rows of out
    if backend == "cuda":
        ops = _ext_ops()
        if act == "gelu_tanh" and keep_pre:
            y, pre = ops.linear_lt_aux(x2, weight, bias)
        else:
            y = ops.linear_lt(x2, weight, bias, _ACT_CODE[act], r2)
            pre = y if act == "relu" else None
    else:
        pre = F.linear(x2, weight, bias)
        y = act_torch(pre, act)
        y = (y + r2 if r2 is not None else y).to(out_dtype)
        pre = pre if keep_pre else None
    if out is not None:
        y = out.copy_(y)
    if pre_out is not None and pre is not None:
        pre = pre_out.copy_(pre)
    return y, pre


def run_backward(
    grad_out, x2, weight, pre, act, *, has_bias, main_grad, backend, needs=(True, True, True), on_grad_input=None
):
    """(dX, dW or None when accumulated into main_grad, db) for 2-D grad_out/x2/pre; ``on_grad_input(dX)`` runs as
    soon as dX exists, before dW (an input-gradient collective overlaps the weight-gradient GEMM)."""
    need_x, need_w, need_b = needs
    want_b = has_bias and need_b
    dx = dw = db = None
    if backend in ("torch", "cuda"):
        if act == "none":
            gp = grad_out.to(x2.dtype)
            db = gp.sum(0, dtype=torch.float32).to(weight.dtype) if want_b else None
        elif backend == "cuda":  # dY' and db in one pass
            gp, db32 = _ext_ops().bias_act_backward(grad_out, pre, _ACT_CODE[act])
            db = db32.to(weight.dtype) if want_b else None
        else:
            gp = act_grad_torch(grad_out, pre, act)
            db = gp.sum(0, dtype=torch.float32).to(weight.dtype) if want_b else None
        if need_x:
            dx = gp @ weight
            if on_grad_input is not None:
                on_grad_input(dx)
        if main_grad is not None:
            main_grad.add_(_mm_f32(gp.t(), x2))
        elif need_w:
            dw = gp.t() @ x2
        return dx, dw, db
    from llmpar.kernels import gemm as kernels

    code, tf32 = _ACT_CODE[act], tf32_allowed()
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    if need_x:
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
        kernels.linear_bwd_input(grad_out, weight, pre, code, dx, allow_tf32=tf32)
        if on_grad_input is not None:
            on_grad_input(dx)
    if main_grad is not None or need_w or want_b:
        db32 = torch.empty(weight.shape[0], dtype=torch.float32, device=x2.device) if want_b else None
        if main_grad is not None:
            kernels.linear_bwd_weight(grad_out, x2, pre, code, main_grad, db32, accumulate=True, allow_tf32=tf32)
        else:
            # with no weight grad wanted, db still comes from the wgrad kernel's row sums (cost: one GEMM)
            dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
            kernels.linear_bwd_weight(grad_out, x2, pre, code, dw, db32, allow_tf32=tf32)
            dw = dw if need_w else None
        db = db32.to(weight.dtype) if db32 is not None else None
    return dx, dw, db
