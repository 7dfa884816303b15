"""Fused AdamW step over many tensors, in every precision mode, with the grad-clip coefficient and found-inf inside.

Math (torch.optim.AdamW's, decoupled weight decay), per element in float32 (float64 for float64 data, torch path),
with t = the tensor's step after this call's increment:
    g = grad * gscale;  p = p * (1 - lr * wd);  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
Precision modes (what each stores per parameter, besides the param itself):
    "fp32"        fp32 params, fp32 m, v                                   (8 B of state)
    "fp32_master" bf16/fp16 params, fp32 master + m + v; the param is the master rounded to nearest  (12 B)
    "bf16_sr"     bf16 params, bf16 m, v; every write stochastically rounded (unbiased), reproducible per seed  (4 B)
    "bf16_kahan"  bf16 params, bf16 m, v (nearest), bf16 Kahan compensation of the param update  (6 B)
Shapes: params[i] any shape; grads[i], exp_avgs[i], exp_avg_sqs[i], extras[i] the same numel; steps[i] 0-d float32.

``MODES`` below is the one table of these modes: a mode's position in it is the integer code the kernels take, and
``check_precision`` / ``resolve_precision`` / ``check_param_dtype`` are the checks (FusedAdamW uses them too).

Backends (``_dispatch``): CUDA extension (``llmpar::adamw_step``, registered in ``_library``) -> Triton
(``llmpar.kernels.adamw``) -> torch. The kernels do all tensors in one launch with no host sync (lr, gscale, found_inf
and steps may live on the device). The torch path (``adamw_torch.py``) uses ``torch._fused_adamw_`` for the float32
math where it can (CPU and CUDA), and foreach ops plus host-drawn random bits for the bf16 modes; it reads
lr/steps/found_inf on the host (a sync on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmpar.ops._dispatch import select_backend
from llmpar.ops.adamw_torch import torch_step

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTO = "auto"  # FusedAdamW's per-dtype choice (``resolve_precision``)


@dataclass(frozen=True, kw_only=True)
class ModeSpec:
    """Dtypes of one precision mode: params accepted, moments, and the extra per-param buffer (name, dtype) if any."""

    param_dtypes: tuple[torch.dtype, ...]
    moment_dtype: torch.dtype | None  # None: the param's dtype
    extra: tuple[str, torch.dtype] | None


# The one table of the precision modes. A mode's position is its integer code: the ``mode_code`` argument of
# llmpar::adamw_step, the MODE constexpr of the Triton kernel (llmpar.kernels.adamw) and the C enum LlmparAdamwMode of
# csrc/adamw.cuh (tests/test_optim_build.py checks the enum against this table).
MODES: dict[str, ModeSpec] = {
    "fp32": ModeSpec(param_dtypes=(torch.float32, torch.float64), moment_dtype=None, extra=None),
    "fp32_master": ModeSpec(
        param_dtypes=(torch.bfloat16, torch.float16), moment_dtype=torch.float32, extra=("master", torch.float32)
    ),
    "bf16_sr": ModeSpec(param_dtypes=(torch.bfloat16,), moment_dtype=torch.bfloat16, extra=None),
    "bf16_kahan": ModeSpec(
        param_dtypes=(torch.bfloat16,), moment_dtype=torch.bfloat16, extra=("kahan_comp", torch.bfloat16)
    ),
}
PRECISIONS: tuple[str, ...] = tuple(MODES)


def check_precision(precision: object, *, allow_auto: bool = False) -> str:
    """``precision`` as a mode name, or a ValueError naming the modes (and "auto" when ``allow_auto``)."""
    if precision in MODES or (allow_auto and precision == AUTO):
        return str(precision)
    accepted = ("'auto' or " if allow_auto else "") + f"one of {', '.join(PRECISIONS)}"
    raise ValueError(f"precision={precision!r} is not a mode; use {accepted}")


def mode_code(precision: str) -> int:
    """The integer code of a mode (its position in MODES): what the CUDA op and the Triton kernel take."""
    return PRECISIONS.index(check_precision(precision))


def resolve_precision(precision: str, dtype: torch.dtype) -> str:
    """The mode a param of ``dtype`` runs in under ``precision`` ("auto": "fp32" for float32/float64 params,
    "fp32_master" for the others). Validates ``precision``; the dtype is checked by ``check_param_dtype``."""
    if check_precision(precision, allow_auto=True) == AUTO:
        return "fp32" if dtype in MODES["fp32"].param_dtypes else "fp32_master"
    return precision


def check_param_dtype(precision: str, dtype: torch.dtype, what: str = "params") -> None:
    """TypeError naming ``what`` (e.g. "params[3]") unless mode ``precision`` takes params of ``dtype``."""
    accepted = MODES[check_precision(precision)].param_dtypes
    if dtype not in accepted:
        raise TypeError(
            f"{what} has dtype {dtype}; precision={precision!r} takes {', '.join(map(str, accepted))} params"
        )


def _check_lists(precision: str, params, grads, exp_avgs, exp_avg_sqs, extras, steps) -> None:
    spec = MODES[precision]
    n = len(params)
    named = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if spec.extra is not None:
        if extras is None:
            raise ValueError(f"precision={precision!r} needs extras= (the {spec.extra[0]} buffers)")
        named["extras"] = extras
    elif extras is not None:
        raise ValueError(f"precision={precision!r} takes no extras, got {len(extras)} tensors")
    for name, lst in named.items():
        if len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} tensors but params has {n}")
    for i, p in enumerate(params):
        check_param_dtype(precision, p.dtype, f"params[{i}]")
        moment = spec.moment_dtype or p.dtype
        for name in ("grads", "exp_avgs", "exp_avg_sqs") + (("extras",) if spec.extra else ()):
            t = named[name][i]
            if t.numel() != p.numel() or t.device != p.device:
                raise ValueError(
                    f"{name}[{i}] ({t.numel()} elements on {t.device}) does not match params[{i}] "
                    f"({p.numel()} elements on {p.device})"
                )
            want = {"exp_avgs": moment, "exp_avg_sqs": moment, "extras": spec.extra[1] if spec.extra else None}.get(
                name
            )
            if want is not None and t.dtype != want:
                raise TypeError(f"{name}[{i}] has dtype {t.dtype}; precision={precision!r} keeps it in {want}")
        if not grads[i].is_floating_point():
            raise TypeError(f"grads[{i}] has dtype {grads[i].dtype}; gradients are floating point")
        s = steps[i]
        if s.numel() != 1 or s.dtype != torch.float32:
            raise TypeError(f"steps[{i}] must be a float32 scalar tensor, got {s.dtype} of shape {tuple(s.shape)}")


def _kernel_unfit(params, grads, exp_avgs, exp_avg_sqs, extras, steps, lr, gscale, found_inf) -> str | None:
    device = params[0].device
    for name, lst in (
        ("params", params),
        ("grads", grads),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
        ("extras", extras or []),
    ):
        if len({t.dtype for t in lst}) > 1:
            return f"{name} mixes dtypes"
        for t in lst:
            if t.dtype not in _KERNEL_DTYPES:
                return f"{name} has dtype {t.dtype} (kernels take float32, bfloat16, float16)"
            if not t.is_contiguous():
                return f"some {name} are not contiguous"
    for name, t in (("steps", steps[0]), ("lr", lr), ("gscale", gscale), ("found_inf", found_inf)):
        if isinstance(t, torch.Tensor) and (t.device != device or t.dtype != torch.float32 or t.numel() != 1):
            return f"{name} must be a float32 scalar on {device} (got {t.dtype} on {t.device})"
    if any(s.device != device for s in steps):
        return f"steps must live on {device}"
    return None


def step_salts(salts: Sequence[int] | None, n: int) -> list[int]:
    """The stochastic-rounding salt of each of ``n`` tensors: ``salts`` as ints, or 0 .. n-1."""
    out = list(range(n)) if salts is None else [int(s) for s in salts]
    if len(out) != n:
        raise ValueError(f"salts has {len(out)} entries but params has {n}")
    return out


def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    precision: str,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    extras: Sequence[torch.Tensor] | None = None,
    gscale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    seed: int = 0,
    salts: Sequence[int] | None = None,
) -> None:
    """One AdamW step, in place, over all tensors (see the module docstring); increments ``steps`` unless found_inf.

    extras: the float32 masters ("fp32_master") or bf16 compensations ("bf16_kahan"), else None.
    gscale: float32 scalar multiplying every grad (clip coefficient); found_inf: float32 scalar, nonzero skips the step
    (params, state and steps unchanged). seed/salts: the stochastic-rounding stream of "bf16_sr" is a function of
    (seed, step, salts[i], element); salts default to 0..n-1 (pass stable ids when calling on subsets).
    Grads are read only, except on the torch "fp32"/"fp32_master" paths when gscale is given: there they are left
    multiplied by it (as ``clip_grad_norm_`` leaves them).
    """
    precision = check_precision(precision)
    params, grads, exp_avgs, exp_avg_sqs, steps = map(list, (params, grads, exp_avgs, exp_avg_sqs, steps))
    extras = list(extras) if extras is not None else None
    _check_lists(precision, params, grads, exp_avgs, exp_avg_sqs, extras, steps)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas ({beta1}, {beta2}) must lie in [0, 1)")
    if not params:
        return
    salts = step_salts(salts, len(params))
    unfit = _kernel_unfit(params, grads, exp_avgs, exp_avg_sqs, extras, steps, lr, gscale, found_inf)
    backend = select_backend(params[0].device, kernel_unfit=unfit, op="adamw_step")
    live = [i for i, p in enumerate(params) if p.numel() > 0]
    with torch.no_grad():
        torch._foreach_add_(steps, 1.0)
        if live:
            sp, sg, sm, sv, ss = ([lst[i] for i in live] for lst in (params, grads, exp_avgs, exp_avg_sqs, steps))
            ex = [extras[i] for i in live] if extras is not None else None
            if backend == "cuda":
                lr_t = lr if isinstance(lr, torch.Tensor) else None
                torch.ops.llmpar.adamw_step(
                    sp,
                    sg,
                    sm,
                    sv,
                    ex or [],
                    ss,
                    [salts[i] for i in live],
                    mode_code(precision),
                    0.0 if lr_t is not None else float(lr),
                    lr_t,
                    gscale,
                    found_inf,
                    float(beta1),
                    float(beta2),
                    float(eps),
                    float(weight_decay),
                    int(seed),
                )
            elif backend == "triton":
                from llmpar.kernels import adamw as triton_adamw

                triton_adamw.step(
                    sp,
                    sg,
                    sm,
                    sv,
                    ex,
                    ss,
                    [salts[i] for i in live],
                    mode=mode_code(precision),
                    lr=lr if isinstance(lr, torch.Tensor) else float(lr),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(eps),
                    weight_decay=float(weight_decay),
                    gscale=gscale,
                    found_inf=found_inf,
                    seed=seed,
                )
            else:
                torch_step(
                    precision,
                    sp,
                    sg,
                    sm,
                    sv,
                    ss,
                    ex,
                    [salts[i] for i in live],
                    lr=lr,
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(eps),
                    weight_decay=float(weight_decay),
                    gscale=gscale,
                    found_inf=found_inf,
                    seed=seed,
                )
        if found_inf is not None:  # a skipped step does not count: undo the increment where found_inf != 0
            skipped = (found_inf.to(steps[0].device).reshape(()) != 0).to(torch.float32)
            torch._foreach_sub_(steps, [skipped] * len(steps))
