"""The full-sequence mean loss of a context-parallel batch, the same value on every cp rank.

Each rank holds ``loss_sum`` (the sum of its tokens' losses, differentiable) and ``count`` (its real tokens). Both
are summed over the cp ranks; the loss is ``sum / max(count, 1)`` (0 real tokens anywhere: 0, never NaN).

Gradient: every rank runs backward on its own copy of the loss, and its parameters' gradients then hold only the
part of d(loss)/d(weights) that flows through its own tokens (attention's collectives carry the cross-rank parts to
their owners). The full gradient is the *sum* of the cp ranks' parts. So the backward of the sum over ranks is not
an all-reduce but the identity, scaled: d(loss)/d(loss_sum) = ``grad_factor / global_count``. With a gradient
reduction that averages over dp * cp ranks (ZeRO over the flattened group), ``grad_factor = cp`` makes that average
equal to the sum over cp ranks of the mean over dp; with one that sums over cp and averages over dp,
``grad_factor = 1``.
"""

from __future__ import annotations

import torch

from llmpar.distributed.collectives import all_reduce
from llmpar.distributed.groups import GroupRef


def _sum_over(x: torch.Tensor, groups: list[GroupRef], what: str) -> torch.Tensor:
    out = x.detach().clone()
    for g in groups:  # Ulysses then ring: every cp rank of the grid in turn
        all_reduce(out, g, what=what)
    return out


class _TokenMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss_sum, count, groups, grad_factor):
        both = torch.stack([loss_sum.detach().to(torch.float64), count.to(torch.float64)])
        total = _sum_over(both, groups, "context-parallel loss sum and token count")
        denom = total[1].clamp(min=1.0)
        ctx.scale = float(grad_factor) / float(denom)
        return (total[0] / denom).to(loss_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None


def token_mean(
    loss_sum: torch.Tensor, count: torch.Tensor | int, groups: list[GroupRef], *, grad_factor: float = 1.0
) -> torch.Tensor:
    """``sum_r loss_sum_r / max(sum_r count_r, 1)`` over the ranks of ``groups`` (taken in turn), a 0-d tensor of
    loss_sum's dtype on every rank; its gradient w.r.t. this rank's ``loss_sum`` is ``grad_factor / global count``."""
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1 or not loss_sum.is_floating_point():
        raise TypeError(
            f"loss_sum must be a one-element floating-point tensor (this rank's summed token losses), "
            f"got {loss_sum!r:.80}"
        )
    if isinstance(count, bool) or not isinstance(count, (int, torch.Tensor)):
        raise TypeError(
            f"count must be an int or a one-element tensor (this rank's real tokens), got {type(count).__name__}"
        )
    count = torch.as_tensor(count, device=loss_sum.device)
    if count.numel() != 1 or count.is_floating_point() and bool(count != count.round()) or bool(count < 0):
        raise ValueError(f"count must be a non-negative whole number of tokens, got {count.tolist()}")
    if isinstance(grad_factor, bool) or not isinstance(grad_factor, (int, float)) or not grad_factor > 0:
        raise ValueError(f"grad_factor must be a positive number, got {grad_factor!r}")
    return _TokenMean.apply(
        loss_sum.reshape(()), count.reshape(()).to(loss_sum.device), list(groups), float(grad_factor)
    )


__all__ = ["token_mean"]
