"""Gradient norm and clipping for tensor-parallel models.

``||g||^2 = sum over tp-split params (all-reduced over the tp group) + sum over replicated params (counted once)``,
so every tp rank gets the norm of the unsplit model. Split parameters are those the parallel layers tag with
``tensor_model_parallel = True``. The arithmetic is ``llmpar.optim.grad_norm``'s (shared with the pipeline runner,
ZeRO and FusedAdamW).
"""

from __future__ import annotations

from typing import Iterable

import torch

from llmpar.optim.grad_norm import clip_grad_norm_ as _clip_grad_norm_
from llmpar.tensor_parallel._utils import Group, resolve_tp_group


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, group: Group) -> torch.Tensor:
    """Scale the gradients in place so that the unsplit model's gradient norm is at most ``max_norm`` (torch's
    coefficient ``min(1, max_norm / (norm + 1e-6))``, applied on the device: no host sync).

    Returns the total norm before clipping, a float64 0-d tensor, the same on every rank of ``group`` (a collective
    over it: call it on every tp rank, also one whose params have no grads).
    """
    return _clip_grad_norm_(params, max_norm, tp_group=resolve_tp_group(group))
