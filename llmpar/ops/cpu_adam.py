"""AdamW on float32 CPU tensors in one vectorised pass, with the new params also written, rounded, into ``outs``:
the host step of ZeRO-Offload (fp32 masters, moments and grads on the host; ``outs`` the params' bf16/fp16 copies).

    applied = cpu_adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr=..., beta1=..., beta2=..., eps=...,
                             weight_decay=..., gscale=None, found_inf=None, outs=None)

Math: ``llmpar.ops.adamw_step(precision="fp32")``'s (torch.optim.AdamW's), per element in float32, with t = steps[i]
after its increment:
    g = grad * gscale;  p = p * (1 - lr * wd);  m = lerp(m, g, 1 - beta1);  v = beta2 v + (1 - beta2) g^2
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps);  outs[i] = p rounded to nearest even
Shapes: params[i] any shape; grads[i], exp_avgs[i], exp_avg_sqs[i], outs[i] its numel; steps[i] 0-d float32. All on
the CPU, contiguous, float32 (outs: float32, bfloat16 or float16, one dtype for all). A bfloat16 out is exactly
``params[i].to(torch.bfloat16)``, so copying it to a device param is one memcpy instead of a cast pass.
found_inf (nonzero): the step is skipped, nothing is written, steps keep their count; returns whether it ran.

Backends: the C++ kernel of the CPU extension (csrc/cpu/, ``llmpar::cpu_adamw_step``; AVX-512, AVX2 or scalar, by
what the CPU has, ``LLMPAR_CPU_ISA=avx512|avx2|scalar`` caps it; the same bits on each), JIT-built on first use
(llmpar/ops/_cpu_ext.py); else, or under ``LLMPAR_BACKEND=torch``, the torch path: torch's fused CPU AdamW then
``out.copy_(param)``. Both only read the grads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

import llmpar.ops._cpu_ext as _cpu_ext
from llmpar.ops._dispatch import forced_backend
from llmpar.ops.adamw_torch import torch_fp32

ISAS = ("scalar", "avx2", "avx512", "avx512vbmi")  # position = the ops' ``isa`` code: the widest ISA they may use
# (avx512vbmi: the low-bit kernel's 8-bit dequantize by byte lookups; the fp32 kernel runs its AVX-512 build there)
ISA_ENV = "LLMPAR_CPU_ISA"
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def isa_code() -> int:
    """The widest ISA the kernels may use: ``LLMPAR_CPU_ISA`` (scalar, avx2, avx512, avx512vbmi; unset/auto: the
    widest)."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if value in ("", "auto"):
        return len(ISAS) - 1
    if value not in ISAS:
        raise ValueError(
            f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not an instruction set; use one of {', '.join(ISAS)} or unset it"
        )
    return ISAS.index(value)


def cpu_backend() -> str:
    """What runs the next call: "cpp" (the C++ kernel; may JIT-build it now) or "torch"."""
    if forced_backend() == "torch":
        return "torch"
    return "cpp" if _cpu_ext.load().available else "torch"


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, outs) -> None:
    """The checks of the C++ kernel, for the torch path (same errors: ValueError / TypeError naming the argument)."""
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
        if len(lst) != n:
            raise ValueError(f"cpu_adamw_step: {name} has {len(lst)} tensors but params has {n}")
    if outs and len(outs) != n:
        raise ValueError(f"cpu_adamw_step: outs has {len(outs)} tensors; give none or one per param ({n})")
    named = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if outs:
        named["outs"] = outs
    for name, lst in named.items():
        accepted = OUT_DTYPES if name == "outs" else (torch.float32,)
        for i, t in enumerate(lst):
            if t.dtype not in accepted or (name == "outs" and t.dtype != lst[0].dtype):
                raise TypeError(
                    f"cpu_adamw_step: {name}[{i}] has dtype {t.dtype}; {name} take "
                    f"{', '.join(map(str, accepted))}" + (", one dtype for all" if name == "outs" else "")
                )
            if t.device.type != "cpu":
                raise ValueError(f"cpu_adamw_step: {name}[{i}] is on {t.device}; the kernel runs on CPU tensors")
            if not t.is_contiguous():
                raise ValueError(f"cpu_adamw_step: {name}[{i}] is not contiguous (strides {t.stride()})")
            if t.numel() != params[i].numel():
                raise ValueError(
                    f"cpu_adamw_step: {name}[{i}] has {t.numel()} elements, params[{i}] {params[i].numel()}"
                )
    for i, s in enumerate(steps):
        if s.numel() != 1 or s.dtype != torch.float32 or s.device.type != "cpu":
            raise TypeError(
                f"cpu_adamw_step: steps[{i}] must be a float32 scalar on the CPU, got {s.dtype} of shape "
                f"{tuple(s.shape)} on {s.device}"
            )


def cpu_adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale: float | torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    outs: Sequence[torch.Tensor] | None = None,
) -> bool:
    """One AdamW step in place (see the module docstring); False when ``found_inf`` skipped it."""
    params, grads, exp_avgs, exp_avg_sqs, steps = map(list, (params, grads, exp_avgs, exp_avg_sqs, steps))
    outs = list(outs) if outs is not None else []
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas ({beta1}, {beta2}) must lie in [0, 1)")
    if found_inf is not None and float(found_inf) != 0:
        return False
    if not params:  # (the op could not dispatch without a tensor)
        _check(params, grads, exp_avgs, exp_avg_sqs, steps, outs)
        return True
    hyper = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay))
    with torch.no_grad():
        if cpu_backend() == "cpp":
            torch.ops.llmpar.cpu_adamw_step(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                outs,
                steps,
                hyper["lr"],
                hyper["beta1"],
                hyper["beta2"],
                hyper["eps"],
                hyper["weight_decay"],
                1.0 if gscale is None else float(gscale),
                isa_code(),
            )
            return True
        _check(params, grads, exp_avgs, exp_avg_sqs, steps, outs)
        torch._foreach_add_(steps, 1.0)
        scale = None if gscale is None else torch.as_tensor(float(gscale), dtype=torch.float32)
        if scale is not None:  # torch's fused AdamW unscales the grads in place; this op only reads them
            grads = [g.clone() for g in grads]
        torch_fp32(params, grads, exp_avgs, exp_avg_sqs, steps, gscale=scale, found_inf=None, **hyper)
        for out, p in zip(outs, params):
            out.view(-1).copy_(p.view(-1))
    return True
