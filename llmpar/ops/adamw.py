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
and steps may live on the device). The torch path uses ``torch._fused_adamw_`` for the float32 math where it can (CPU
and CUDA), and foreach ops plus host-drawn random bits for the bf16 modes; it reads lr/steps/found_inf on the host (a
sync on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from llmpar.ops._dispatch import select_backend

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK = 1 << 20  # torch path of the low-precision modes: elements per foreach batch (bounds the float32 temporaries)
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
            sel = [[lst[i] for i in live] for lst in (params, grads, exp_avgs, exp_avg_sqs, steps)]
            ex = [extras[i] for i in live] if extras is not None else None
            hyper = dict(
                lr=lr, beta1=float(beta1), beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay)
            )
            if backend == "cuda":
                lr_t = lr if isinstance(lr, torch.Tensor) else None
                torch.ops.llmpar.adamw_step(
                    sel[0],
                    sel[1],
                    sel[2],
                    sel[3],
                    ex or [],
                    sel[4],
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

                hyper["lr"] = lr if isinstance(lr, torch.Tensor) else float(lr)
                triton_adamw.step(
                    *sel[:4],
                    ex,
                    sel[4],
                    [salts[i] for i in live],
                    mode=mode_code(precision),
                    gscale=gscale,
                    found_inf=found_inf,
                    seed=seed,
                    **hyper,
                )
            else:
                _torch_step(
                    precision,
                    *sel,
                    ex,
                    [salts[i] for i in live],
                    gscale=gscale,
                    found_inf=found_inf,
                    seed=seed,
                    **hyper,
                )
        if found_inf is not None:  # a skipped step does not count: undo the increment where found_inf != 0
            skipped = (found_inf.to(steps[0].device).reshape(()) != 0).to(torch.float32)
            torch._foreach_sub_(steps, [skipped] * len(steps))


# ----------------------------------------------------------------------------------------------- torch path


def _fused_available(device: torch.device) -> bool:
    return hasattr(torch, "_fused_adamw_") and device.type in ("cpu", "cuda")


def _torch_fp32(
    params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, gscale, found_inf
) -> None:
    """float32/float64 params: torch's fused AdamW (it unscales the grads in place by 1/grad_scale)."""
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
    if _fused_available(params[0].device):
        inv = None if gscale is None else torch.reciprocal(gscale.to(params[0].device, torch.float32).reshape(()))
        fi = None if found_inf is None else (found_inf != 0).to(params[0].device, torch.float32).reshape(())
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=inv,
            found_inf=fi,
        )
        return
    if found_inf is not None and float(found_inf) != 0:
        return
    if gscale is not None:
        grads = torch._foreach_mul(grads, gscale)
    _foreach_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps,
        lr=float(lr),
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
    )


def _foreach_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay) -> None:
    """In place on float tensors of one dtype (the reference math, foreach)."""
    ts = [float(s) for s in steps]
    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [math.sqrt(-math.expm1(t * _log_beta(beta2))) for t in ts])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / -math.expm1(t * _log_beta(beta1)) for t in ts])


def _log_beta(beta: float) -> float:
    """ln(beta); -inf for beta == 0, so that 1 - beta**t = -expm1(t ln beta) = 1 for t >= 1 (betas lie in [0, 1))."""
    return math.log(beta) if beta > 0.0 else float("-inf")


def _chunks(lists: list[list[torch.Tensor | None]], limit: int) -> Iterator[tuple[list[int], list[list]]]:
    """Batches of flat slices of at most ``limit`` elements: (tensor index per slice, per list the slices)."""
    owner: list[int] = []
    out: list[list] = [[] for _ in lists]
    size = 0
    for i in range(len(lists[0])):
        numel = lists[0][i].numel()
        for start in range(0, numel, limit):
            stop = min(start + limit, numel)
            owner.append(i)
            for k, lst in enumerate(lists):
                out[k].append(None if lst[i] is None else lst[i].view(-1)[start:stop])
            size += stop - start
            if size >= limit:
                yield owner, out
                owner, out, size = [], [[] for _ in lists], 0
    if owner:
        yield owner, out


