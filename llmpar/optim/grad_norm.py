"""The gradient norm of the whole, unsplit model, however its gradients are spread over ranks, and torch's clipping.

One implementation behind ``llmpar.tensor_parallel.clip_grad_norm_``, ``PipelineRunner.clip_grad_norm_``,
``ZeroOptimizer`` and ``FusedAdamW``:

    ||g||^2 = sum over pp of [ sum over dp of ( sum over tp of S_split  +  S_repl ) ]

with, on each rank,
    S_split  the sum of squares of its tensor-parallel shards (every tp rank holds another piece: summed over tp),
    S_repl   the sum of squares of the grads every tp rank holds whole (counted once: not summed over tp).
Pass ``dp_group`` only where each dp rank holds a disjoint partition of the grads (ZeRO stages 1/2); grads that are
the same on every dp rank (plain data parallel after its all-reduce, ZeRO stage 0) are not summed over dp. A tensor
held by several pp stages (a tied embedding / head) must count once: leave its other copies out (``skip=``).

Local sums: ``llmpar.ops.grad_norm`` (one fused pass: CUDA extension -> Triton -> torch, float32 accumulation) for
float32 / bfloat16 / float16 grads, float64 arithmetic for float64 grads (kept exact, never rounded to float32).
The sums, the collectives and the result are float64 0-d tensors on one device (the same dtype on every rank
whatever its grads, so the all-reduces always match); nothing is read on the host, so a non-finite norm reaches the
clip coefficient / found-inf flag as inf or nan on the device.

Clipping (:func:`clip_grads_`) is torch's ``clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``, every
grad multiplied by it on its device (float32 coefficient for float32 / bf16 / fp16 grads, float64 for float64 ones).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch

from llmpar.distributed.collectives import CommCounter, Group, GroupRef, all_reduce, collective_device, group_size
from llmpar.ops.grad_norm import grad_norm

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_grads(grads: Iterable[torch.Tensor], what: str) -> list[torch.Tensor]:
    if isinstance(grads, torch.Tensor):
        raise TypeError(f"{what} must be an iterable of tensors, got a single tensor of shape {tuple(grads.shape)}")
    out = list(grads)
    for i, g in enumerate(out):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise TypeError(f"{what}[{i}] must be a floating-point tensor, got {getattr(g, 'dtype', type(g).__name__)}")
    return out


@torch.no_grad()
def sum_of_squares(grads: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """``sum_i sum_j grads[i][j]^2`` as a float64 0-d tensor on ``device`` (see the module docstring). No host sync."""
    grads = _check_grads(grads, "grads")
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, bool], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.device, g.dtype in _FUSED_DTYPES), []).append(g)
    for (_, fused), gs in groups.items():
        if fused:
            part = grad_norm(gs).double().square()
        else:  # float64 (or another float) grads: float64 arithmetic
            wide = [g if g.dtype == torch.float64 else g.double() for g in gs]
            part = torch.stack(torch._foreach_norm(wide, 2)).square().sum()
        total += part.to(total.device)
    return total


def _active(group: Group | GroupRef | None) -> Group | GroupRef | None:
    return group if group is not None and group_size(group) > 1 else None


@torch.no_grad()
def global_grad_norm(
    grads: Iterable[torch.Tensor] = (),
    *,
    split: Iterable[torch.Tensor] = (),
    tp_group: Group | GroupRef | None = None,
    dp_group: Group | GroupRef | None = None,
    pp_group: Group | GroupRef | None = None,
    device: torch.device | str | None = None,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """L2 norm of the unsplit model's gradients, the same float64 0-d tensor on every rank. No host sync.

    Args:
        grads: this rank's grads that every tp rank holds whole (replicated over tp; all of them without tp).
        split: this rank's tensor-parallel shards (summed over ``tp_group``).
        tp_group / dp_group / pp_group: the groups to sum over (None or size 1: nothing to sum); ``dp_group`` only
            for grads partitioned over dp (module docstring).
        device: where the sums and collectives live (default: the first grad's, else the groups' collective device).
        counter: a ``CommCounter`` the all-reduces are recorded in.
    Collective over every given group: call it on every rank of them, also where this rank holds no grads.
    """
    grads, split = _check_grads(grads, "grads"), _check_grads(split, "split")
    tp, dp, pp = _active(tp_group), _active(dp_group), _active(pp_group)
    if device is None:
        first = next(iter(grads + split), None)
        group = next((g for g in (tp, dp, pp) if g is not None), None)
        device = first.device if first is not None else (collective_device(group) if group is not None else "cpu")
    sq = torch.stack([sum_of_squares(split, device), sum_of_squares(grads, device)])  # [tp shards, replicated]
    if dp is not None:  # this rank's partitions of both
        all_reduce(sq, dp, counter=counter)
    if tp is not None:
        all_reduce(sq[:1], tp, counter=counter)  # a view: reduced in place
    total = sq.sum().reshape(1)
    if pp is not None:
        all_reduce(total, pp, counter=counter)
    return total[0].sqrt()


def param_grads(
    params: Iterable[torch.Tensor], *, skip: Iterable[torch.Tensor] = ()
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(replicated grads, tensor-parallel grads) of ``params`` for :func:`global_grad_norm`: each param once, params
    without a grad and those in ``skip`` (by identity) left out; tp-split params are those the parallel layers tag
    with ``tensor_model_parallel = True``."""
    left_out = {id(p) for p in skip}
    repl: list[torch.Tensor] = []
    split: list[torch.Tensor] = []
    for p in params:
        if p.grad is None or id(p) in left_out:
            continue
        left_out.add(id(p))
        (split if getattr(p, "tensor_model_parallel", False) else repl).append(p.grad)
    return repl, split


def _check_max_norm(max_norm: object) -> float:
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, numbers.Real)
        or not (math.isfinite(max_norm) and max_norm > 0)
    ):
        raise ValueError(f"max_norm={max_norm!r} must be a positive finite number")
    return float(max_norm)


@torch.no_grad()
def clip_grads_(grads: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Multiply every grad in place by torch's coefficient ``min(1, max_norm / (norm + 1e-6))``, on the device."""
    max_norm = _check_max_norm(max_norm)
    coef = torch.clamp(max_norm / (norm.detach().double() + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in _check_grads(grads, "grads"):
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(device, torch.float64 if dtype == torch.float64 else torch.float32))


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    tp_group: Group | GroupRef | None = None,
    pp_group: Group | GroupRef | None = None,
    skip: Iterable[torch.Tensor] = (),
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """Scale the grads of ``params`` so that the unsplit model's gradient norm is at most ``max_norm``; returns that
    norm before clipping (float64 0-d tensor, the same on every rank). ``skip``: copies of tensors another pp stage
    counts (tied weights), left out of the norm but clipped like every other grad. No host sync."""
    max_norm = _check_max_norm(max_norm)
    params = list(params)
    repl, split = param_grads(params, skip=skip)
    fallback = params[0].device if params and not (repl or split) else None  # only skipped copies here
    norm = global_grad_norm(repl, split=split, tp_group=tp_group, pp_group=pp_group, device=fallback, counter=counter)
    every = param_grads(params)
    clip_grads_(every[0] + every[1], max_norm, norm)
    return norm


__all__ = ["clip_grad_norm_", "clip_grads_", "global_grad_norm", "param_grads", "sum_of_squares"]
