"""Grouped GEMM (the experts of a MoE layer in one op): ``out[rows_e] = act(x[rows_e] @ w[e])``, and its backward.

    x: [M, K]   w: [E, K, N] (any strides: packed [E, N, K] weights pass as ``w.transpose(1, 2)``, a view)
    groups: ``counts`` (E row counts, host ints or an int tensor) or ``offs`` (E cumulative row ends, an int tensor:
            group e holds rows [offs[e - 1], offs[e]), offs[-1] = 0, offs[E - 1] = M); groups may be empty
    act "none":   out = x @ w[e]                                            [M, N]
    act "swiglu": [g, u] = x @ w[e] (g: columns [0, N/2), u: [N/2, N)),  out = silu(g) * u   [M, N/2]
Backward, with G = dOut for "none" and G = [dOut * u * silu'(g), dOut * silu(g)] for "swiglu" (g and u recomputed
from x and w, so the [M, N] product is never kept, or kept from the forward: ``recompute``, by default on CUDA only):
    dX[rows_e] = G[rows_e] @ w[e]^T,   dW[e] = x[rows_e]^T @ G[rows_e]  (0 for an empty group; computed as
    (G^T x)^T when w is a transposed view of [E, N, K] weights, so dW lands in the weights' own layout)

Three ``torch.library`` ops, each with a fake impl (FakeTensor, the Meta device and torch.compile trace them with
no kernel) and impls for every device that pick a backend per call (``grouped_gemm_backends.py``: cuda =
``torch._grouped_mm`` where fused, triton = ``llmpar.kernels.grouped_gemm``, torch = the per-expert loop):

    llmpar::grouped_mm(x, w, offs, act, keep_pre) -> (out, pre)  differentiable in x and w (autograd below); pre:
                                                                  [g, u] [M, N] when act 1 and keep_pre, else [0, N]
    llmpar::grouped_mm_swiglu_backward(dh, x, w, offs) -> G       [M, N]
    llmpar::grouped_mm_wgrad(a, b, offs) -> [E, P, Q]             out[e] = a[rows_e]^T b[rows_e]

:func:`grouped_mm` checks the arguments (counts / offsets included: ``offs`` given as a tensor is read on the host,
one device sync on a GPU; pass ``counts`` from the host to avoid it; under torch.compile a counts / offs tensor is
not read: its offsets stay in the graph, so a routing change recompiles nothing) and calls the op: under
torch.compile through the dispatcher (traced as llmpar::grouped_mm), in eager mode through an autograd Function
running the same impls and backward without the dispatcher's round trips.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import llmpar.ops.grouped_gemm_backends as backends

ACTS = ("none", "swiglu")


# --------------------------------------------------------------------------------------------------------- checks


def _check_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, act: int) -> None:
    """Shapes, dtypes and devices (no read of the offsets' values: no device sync)."""
    for name, t in (("x", x), ("w", w), ("offs", offs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_mm: {name} must be a tensor, got {type(t).__name__}")
    if not x.is_floating_point() or x.dtype != w.dtype:
        raise TypeError(f"grouped_mm: x ({x.dtype}) and w ({w.dtype}) must share one floating dtype")
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm: x must be [M, K] and w [E, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)} and w {tuple(w.shape)} disagree on K ({x.shape[1]} vs w's "
            f"dim 1 = {w.shape[1]}); pass packed [E, N, K] weights as w.transpose(1, 2)"
        )
    if w.shape[0] < 1:
        raise ValueError(f"grouped_mm: w {tuple(w.shape)} holds no group (E = 0)")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0] or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"grouped_mm: offs must be an int32/int64 vector of E={w.shape[0]} row ends, got {offs.dtype} "
            f"{tuple(offs.shape)}"
        )
    for name, t in (("w", w), ("offs", offs)):
        if t.device != x.device:
            raise ValueError(f"grouped_mm: {name} is on {t.device} but x is on {x.device}")
    if act not in (0, 1):
        raise ValueError(f"grouped_mm: act code {act} is not one of 0 (none), 1 (swiglu)")
    if act == 1 and w.shape[2] % 2:
        raise ValueError(f"grouped_mm: act='swiglu' needs an even N = 2I (gate, up), w has N = {w.shape[2]}")


def _check_ends(ends: list[int], rows: int, what: str) -> None:
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise ValueError(f"grouped_mm: {what} must be non-decreasing row ends >= 0: offs[{e}]={end} < {prev}")
        prev = end
    if prev != rows:
        raise ValueError(f"grouped_mm: {what} end at row {prev} but x has {rows} rows (offs[-1] must equal M)")


