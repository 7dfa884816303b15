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

``linear_act_rows`` is the chunk entry point: rows [start, end) of x into rows [start, end) of a preallocated out
(and of ``pre_out``), so that an overlapped forward can compute chunk i+1 while chunk i is being reduced;
``linear_act_forward`` (y and pre) and ``linear_act_backward`` (with a hook called as soon as dX exists, before dW)
serve callers that run their own autograd Function, such as the tensor-parallel linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpar.ops._dispatch import select_backend, tf32_allowed

ACTIVATIONS = ("none", "gelu_tanh", "gelu_erf", "silu", "relu")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}  # same codes as llmpar.kernels.gemm.ACTS
LT_ACTS = ("none", "gelu_tanh", "relu")  # activations with a cuBLASLt epilogue (llmpar::linear_lt)


def _act_torch(z: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if act == "gelu_erf":
        return F.gelu(z)
    if act == "silu":
        return F.silu(z)
    if act == "relu":
        return F.relu(z)
    return z


def _act_grad_torch(g: torch.Tensor, z: torch.Tensor, act: str) -> torch.Tensor:
    """g * act'(z), as torch autograd computes it (g cast to z's dtype first)."""
    g = g.to(z.dtype)
    if act == "gelu_tanh":
        return torch.ops.aten.gelu_backward(g, z, approximate="tanh")
    if act == "gelu_erf":
        return torch.ops.aten.gelu_backward(g, z)
    if act == "silu":
        return torch.ops.aten.silu_backward(g, z)
    if act == "relu":
        return torch.ops.aten.threshold_backward(g, z, 0)
    return g


def act_grad_f32(z: torch.Tensor, act: str) -> torch.Tensor:
    """act'(z) in float32 with the formulas of the kernels (Triton ``_act_grad``, csrc/bias_act_kernels.cu)."""
    z = z.float()
    if act == "gelu_tanh":
        t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * z * z)
    if act == "gelu_erf":
        return 0.5 * (1 + torch.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * torch.exp(-0.5 * z * z)
    if act == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if act == "relu":
        return (z > 0).float()
    return torch.ones_like(z)


def bias_act_backward_reference(grad: torch.Tensor, pre: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of ``llmpar::bias_act_backward`` in torch: (dY * act'(z) in pre's dtype, its fp32 column sums)."""
    gp = grad.float() * act_grad_f32(pre, ACTIVATIONS[act])
    return gp.to(pre.dtype), gp.sum(0)


def linear_lt_reference(x, weight, bias, act: int, residual):
    """The math of ``llmpar::linear_lt`` in torch: fp32 accumulate, act, residual, one rounding to x's dtype."""
    z = x.float() @ weight.float().t() + (bias.float() if bias is not None else 0)
    y = _act_torch(z, ACTIVATIONS[act])
    return (y + residual.float() if residual is not None else y).to(x.dtype)


def linear_lt_aux_reference(x, weight, bias):
    """The math of ``llmpar::linear_lt_aux`` in torch: (gelu_tanh(z), z), both rounded to x's dtype."""
    z = x.float() @ weight.float().t() + (bias.float() if bias is not None else 0)
    return F.gelu(z, approximate="tanh").to(x.dtype), z.to(x.dtype)


def _ext_ops():
    """Where the extension ops live (on CPU tensors they run the references registered in ``_library``; tests wrap
    them to see that the CUDA path calls them)."""
    return torch.ops.llmpar


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
    unfit = _kernel_unfit(x, None, grad_out.dtype, *x.shape, grad_out.shape[-1])
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


def _forward(x2, weight, bias, r2, act, out_dtype, backend, *, out=None, pre_out=None, keep_pre=True):
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
        y = _act_torch(pre, act)
        y = (y + r2 if r2 is not None else y).to(out_dtype)
        pre = pre if keep_pre else None
    if out is not None:
        y = out.copy_(y)
    if pre_out is not None and pre is not None:
        pre = pre_out.copy_(pre)
    return y, pre


def _backward(
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
            gp = _act_grad_torch(grad_out, pre, act)
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


class _LinearAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, residual2, act, out_dtype, main_grad, backend):
        out, pre = _forward(x2, weight, bias, residual2, act, out_dtype, backend)
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
        dx, dw, db = _backward(
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
            y, _ = _forward(x.reshape(-1, k), weight, bias, r2, act, out_dtype, backend, keep_pre=False)
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
        return _forward(x, weight, bias, residual, act, out_dtype, backend)


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
        _forward(
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
        return _backward(
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
