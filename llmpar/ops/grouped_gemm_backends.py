"""Which backend runs a grouped GEMM (``grouped_gemm.py``), and the three ops on each.

    cuda    ``torch._grouped_mm``, where it is fused: a CUDA sm_90 device, bfloat16, 16-byte aligned operands (its
            CUTLASS kernels); the SwiGLU epilogue runs after it, unfused
    triton  ``llmpar.kernels.grouped_gemm`` (one launch over all groups, SwiGLU fused in the epilogue), on CUDA
            tensors, or on CPU under TRITON_INTERPRET=1; float32 on CUDA only where torch allows TF32 (else the torch
            loop's cuBLAS beats Triton's FMA loop)
    torch   the per-expert loop: one GEMM per non-empty group straight into its rows of the output (``addmm_`` with
            beta = 0: the call ``torch.mm`` makes, C never read) (the reference, and the CPU path: it runs the same GEMM
            calls as ``F.linear`` per expert under autograd, so it equals that loop bitwise); on CPU, where
            ``torch._grouped_mm`` has its kernel and the operands are aligned, that loop in C++ (the same calls)

``select`` applies ``LLMPAR_BACKEND`` as every op does (llmpar/ops/_dispatch.py): a forced backend that cannot run
raises a RuntimeError (not there) or TypeError (these inputs do not fit it) naming why. A caller narrows the choice with
``impl`` (one of ``IMPLS``; DeepSpeed AutoEP's ``use_grouped_mm`` / ``disable_triton_grouped_mm``): "auto" as above,
"native" never Triton (``torch._grouped_mm`` where fused, else the loop; ``LLMPAR_BACKEND=triton`` is then an error),
"loop" always the per-expert loop (whatever ``LLMPAR_BACKEND`` says). Ops, with ``rows_e`` the rows
``[offs[e - 1], offs[e])`` of group e:

    mm(x, w, offs, act)            out[rows_e] = x[rows_e] @ w[e], act 1: silu(.[:, :I]) * .[:, I:]
    swiglu_backward(dh, x, w, offs)  dgu = [dh * u * silu'(g), dh * silu(g)] for [g, u] = x[rows_e] @ w[e]
    wgrad(a, b, offs)              out[e] = a[rows_e]^T @ b[rows_e], zero for an empty group
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import llmpar.ops._dispatch as _dispatch  # through the module: tests/gpu_replay.py patches its functions

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
IMPLS = ("auto", "native", "loop")  # the backends a caller allows (``select``'s ``impl``)


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned start and leading strides, unit stride in one of the last two dims (what CUTLASS takes)."""
    size = t.element_size()
    if t.data_ptr() % 16 or t.stride(-1) != 1 and t.stride(-2) != 1:
        return False
    return all((s * size) % 16 == 0 for d, s in enumerate(t.stride()) if s != 1 and t.shape[d] > 1)


def torch_gmm_unfit(tensors: tuple[torch.Tensor, ...]) -> tuple[str, bool] | None:
    """(why ``torch._grouped_mm`` is not the fused kernel for these tensors, whether that is about the machine
    rather than the inputs), or None when it is."""
    x = tensors[0]
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm", True
    if x.device.type != "cuda":
        return f"tensors are on {x.device.type}; torch._grouped_mm's fused kernel runs on CUDA", True
    major, minor = torch.cuda.get_device_capability(x.device)
    if major != 9:
        return f"torch._grouped_mm is fused (CUTLASS) on sm_90; this device is sm_{major}{minor}", True
    if any(t.dtype != torch.bfloat16 for t in tensors):
        return f"dtype {x.dtype}: torch._grouped_mm's fused kernel takes bfloat16", False
    if not all(_aligned(t) for t in tensors):
        return "an operand is not 16-byte aligned (start, leading strides) or has no unit stride", False
    return None


def _kernel_unfit(tensors: tuple[torch.Tensor, ...]) -> str | None:
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES:
            return f"dtype {t.dtype} (the Triton kernels take float32, float16, bfloat16)"
    return None


def _triton_slow(x: torch.Tensor) -> str | None:
    if x.dtype == torch.float32 and x.device.type == "cuda" and not _dispatch.tf32_allowed():
        return "float32 without TF32: Triton would multiply on the FMA units, cuBLAS (the torch loop) is faster"
    return None