def group_offsets(
    x: torch.Tensor, e_count: int, offs: torch.Tensor | None, counts: Sequence[int] | torch.Tensor | None
) -> torch.Tensor:
    """The checked int32 row ends on x's device from either ``offs`` or ``counts`` (exactly one)."""
    if (offs is None) == (counts is None):
        raise TypeError("grouped_mm: pass exactly one of offs (cumulative row ends) and counts (rows per group)")
    rows = x.shape[0]
    if torch.compiler.is_compiling() and isinstance(offs if counts is None else counts, torch.Tensor):
        return _traced_offsets(x, e_count, offs, counts if isinstance(counts, torch.Tensor) else None)
    if counts is not None:
        if isinstance(counts, torch.Tensor):
            if counts.dim() != 1 or counts.is_floating_point() or counts.dtype == torch.bool:
                raise TypeError(f"grouped_mm: counts must be a 1-D integer tensor, got {counts.dtype} {counts.shape}")
            sizes = counts.tolist()
        else:
            sizes = list(counts)
        if any(isinstance(c, bool) or not isinstance(c, int) for c in sizes):
            raise TypeError(f"grouped_mm: counts must be ints, got {[type(c).__name__ for c in sizes]}")
        if len(sizes) != e_count or any(c < 0 for c in sizes):
            raise ValueError(
                f"grouped_mm: counts must hold {e_count} non-negative row counts (one per group of w), got {sizes}"
            )
        if sum(sizes) != rows:
            raise ValueError(f"grouped_mm: counts sum to {sum(sizes)} but x has {rows} rows")
        ends, total = [], 0
        for c in sizes:
            total += c
            ends.append(total)
        host = torch.tensor(ends, dtype=torch.int32)
        if x.device.type == "cuda":  # pinned: the copy does not wait for the stream's work
            return host.pin_memory().to(x.device, non_blocking=True)
        return host.to(x.device)
    if not isinstance(offs, torch.Tensor) or offs.is_floating_point() or offs.dtype == torch.bool:
        raise TypeError(f"grouped_mm: offs must be an integer tensor of row ends, got {getattr(offs, 'dtype', offs)}")
    if offs.dim() != 1 or offs.shape[0] != e_count:
        raise ValueError(f"grouped_mm: offs must be a vector of E={e_count} row ends, got shape {tuple(offs.shape)}")
    _check_ends(offs.tolist(), rows, "offs")
    return offs.to(device=x.device, dtype=torch.int32)


