"""The fused low-bit AdamW kernels behind ``llmpar.ops.lowbit.adamw_lowbit_step``: CPU C++ (the offload host step),
Triton and CUDA C++. One pass per block of B elements reads codes + scales + grad + param (or master), dequantizes,
updates, finds the new block absmax, re-quantizes and writes codes, scales and param (and the bf16 param rounded
from the master). The math and the state layout are the contract of ``llmpar/ops/lowbit.py``; this module only
chooses and calls kernels.

Every entry point has the signature of ``lowbit.adamw_lowbit_step`` plus the maps:
    fn(params, grads, m_codes, m_scales, v_codes, v_scales, steps, masters, *, bits, lr, beta1, beta2, eps,
       weight_decay, gscale=None, found_inf=None, qmap_m, qmap_v) -> bool
and, like it, increments ``steps`` (float32 0-d tensors) unless found_inf is nonzero, then skips everything.
``cpu_step`` / ``triton_step`` / ``cuda_step`` run one backend (TypeError naming the argument when the inputs do not
suit it, RuntimeError when it is unavailable); ``adamw_lowbit_step`` picks one and returns False when none suits the
inputs (the caller then runs its torch path).

Inputs the kernels take: params float32 (no masters), or bfloat16 params with float32 masters; grads float32 (CPU) or
float32 / bfloat16 / float16 (GPU); every tensor contiguous and on one device; maps float32 [2^bits].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import llmpar.ops._cpu_ext as _cpu_ext
from llmpar.ops._dispatch import forced_backend, select_backend, triton_unavailable_reason
from llmpar.ops.cpu_adam import isa_code

__all__ = ["adamw_lowbit_step", "cpu_step", "triton_step", "cuda_step", "kernel_unfit"]

_GPU_GRADS = (torch.float32, torch.bfloat16, torch.float16)


def kernel_unfit(params, grads, m_codes, m_scales, v_codes, v_scales, masters, *, cpu: bool) -> str | None:
    """None when the kernels take these inputs, else why not (naming the argument)."""
    named = {
        "params": params,
        "grads": grads,
        "m_codes": m_codes,
        "m_scales": m_scales,
        "v_codes": v_codes,
        "v_scales": v_scales,
    }
    if masters is not None:
        named["masters"] = masters
    device = params[0].device if params else None
    for name, lst in named.items():
        for i, t in enumerate(lst):
            if not t.is_contiguous():
                return f"{name}[{i}] is not contiguous"
            if t.device != device:
                return f"{name}[{i}] is on {t.device}, params[0] on {device}"
    for i, p in enumerate(params):
        if masters is None and p.dtype != torch.float32:
            return f"params[{i}] has dtype {p.dtype}; without masters the kernels take float32 params"
        if masters is not None and p.dtype != torch.bfloat16:
            return f"params[{i}] has dtype {p.dtype}; with masters the kernels take bfloat16 params"
        accepted = (torch.float32,) if cpu else _GPU_GRADS
        if grads[i].dtype not in accepted or grads[i].dtype != grads[0].dtype:
            return (
                f"grads[{i}] has dtype {grads[i].dtype}; the kernels take {', '.join(map(str, accepted))}, "
                "one dtype for all"
            )
    return None


def _hyper_check(bits: int, beta1: float, beta2: float, qmap_m: torch.Tensor, qmap_v: torch.Tensor) -> None:
    if bits not in (8, 4):
        raise ValueError(f"bits={bits!r}; the kernels take 8 or 4")
    if not 0.0 < beta1 < 1.0 or not 0.0 < beta2 < 1.0:
        raise ValueError(f"betas ({beta1}, {beta2}) must lie in (0, 1) for the kernels")
    for name, q in (("qmap_m", qmap_m), ("qmap_v", qmap_v)):
        if q.dtype != torch.float32 or q.dim() != 1 or q.numel() != 2**bits:
            raise TypeError(f"{name} must be float32 [{2**bits}], got {q.dtype} {tuple(q.shape)}")


def _skipped(found_inf) -> bool:
    return found_inf is not None and float(found_inf) != 0


def _flat(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(-1) for t in ts]


def cpu_step(
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    steps,
    masters=None,
    *,
    bits: int,
    lr,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale=None,
    found_inf=None,
    qmap_m: torch.Tensor,
    qmap_v: torch.Tensor,
) -> bool:
    """The CPU C++ kernel (csrc/cpu/adam_lowbit*.cpp, ``llmpar::cpu_adamw_lowbit_step``): AVX-512 (+ VBMI / BF16),
    AVX2 or scalar by the CPU (``LLMPAR_CPU_ISA`` caps it; the same bits on each), at::parallel_for over blocks; the
    bf16 params written in the same pass."""
    _hyper_check(bits, beta1, beta2, qmap_m, qmap_v)
    why = kernel_unfit(params, grads, m_codes, m_scales, v_codes, v_scales, masters, cpu=True)
    if why is None and params and params[0].device.type != "cpu":
        why = f"params are on {params[0].device}; cpu_step takes CPU tensors"
    if why is not None:
        raise TypeError(f"cpu_step: {why}")
    status = _cpu_ext.load()
    if not status.available:
        raise RuntimeError(f"cpu_step: the CPU extension is unavailable: {status.reason}")
    if _skipped(found_inf):
        return True
    torch._foreach_add_(list(steps), 1.0)
    if not params:
        return True
    ts = [int(float(s)) for s in steps]
    weights = masters if masters is not None else params
    outs = _flat(params) if masters is not None else []
    torch.ops.llmpar.cpu_adamw_lowbit_step(
        _flat(weights),
        _flat(grads),
        _flat(m_codes),
        _flat(m_scales),
        _flat(v_codes),
        _flat(v_scales),
        outs,
        qmap_m.cpu(),
        qmap_v.cpu(),
        ts,
        int(bits),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        1.0 if gscale is None else float(gscale),
        isa_code(),
    )
    return True


def _gpu_scalars(device, lr, gscale, found_inf):
    """(lr float or None, lr tensor or None, gscale tensor or None, found_inf tensor or None) on ``device``."""

    def dev(x):
        return None if x is None else torch.as_tensor(x, dtype=torch.float32, device=device).reshape(())

    lr_t = dev(lr) if isinstance(lr, torch.Tensor) else None
    return (None if lr_t is not None else float(lr)), lr_t, dev(gscale), dev(found_inf)


def _count_step(steps, found_inf) -> None:
    """steps += 1 unless found_inf (a device scalar: no host sync)."""
    if found_inf is None:
        torch._foreach_add_(list(steps), 1.0)
    else:
        torch._foreach_add_(list(steps), (found_inf == 0).to(torch.float32))


def triton_step(
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    steps,
    masters=None,
    *,
    bits: int,
    lr,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale=None,
    found_inf=None,
    qmap_m: torch.Tensor,
    qmap_v: torch.Tensor,
) -> bool:
    """The Triton kernel (kernels/adamw_lowbit.py): CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``."""
    from llmpar.kernels import adamw_lowbit as tk

    _hyper_check(bits, beta1, beta2, qmap_m, qmap_v)
    why = kernel_unfit(params, grads, m_codes, m_scales, v_codes, v_scales, masters, cpu=False)
    if why is not None:
        raise TypeError(f"triton_step: {why}")
    if not params:
        _count_step(steps, None if found_inf is None else torch.as_tensor(found_inf))
        return True
    device = params[0].device
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"triton_step: {reason}")
    lr_f, lr_t, gs, fi = _gpu_scalars(device, lr, gscale, found_inf)
    _count_step(steps, fi)
    tk.step(
        _flat(params),
        _flat(grads),
        _flat(m_codes),
        _flat(m_scales),
        _flat(v_codes),
        _flat(v_scales),
        None if masters is None else _flat(masters),
        list(steps),
        qmap_m.to(device),
        qmap_v.to(device),
        bits=int(bits),
        lr=lr_t if lr_t is not None else lr_f,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        gscale=gs,
        found_inf=fi,
    )
    return True


def cuda_step(
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    steps,
    masters=None,
    *,
    bits: int,
    lr,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale=None,
    found_inf=None,
    qmap_m: torch.Tensor,
    qmap_v: torch.Tensor,
) -> bool:
    """The CUDA C++ kernel (csrc/adamw_lowbit_kernels.cu, ``llmpar::adamw_lowbit_step``)."""
    _hyper_check(bits, beta1, beta2, qmap_m, qmap_v)
    why = kernel_unfit(params, grads, m_codes, m_scales, v_codes, v_scales, masters, cpu=False)
    if why is not None:
        raise TypeError(f"cuda_step: {why}")
    if not params:
        _count_step(steps, None if found_inf is None else torch.as_tensor(found_inf))
        return True
    device = params[0].device
    lr_f, lr_t, gs, fi = _gpu_scalars(device, lr, gscale, found_inf)
    _count_step(steps, fi)
    torch.ops.llmpar.adamw_lowbit_step(
        _flat(params),
        _flat(grads),
        _flat(m_codes),
        _flat(m_scales),
        _flat(v_codes),
        _flat(v_scales),
        [] if masters is None else _flat(masters),
        list(steps),
        qmap_m.to(device),
        qmap_v.to(device),
        int(bits),
        0.0 if lr_f is None else lr_f,
        lr_t,
        gs,
        fi,
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
    )
    return True


def adamw_lowbit_step(
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    steps,
    masters=None,
    *,
    bits: int,
    lr,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale=None,
    found_inf=None,
    qmap_m: torch.Tensor,
    qmap_v: torch.Tensor,
) -> bool:
    """Run the step on the best kernel for the inputs' device; False (nothing done) when none suits them.

    CPU tensors: the C++ kernel (unless ``LLMPAR_BACKEND`` is torch, or triton: then the interpreter); CUDA tensors:
    ``select_backend`` (CUDA extension -> Triton -> torch)."""
    params = list(params)
    if not params or beta1 <= 0.0 or beta2 <= 0.0 or not (math.isfinite(beta1) and math.isfinite(beta2)):
        return False
    device = params[0].device
    kw = dict(
        bits=bits,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        gscale=gscale,
        found_inf=found_inf,
        qmap_m=qmap_m,
        qmap_v=qmap_v,
    )
    args = (params, grads, m_codes, m_scales, v_codes, v_scales, steps, masters)
    forced = forced_backend()
    if device.type == "cpu" and forced is None:
        if kernel_unfit(*args[:6], masters, cpu=True) is not None or not _cpu_ext.load().available:
            return False
        return cpu_step(*args, **kw)
    why = kernel_unfit(*args[:6], masters, cpu=False)
    backend = select_backend(device, kernel_unfit=why, op="adamw_lowbit_step")
    if backend == "cuda":
        return cuda_step(*args, **kw)
    if backend == "triton":
        return triton_step(*args, **kw)
    return False