def check_impl(impl: object) -> str:
    """``impl`` if it is one of ``IMPLS``, else a ValueError naming it."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_mm: impl={impl!r} is not one of {', '.join(IMPLS)}")
    return impl  # type: ignore[return-value]


def select(op: str, *tensors: torch.Tensor, impl: str = "auto") -> str:
    """The backend of ``op`` (cuda, triton or torch) for these operands, among those ``impl`` allows (module
    docstring)."""
    device = tensors[0].device
    forced, env = _dispatch.forced_backend(), _dispatch.ENV
    if forced == "torch" or check_impl(impl) == "loop":
        return "torch"
    if forced == "triton" and impl == "native":
        raise RuntimeError(f"{env}=triton but {op} was asked for no Triton kernel (impl='native'); unset {env}")
    gmm = torch_gmm_unfit(tensors)
    if forced == "cuda":
        if gmm is not None:
            err = RuntimeError if gmm[1] else TypeError
            raise err(f"{env}=cuda but {op} cannot use torch._grouped_mm: {gmm[0]}; unset {env} to choose another")
        return "cuda"
    unfit = _kernel_unfit(tensors)
    if forced == "triton":
        why = _dispatch.triton_unavailable_reason(device)
        if why is not None:
            raise RuntimeError(f"{env}=triton but the triton backend cannot run {op}: {why}")
        if unfit is not None:
            raise TypeError(f"{env}=triton but {op} cannot use the triton kernel: {unfit}; unset {env} for torch")
        return "triton"
    if gmm is None:
        return "cuda"
    if impl == "native":
        return "torch"
    if unfit is None and _triton_slow(tensors[0]) is None and _dispatch.triton_unavailable_reason(device) is None:
        return "triton"
    return "torch"


def _cpu_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor | None:
    """torch._grouped_mm on CPU tensors (a: [M, K] and b: [E, K, N], or a: [K, M] and b: [M, N] for the weight
    grad): the per-group ``mm`` loop in C++ (the same GEMM calls, so the same bits, without Python's per-group cost),
    where this torch has it and the operands are 16-byte aligned; else None (the Python loop runs)."""
    if a.device.type != "cpu" or not hasattr(torch, "_grouped_mm") or a.dtype not in KERNEL_DTYPES:
        return None
    if min(a.shape) == 0 or not (_aligned(a) and _aligned(b)) or (b.shape[-1] * b.element_size()) % 16:
        return None
    try:
        return torch._grouped_mm(a, b, offs=_int32(offs))
    except (RuntimeError, NotImplementedError):  # a torch without the CPU kernel, or a layout it refuses
        return None


def _sizes(offs: torch.Tensor) -> list[int]:
    ends = offs.tolist()
    return [e - s for s, e in zip([0] + ends[:-1], ends)]


def _int32(offs: torch.Tensor) -> torch.Tensor:
    return offs if offs.dtype == torch.int32 else offs.to(torch.int32)


# ------------------------------------------------------------------------------------------------------ forward


def mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, act: int, backend: str, keep_pre: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, pre) for x: [M, K], w: [E, K, N]: out [M, N] (act 0) or [M, N / 2] (act 1, SwiGLU); pre the product
    [g, u]: [M, N] when act 1 and ``keep_pre`` (for a backward that does not recompute it), else None."""
    m, n = x.shape[0], w.shape[2]
    n_out = n // 2 if act else n
    keep_pre = bool(act) and keep_pre
    if backend == "triton":
        from llmpar.kernels import grouped_gemm as kernels

        out = x.new_empty(m, n_out)
        pre = x.new_empty(m, n) if keep_pre else None
        kernels.grouped_mm(x, w, offs, out, epi=act, pre=pre, allow_tf32=_dispatch.tf32_allowed())
        return out, pre
    if backend == "cuda":
        gu = torch._grouped_mm(x.contiguous(), w, offs=_int32(offs)) if m else x.new_zeros(0, n)
        if not act:
            return gu, None
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up, gu if keep_pre else None
    prod = _cpu_loop(x, w, offs)
    if prod is None:  # [g, u] for SwiGLU (then one elementwise pass over all groups), else the output
        prod = x.new_empty(m, n)
        start = 0
        for e, rows in enumerate(_sizes(offs)):
            if rows:  # torch.mm's own call, in place
                prod[start : start + rows].addmm_(x[start : start + rows], w[e], beta=0)
            start += rows
    if not act:
        return prod, None
    gate, up = prod.chunk(2, dim=-1)
    return torch.mul(F.silu(gate), up), prod if keep_pre else None


# ----------------------------------------------------------------------------------------------------- backward


def swiglu_grads(dh: torch.Tensor, gu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = [dh * u * silu'(g), dh * silu(g)] for gu = [g, u], with torch's own silu_backward (as autograd);
    returns out."""
    gate, up = gu.chunk(2, dim=-1)
    i = gate.shape[1]
    torch.mul(dh, F.silu(gate), out=out[:, i:])
    torch.ops.aten.silu_backward.grad_input(dh * up, gate, grad_input=out[:, :i])
    return out


def swiglu_backward(dh: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: str):
    """dgu: [M, N] for dh: [M, N / 2], x: [M, K], w: [E, K, N] (g, u recomputed: the [M, N] product is not kept)."""
    m, n = x.shape[0], w.shape[2]
    out = x.new_empty(m, n)
    if backend == "triton":
        from llmpar.kernels import grouped_gemm as kernels

        kernels.grouped_mm(x, w, offs, out, epi=2, dh=dh, allow_tf32=_dispatch.tf32_allowed())
    elif backend == "cuda":
        if m:
            swiglu_grads(dh, torch._grouped_mm(x.contiguous(), w, offs=_int32(offs)), out)
    else:
        start = 0
        for e, rows in enumerate(_sizes(offs)):
            if rows:
                r = slice(start, start + rows)
                swiglu_grads(dh[r], torch.mm(x[r], w[e]), out[r])
            start += rows
    return out


def wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """[E, P, Q] with out[e] = a[rows_e]^T @ b[rows_e] (zero for an empty group), a: [M, P], b: [M, Q]."""
    e_count, p, q = offs.shape[0], a.shape[1], b.shape[1]
    if backend == "triton":
        from llmpar.kernels import grouped_gemm as kernels

        out = a.new_empty(e_count, p, q)
        kernels.grouped_wgrad(a, b, offs, out, allow_tf32=_dispatch.tf32_allowed())
        return out
    if backend == "cuda":
        if a.shape[0] == 0:  # a zero-length contraction: torch._grouped_mm refuses its strides
            return a.new_zeros(e_count, p, q)
        return torch._grouped_mm(a.contiguous().t(), b.contiguous(), offs=_int32(offs))
    looped = _cpu_loop(a.t(), b, offs)
    if looped is not None:
        return looped
    out = a.new_empty(e_count, p, q)
    start = 0
    for e, rows in enumerate(_sizes(offs)):
        if rows:
            out[e].addmm_(a[start : start + rows].t(), b[start : start + rows], beta=0)
        else:
            out[e].zero_()
        start += rows
    return out