def _traced_offsets(
    x: torch.Tensor, e_count: int, offs: torch.Tensor | None, counts: torch.Tensor | None
) -> torch.Tensor:
    """Under torch.compile, offsets from a counts / offs tensor with no read of its values (a host read would break
    the graph, or specialise it on the routing): the shape and dtype are checked here, the values are the caller's
    (a dispatcher's counts sum to the rows it sorted)."""
    t = offs if counts is None else counts
    assert t is not None
    if t.dim() != 1 or t.shape[0] != e_count or t.is_floating_point() or t.dtype == torch.bool:
        what = "counts" if offs is None else "offs"
        raise ValueError(f"grouped_mm: {what} must be an integer vector of E={e_count}, got {t.dtype} {tuple(t.shape)}")
    ends = t if counts is None else torch.cumsum(t, 0)
    return ends.to(device=x.device, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------------------ ops


@torch.library.custom_op("llmpar::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, act: int, keep_pre: bool, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_op(x, w, offs, act)
    out, pre = backends.mm(x, w, offs, act, backends.select("grouped_mm", x, w, impl=impl), keep_pre)
    return out, pre if pre is not None else x.new_empty(0, w.shape[2])


@_grouped_mm_op.register_fake
def _grouped_mm_fake(x, w, offs, act, keep_pre, impl="auto"):
    _check_op(x, w, offs, act)
    n = w.shape[2]
    return x.new_empty(x.shape[0], n // 2 if act else n), x.new_empty(x.shape[0] if act and keep_pre else 0, n)


@torch.library.custom_op("llmpar::grouped_mm_swiglu_backward", mutates_args=())
def _swiglu_backward_op(
    dh: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    _check_op(x, w, offs, 1)
    _check_grad(dh, x, w.shape[2] // 2)
    backend = backends.select("grouped_mm_swiglu_backward", x, w, dh, impl=impl)
    return backends.swiglu_backward(dh, x, w, offs, backend)


@_swiglu_backward_op.register_fake
def _swiglu_backward_fake(dh, x, w, offs, impl="auto"):
    _check_op(x, w, offs, 1)
    _check_grad(dh, x, w.shape[2] // 2)
    return x.new_empty(x.shape[0], w.shape[2])


def _check_grad(dh: torch.Tensor, x: torch.Tensor, n: int) -> None:
    if dh.shape != (x.shape[0], n) or dh.dtype != x.dtype or dh.device != x.device:
        raise ValueError(
            f"grouped_mm backward: dh must be {x.dtype} [{x.shape[0]}, {n}] on {x.device}, got "
            f"{dh.dtype} {tuple(dh.shape)} on {dh.device}"
        )


@torch.library.custom_op("llmpar::grouped_mm_wgrad", mutates_args=())
def _wgrad_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    _check_wgrad(a, b, offs)
    return backends.wgrad(a, b, offs, backends.select("grouped_mm_wgrad", a, b, impl=impl))


@_wgrad_op.register_fake
def _wgrad_fake(a, b, offs, impl="auto"):
    _check_wgrad(a, b, offs)
    return a.new_empty(offs.shape[0], a.shape[1], b.shape[1])


def _check_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"grouped_mm_wgrad: a and b must be [M, P] and [M, Q], got {tuple(a.shape)}, {tuple(b.shape)}")
    if a.dtype != b.dtype or not a.is_floating_point():
        raise TypeError(f"grouped_mm_wgrad: a ({a.dtype}) and b ({b.dtype}) must share one floating dtype")
    if offs.dim() != 1 or offs.shape[0] < 1 or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"grouped_mm_wgrad: offs must be an int32/int64 vector of row ends, got {offs.dtype} {tuple(offs.shape)}"
        )
    if b.device != a.device or offs.device != a.device:
        raise ValueError(
            f"grouped_mm_wgrad: a ({a.device}), b ({b.device}) and offs ({offs.device}) must share one device"
        )


def _setup_context(ctx, inputs, output) -> None:
    x, w, offs, act, keep_pre, *impl = inputs
    pre = output[1]
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w, offs, pre)
    ctx.act, ctx.kept, ctx.impl = act, bool(act and keep_pre), impl[0] if impl else "auto"


class _LibraryOps:
    """The backward's GEMMs as the llmpar:: ops (what torch.compile traces)."""

    @staticmethod
    def mm(x, w, offs, impl):
        return torch.ops.llmpar.grouped_mm(x, w, offs, 0, False, impl)[0]

    @staticmethod
    def swiglu_backward(dh, x, w, offs, impl):
        return torch.ops.llmpar.grouped_mm_swiglu_backward(dh, x, w, offs, impl)

    @staticmethod
    def wgrad(a, b, offs, impl):
        return torch.ops.llmpar.grouped_mm_wgrad(a, b, offs, impl)


class _EagerOps:
    """The same impls called directly: eager mode skips the dispatcher's round trips (~0.1 ms of Python per op)."""

    @staticmethod
    def mm(x, w, offs, impl):
        return backends.mm(x, w, offs, 0, backends.select("grouped_mm", x, w, impl=impl))[0]

    @staticmethod
    def swiglu_backward(dh, x, w, offs, impl):
        backend = backends.select("grouped_mm_swiglu_backward", x, w, dh, impl=impl)
        return backends.swiglu_backward(dh, x, w, offs, backend)

    @staticmethod
    def wgrad(a, b, offs, impl):
        return backends.wgrad(a, b, offs, backends.select("grouped_mm_wgrad", a, b, impl=impl))


def _grads(ctx, grad, ops) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dX, dW) of grouped_mm (module docstring) from the saved (x, w, offs, pre)."""
    x, w, offs, pre = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad is None:  # the output took no part in the loss
        grad = x.new_zeros(x.shape[0], w.shape[2] // 2 if ctx.act else w.shape[2])
    if ctx.act:
        if ctx.kept:  # [dh * u * silu'(g), dh * silu(g)] from the kept [g, u], written in place (no cat)
            g = backends.swiglu_grads(grad, pre, torch.empty_like(pre))
        else:
            g = ops.swiglu_backward(grad, x, w, offs, ctx.impl)
    else:
        g = grad
    dx = ops.mm(g, w.transpose(1, 2), offs, ctx.impl) if need_x else None
    dw = None
    if need_w:
        if w.stride(1) == 1 and w.stride(2) != 1:  # w is the transposed view of [E, N, K] weights
            dw = ops.wgrad(g, x, offs, ctx.impl).transpose(1, 2)
        else:
            dw = ops.wgrad(x, g, offs, ctx.impl)
    return dx, dw


def _backward(ctx, grad, _grad_pre):
    return (*_grads(ctx, grad, _LibraryOps), None, None, None, None)


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


class _GroupedMM(torch.autograd.Function):
    """llmpar::grouped_mm in eager mode: the op's impl and backward (``_grads``) without the dispatcher."""

    @staticmethod
    def forward(ctx, x, w, offs, act, keep_pre, impl):  # type: ignore[override]
        out, pre = backends.mm(x, w, offs, act, backends.select("grouped_mm", x, w, impl=impl), keep_pre)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w, offs, pre)
        ctx.act, ctx.kept, ctx.impl = act, pre is not None, impl
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (*_grads(ctx, grad, _EagerOps), None, None, None, None)


def _eager(*tensors: torch.Tensor) -> bool:
    """Plain tensors with data, no tracing and no dispatch mode (FakeTensorMode, FlopCounterMode, ...) active."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta" for t in tensors)


def _run(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, act: int, keep_pre: bool, impl: str = "auto"
) -> torch.Tensor:
    """The op (traced as llmpar::grouped_mm under torch.compile, its fake impl on meta / fake tensors), or on plain
    tensors in eager mode the same impls through an autograd Function."""
    if _eager(x, w, offs):
        return _GroupedMM.apply(x, w, offs, act, keep_pre, impl)
    return torch.ops.llmpar.grouped_mm(x, w, offs, act, keep_pre, impl)[0]


# ------------------------------------------------------------------------------------------------- entry points


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    counts: Sequence[int] | torch.Tensor | None = None,
    act: str = "none",
    recompute: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``out[rows_e] = act(x[rows_e] @ w[e])`` (module docstring); differentiable in x and w.

    x: [M, K], w: [E, K, N], exactly one of ``offs`` ([E] cumulative row ends) and ``counts`` (E rows per group),
    act "none" -> [M, N], "swiglu" -> [M, N/2]. ``recompute`` (swiglu): whether the backward recomputes the product
    [g, u] (one more grouped GEMM) instead of keeping it ([M, N] held from forward to backward); default
    :func:`recompute_default`. ``impl``: the backends allowed, forward and backward (``grouped_gemm_backends``:
    "auto", "native" without Triton, "loop" the per-expert loop). Bad arguments raise a TypeError / ValueError naming
    them."""
    if act not in ACTS:
        raise ValueError(f"grouped_mm: act={act!r} is not one of {', '.join(ACTS)}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"grouped_mm: w must be a [E, K, N] tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"grouped_mm: x must be a tensor, got {type(x).__name__}")
    code = ACTS.index(act)
    _check_op(x, w, torch.empty(w.shape[0], dtype=torch.int32, device=x.device), code)
    ends = group_offsets(x, w.shape[0], offs, counts)
    return _run(x, w, ends, code, not _recompute(recompute, x), backends.check_impl(impl))


def grouped_swiglu(
    x: torch.Tensor,
    counts: Sequence[int] | torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    recompute: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """SwiGLU experts over rows sorted by expert: ``x: [M, H]`` (``counts[e]`` rows for expert e),
    ``gate_up: [E, 2I, H]``, ``down: [E, H, I]`` (transformers' packed layout) -> ``[M, H]``:
    ``down[e] @ (silu(G_e x) * (U_e x))`` per row, the SwiGLU in the first GEMM's epilogue; the offsets are built
    (and checked) once for both GEMMs. ``recompute``, ``impl``: as :func:`grouped_mm`'s."""
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise TypeError("grouped_swiglu: gate_up and down must be tensors")
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"grouped_swiglu: gate_up [E, 2I, H] and down [E, H, I], got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    e_count, two_i, hidden = gate_up.shape
    if two_i % 2 or down.shape != (e_count, hidden, two_i // 2):
        raise ValueError(
            f"grouped_swiglu: down {tuple(down.shape)} does not match gate_up {tuple(gate_up.shape)}: "
            f"expected {(e_count, hidden, two_i // 2)}"
        )
    w1, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)
    _check_op(x, w1, torch.empty(e_count, dtype=torch.int32, device=x.device), 1)
    if down.dtype != gate_up.dtype or down.device != gate_up.device:
        raise TypeError(
            f"grouped_swiglu: down ({down.dtype}, {down.device}) and gate_up ({gate_up.dtype}, "
            f"{gate_up.device}) must share dtype and device"
        )
    ends = group_offsets(x, e_count, None, counts)
    backends.check_impl(impl)
    h = _run(x, w1, ends, 1, not _recompute(recompute, x), impl)
    return _run(h, w2, ends, 0, False, impl)


def recompute_default(device: torch.device) -> bool:
    """Whether the SwiGLU backward recomputes [g, u] by default: on CUDA yes (activation memory is what runs out;
    the fused kernel never writes [g, u]), elsewhere no (the torch loop runs there: a GEMM costs more than memory)."""
    return device.type == "cuda"


def _recompute(recompute: bool | None, x: torch.Tensor) -> bool:
    if recompute is None:
        return recompute_default(x.device)
    if not isinstance(recompute, bool):
        raise TypeError(f"grouped_mm: recompute must be True, False or None (the default), got {recompute!r}")
    return recompute
