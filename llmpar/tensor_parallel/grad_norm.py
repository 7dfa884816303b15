"""Gradient norm and clipping for tensor-parallel models.

``||g||^2 = sum over tp-split params (all-reduced over the tp group) + sum over replicated params (counted once)``,
so every tp rank gets the norm of the unsplit model. Split parameters are those the parallel layers tag with
``tensor_model_parallel = True``.
"""
from __future__ import annotations

from typing import Iterable

import torch

from llmpar.distributed.collectives import all_reduce
from llmpar.tensor_parallel._utils import Group, resolve_tp_group


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, group: Group) -> torch.Tensor:
    """Scale the gradients in place so that the unsplit model's gradient norm is at most ``max_norm``.

    Returns the total norm (before clipping), the same on every rank of ``group``.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm} must be positive")
    pg = resolve_tp_group(group)
    grads_split, grads_repl, seen = [], [], set()
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        (grads_split if getattr(p, "tensor_model_parallel", False) else grads_repl).append(p.grad)
    if not grads_split and not grads_repl:
        return torch.zeros(())
    ref = (grads_split or grads_repl)[0]
    sq = torch.zeros(2, dtype=torch.float64, device=ref.device)
    for i, grads in enumerate((grads_split, grads_repl)):
        for g in grads:
            sq[i] += g.detach().double().pow(2).sum()
    split_sq = sq[:1].clone()
    all_reduce(split_sq, pg)
    total = (split_sq[0] + sq[1]).sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for g in grads_split + grads_repl:
            g.mul_(coef)
    return total.to(ref.dtype)
