"""The torch path of ``llmpar.ops.adamw.adamw_step`` (the math and the modes: that module's docstring), for every
precision mode, on any device.

"fp32" runs torch's fused AdamW (``torch._fused_adamw_``, CPU and CUDA; it unscales the grads in place by 1/gscale),
else foreach ops. The low-precision modes run in float32 over batches of flat slices of at most ``_CHUNK`` elements
(bounding the float32 temporaries): "fp32_master" through the fused AdamW on the masters where it can; "bf16_sr" with
host-drawn random bits, one stream per slice keyed by (seed, step, salt, offset in its tensor), so the bits do not
depend on how the tensors are split into calls and batches; "bf16_kahan" with the compensation of the param update.
lr, steps and found_inf are read on the host (a sync on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_CHUNK = 1 << 20  # torch path of the low-precision modes: elements per foreach batch (bounds the float32 temporaries)


def _fused_available(device: torch.device) -> bool:
    return hasattr(torch, "_fused_adamw_") and device.type in ("cpu", "cuda")


def torch_fp32(
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


def _chunks(
    sizes: Sequence[torch.Tensor], lists: Sequence[Sequence[torch.Tensor | None]], limit: int
) -> Iterator[tuple[list[int], list[list[Any]]]]:
    """Batches of flat slices of at most ``limit`` elements, cut where ``sizes``' tensors are (the params): (tensor
    index per slice, per list the slices of its tensors there; None where a list holds None)."""
    owner: list[int] = []
    out: list[list[Any]] = [[] for _ in lists]
    size = 0
    for i, lead in enumerate(sizes):
        numel = lead.numel()
        for start in range(0, numel, limit):
            stop = min(start + limit, numel)
            owner.append(i)
            for k, lst in enumerate(lists):
                t = lst[i]
                out[k].append(None if t is None else t.view(-1)[start:stop])
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
        for owner, (p, g, m, v, x) in _chunks(params, [params, grads, exp_avgs, exp_avg_sqs, extras], _CHUNK):
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
    step_of: list[float] = torch.stack(steps).tolist() if precision == "bf16_sr" else []  # one host read: the seeds
    for owner, (p, g, m, v, x) in _chunks(
        params, [params, grads, exp_avgs, exp_avg_sqs, extras or [None] * len(params)], _CHUNK
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
                gen.manual_seed(mix(seed, int(step_of[i]), salts[i], p[k].data_ptr() - params[i].data_ptr()))
                _sr_copy_([p[k], m[k], v[k]], [p32[k], m32[k], v32[k]], gen)
        else:  # Kahan: y = update + compensation; p = rn(p + y); c = rn(y - (p_new - p))
            y = torch._foreach_sub(p32, p_old)
            torch._foreach_add_(y, [t.float() for t in x])
            p_new = [t.bfloat16() for t in torch._foreach_add(p_old, y)]
            torch._foreach_copy_(x, torch._foreach_sub(y, torch._foreach_sub([t.float() for t in p_new], p_old)))
            torch._foreach_copy_(p, p_new)
            torch._foreach_copy_(m, m32)
            torch._foreach_copy_(v, v32)


def mix(*values: int) -> int:
    """A 63-bit seed from a few integers (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        h = (h ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def torch_step(
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
        torch_fp32(params, grads, exp_avgs, exp_avg_sqs, steps, **hyper)
    else:
        _torch_low_precision(precision, params, grads, exp_avgs, exp_avg_sqs, steps, extras, salts, seed=seed, **hyper)