def _random16(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """n uniform integers in [0, 65536) (int32): three 16-bit fields of each 63-bit draw."""
    draws = torch.empty(-(-n // 3), dtype=torch.int64, device=device).random_(generator=gen)
    return draws.view(torch.int16).view(-1, 4)[:, :3].reshape(-1)[:n].to(torch.int32).bitwise_and_(0xFFFF)


def _sr_copy_(dst: list[torch.Tensor], src: list[torch.Tensor], gen: torch.Generator) -> None:
    """dst (bf16) = src (float32, consumed) stochastically rounded: add 16 random bits below the bf16 mantissa and
    truncate. (Canonical NaNs stay NaN; the kernels also keep NaN payloads.)"""
    sizes = [s.numel() for s in src]
    bits = _random16(sum(sizes), gen, src[0].device).split(sizes)
    for d, s, r in zip(dst, src, bits):
        s.view(torch.int32).view(-1).add_(r).bitwise_and_(-65536)
        d.view(-1).copy_(s.view(-1))


def _torch_low_precision(
    precision,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    steps,
    extras,
    salts,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    gscale,
    found_inf,
    seed,
) -> None:
    """fp32_master / bf16_sr / bf16_kahan on torch ops, in float32 batches of flat slices."""
    device = params[0].device
    if precision == "fp32_master" and _fused_available(device):
        inv = None if gscale is None else torch.reciprocal(gscale.to(device, torch.float32).reshape(()))
        fi = None if found_inf is None else (found_inf != 0).to(device, torch.float32).reshape(())
        for owner, (p, g, m, v, x) in _chunks([params, grads, exp_avgs, exp_avg_sqs, extras], _CHUNK):
            g32 = [t.float() for t in g]
            torch._fused_adamw_(
                x,
                g32,
                m,
                v,
                [],
                [steps[i] for i in owner],
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
                grad_scale=inv,
                found_inf=fi,
            )
            torch._foreach_copy_(p, x)
        return
    if found_inf is not None and float(found_inf) != 0:
        return
    lr = float(lr)
    gs = None if gscale is None else float(gscale)
    gen = torch.Generator(device=device)
    step_of = torch.stack(steps).tolist() if precision == "bf16_sr" else None  # one host read for the seeds
    for owner, (p, g, m, v, x) in _chunks(
        [params, grads, exp_avgs, exp_avg_sqs, extras or [None] * len(params)], _CHUNK
    ):
        g32 = [t.float() for t in g]
        if gs is not None:
            torch._foreach_mul_(g32, gs)
        p32 = x if precision == "fp32_master" else [t.float() for t in p]
        m32, v32 = [t.float() for t in m], [t.float() for t in v]
        st = [steps[i] for i in owner]
        if precision == "bf16_kahan":
            p_old = [t.clone() for t in p32]
        _foreach_adamw(p32, g32, m32, v32, st, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        if precision == "fp32_master":
            torch._foreach_copy_(m, m32)
            torch._foreach_copy_(v, v32)
            torch._foreach_copy_(p, p32)
        elif precision == "bf16_sr":  # one stream per slice, keyed by (seed, step, salt, offset in its tensor):
            for k, i in enumerate(owner):  # the same bits however the tensors are split into calls and batches
                gen.manual_seed(_mix(seed, int(step_of[i]), salts[i], p[k].data_ptr() - params[i].data_ptr()))
                _sr_copy_([p[k], m[k], v[k]], [p32[k], m32[k], v32[k]], gen)
        else:  # Kahan: y = update + compensation; p = rn(p + y); c = rn(y - (p_new - p))
            y = torch._foreach_sub(p32, p_old)
            torch._foreach_add_(y, [t.float() for t in x])
            p_new = [t.bfloat16() for t in torch._foreach_add(p_old, y)]
            torch._foreach_copy_(x, torch._foreach_sub(y, torch._foreach_sub([t.float() for t in p_new], p_old)))
            torch._foreach_copy_(p, p_new)
            torch._foreach_copy_(m, m32)
            torch._foreach_copy_(v, v32)


def _mix(*values: int) -> int:
    """A 63-bit seed from a few integers (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        h = (h ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def _torch_step(
    precision,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    steps,
    extras,
    salts,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    gscale,
    found_inf,
    seed,
) -> None:
    hyper = dict(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, gscale=gscale, found_inf=found_inf
    )
    if precision == "fp32":
        _torch_fp32(params, grads, exp_avgs, exp_avg_sqs, steps, **hyper)
    else:
        _torch_low_precision(precision, params, grads, exp_avgs, exp_avg_sqs, steps, extras, salts, seed=seed, **hyper)
