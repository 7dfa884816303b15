"""Cross-entropy over vocabulary-split logits, without ever forming the full-vocabulary logits on one rank.

``logits_shard: [..., V_pad/tp]`` (rank r holds vocabulary columns ``[r * V_pad/tp, (r + 1) * V_pad/tp)``),
``target: [...]`` int. With ``m = max_v z_v`` and ``Z = sum_v exp(z_v - m)`` (both reduced over the group):

    nll = log Z - (z_target - m)
    loss = (1 - eps) * nll + eps * (log Z - mean_v (z_v - m))          (label smoothing eps, as F.cross_entropy)
    d loss / d z_v = softmax_v - (1 - eps) [v == target] - eps / V

Two all-reduces of ``[tokens]``-sized vectors (max, then the stacked sums); columns ``>= vocab_size`` (padding) are
masked to -inf so they never change the loss. Low-precision logits are upcast to fp32 for the reduction.
"""
from __future__ import annotations

import torch

from llmpar.distributed.collectives import all_reduce
from llmpar.tensor_parallel._utils import Group, resolve_tp_group, tp_size_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, eps):
        tp, rank = tp_size_rank(group)
        v_local = logits.shape[-1]
        start = rank * v_local
        valid = max(0, min(v_local, vocab_size - start))  # columns of real vocabulary on this rank
        x = logits.reshape(-1, v_local)
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x.clone()
        if valid < v_local:
            x[:, valid:] = float("-inf")
        t = target.reshape(-1)
        ignored = t == ignore_index
        in_range = (t >= start) & (t < start + valid) & ~ignored
        local_t = (t - start).masked_fill(~in_range, 0)

        m = x.max(dim=-1).values if valid > 0 else torch.full_like(x[:, 0], float("-inf"))
        if tp > 1:
            all_reduce(m, group, op="max")
        x -= m.unsqueeze(-1)
        pred = x.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~in_range, 0.0)
        sums = [pred]
        if eps > 0:
            sums.append(x[:, :valid].sum(-1))
        x.exp_()
        sums.append(x.sum(-1))
        stats = torch.stack(sums)
        if tp > 1:
            all_reduce(stats, group)
        log_z = stats[-1].log()
        loss = log_z - stats[0]
        if eps > 0:
            loss = (1.0 - eps) * loss + eps * (log_z - stats[1] / vocab_size)
        loss = loss.masked_fill(ignored, 0.0)
        x /= stats[-1].unsqueeze(-1)  # softmax
        ctx.save_for_backward(x, local_t, in_range, ignored)
        ctx.valid, ctx.eps, ctx.vocab_size = valid, eps, vocab_size
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, in_range, ignored = ctx.saved_tensors
        g = softmax  # reused in place: backward runs once
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= (1.0 - ctx.eps) * in_range.to(g.dtype)
        if ctx.eps > 0:
            g[:, : ctx.valid] -= ctx.eps / ctx.vocab_size
        scale = grad_loss.reshape(-1).to(g.dtype).masked_fill(ignored, 0.0)
        g *= scale.unsqueeze(-1)
        return g.to(ctx.logits_dtype).view(ctx.logits_shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    *,
    vocab_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocabulary-split logits; equals ``F.cross_entropy`` on the gathered logits.

    Args:
        logits_shard: ``[..., V_pad/tp]`` this rank's vocabulary columns (e.g. a ``ParallelLMHead`` output).
        target: ``[...]`` integer class ids in ``[0, vocab_size)`` or ``ignore_index``.
        vocab_size: the real vocabulary ``V`` (columns beyond it are padding); default ``tp * V_pad/tp``.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (per-token, ``[...]``).
    """
    pg = resolve_tp_group(group)
    tp, _ = tp_size_rank(pg)
    if not isinstance(logits_shard, torch.Tensor) or not logits_shard.is_floating_point():
        raise TypeError("logits_shard must be a floating-point tensor")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise TypeError("target must be an integer tensor of class ids")
    if logits_shard.dim() < 1 or tuple(logits_shard.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits_shard {tuple(logits_shard.shape)} and target {tuple(target.shape)} must agree on "
                         "all but the last (vocabulary) dim")
    padded = tp * logits_shard.shape[-1]
    vocab_size = padded if vocab_size is None else vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} does not fit logits of {logits_shard.shape[-1]} columns per rank "
                         f"x tp={tp} = {padded}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
    msg = f"target holds class ids outside [0, {vocab_size}) that are not ignore_index={ignore_index}"
    if target.device.type == "cpu":  # checking costs no device sync here
        if bool(bad.any()):
            raise ValueError(msg)
    else:  # on an accelerator: a device-side assert, as F.cross_entropy does, instead of a host sync per call
        torch._assert_async(~bad.any(), msg)
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, pg, int(vocab_size), int(ignore_index),
                                            float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().to(loss.dtype)

