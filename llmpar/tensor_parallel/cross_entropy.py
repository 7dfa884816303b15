"""Cross-entropy over vocabulary-split logits, without ever forming the full-vocabulary logits on one rank.

``logits_shard: [..., V_pad/tp]`` (rank r holds vocabulary columns ``[r * V_pad/tp, (r + 1) * V_pad/tp)``),
``target: [...]`` int. A logit of -inf marks a column outside the real vocabulary: a :class:`ParallelLMHead` writes
-inf into its padding columns (its vocabulary is padded to a multiple of tp), so the loss knows the real vocabulary
``V`` without being told (``vocab_size=`` masks the columns ``>= vocab_size`` the same way). Over the real columns,
with ``m = max_v z_v`` and ``Z = sum_v exp(z_v - m)`` (both reduced over the group):

    nll = log Z - (z_target - m)
    loss = (1 - eps) * nll + eps * (log Z - mean_v (z_v - m))        (label smoothing eps, as F.cross_entropy over V)
    d loss / d z_v = softmax_v - (1 - eps) [v == target] - eps / V   (0 on the -inf columns)

The real columns, which label smoothing sums over, are those not -inf for every token (a -inf logit in a real column
makes the smoothed loss huge, ~1e38 / V, where F.cross_entropy gives inf). Two all-reduces of ``[tokens]``-sized
vectors (max, then the stacked sums); low-precision logits are upcast to fp32. Before them, a fixed-size exchange
(``_agree.exchange_rows``: one all-gather of 10 int64 per rank) hands every rank each rank's fault flag (a target
outside ``[0, V_pad)``, or ``[0, vocab_size)``, that is not ``ignore_index``) and its logits' shape, so that logits of
different shapes (also of different token counts, which would give the reductions different sizes) fail before any
token-sized collective; a target on a -inf column shows up as a -inf target logit after the sum. Each raises on every
rank, a :class:`TokenIdError` (a ValueError) or a ValueError naming every rank's shape on CPU and a device-side assert
on accelerators (no host sync), instead of a wrong loss, an aborted process or a rank left waiting. Under
torch.compile the group travels by name (a ``GroupKey``), the reductions are functional all-reduces and every check is
the device-side assert (no host read, no graph break).
"""

from __future__ import annotations

import torch

from llmpar.distributed import funcol
from llmpar.distributed.collectives import all_reduce
from llmpar.distributed.errors import TokenIdError
from llmpar.distributed.funcol import GroupKey
from llmpar.tensor_parallel import _agree
from llmpar.tensor_parallel._agree import assert_rows_ok, exchange_rows, raise_for_rows
from llmpar.tensor_parallel._traceable import tp_key
from llmpar.tensor_parallel._utils import Group, resolve_tp_group, tp_size_rank

_WHAT = "vocab_parallel_cross_entropy"


def _size_rank(group) -> tuple[int, int]:
    return (group.size, group.rank) if isinstance(group, GroupKey) else tp_size_rank(group)


def _reduced(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """``t`` reduced over the group: in place eagerly (a ProcessGroup), a new tensor when traced (a GroupKey)."""
    if isinstance(group, GroupKey):
        return funcol.all_reduce(t, group, op)
    all_reduce(t, group, op=op)
    return t


def _some(ids: torch.Tensor, k: int = 8) -> list[int]:
    return sorted(set(ids.tolist()))[:k]


def _reduce_max_checked(m, outside, t, shape, group, limit: int, ignore_index: int) -> torch.Tensor:
    """``m`` max-reduced over ``group``; first raises (CPU) / asserts (device) on every rank when any rank's target has
    ids outside ``[0, limit)`` or the ranks' logits shapes differ (checked in a fixed-size exchange, so before the
    token-sized max is issued)."""
    tp, rank = _size_rank(group)
    range_msg = f"{_WHAT}: target holds class ids outside [0, {limit}) that are not ignore_index={ignore_index}"
    cpu = _agree.host_checks(m)
    if tp == 1:
        if not cpu:
            torch._assert_async(~outside.any(), range_msg)
        elif bool(outside.any()):
            raise TokenIdError(f"{range_msg}: {_some(t[outside])}")
        return m
    rows = exchange_rows(outside.any(), shape, group)
    if cpu:

        def fault(ranks: list[int]) -> TokenIdError:
            mine = f": {_some(t[outside])}" if rank in ranks else ""
            return TokenIdError(f"{range_msg} (on tp group rank(s) {ranks}; this is group rank {rank}){mine}")

        raise_for_rows(rows, group, what=_WHAT, fault_error=fault)
    else:
        assert_rows_ok(rows, f"{range_msg}, or the tp ranks passed logits of different shapes")
    return _reduced(m, group, "max")


def _raise_padding_target(hit, x_in, t, group, vocab_size) -> None:
    """Every rank: some target sits on a -inf logit (``hit``: [tokens] bool, the same on every rank)."""
    tp, _ = tp_size_rank(group)
    if vocab_size is None:  # the real vocabulary = the columns that are not -inf (one row; all ranks together)
        count = (x_in[int(hit.nonzero()[0, 0])] > float("-inf")).sum().to(torch.float64).reshape(1)
        if tp > 1:
            all_reduce(count, group)
        vocab_size = int(count)
    raise TokenIdError(
        f"{_WHAT}: target class id(s) {_some(t[hit])} fall on logits of -inf, outside the real "
        f"vocabulary of {vocab_size} classes (padding columns of a vocabulary padded to a multiple of "
        f"tp={tp}, or masked classes): valid ids are in [0, {vocab_size}) or ignore_index"
    )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, eps):
        tp, rank = _size_rank(group)
        v_local = logits.shape[-1]
        start = rank * v_local
        x_in = logits.reshape(-1, v_local)
        x = x_in.float() if x_in.dtype in (torch.float16, torch.bfloat16) else x_in.clone()
        valid = v_local if vocab_size is None else min(max(vocab_size - start, 0), v_local)
        if valid < v_local:
            x[:, valid:] = float("-inf")
        limit = tp * v_local if vocab_size is None else vocab_size
        t = target.reshape(-1)
        ignored = t == ignore_index
        outside = ((t < 0) | (t >= limit)) & ~ignored
        in_range = (t >= start) & (t < start + v_local) & ~ignored
        local_t = (t - start).masked_fill(~in_range, 0)

        m = _reduce_max_checked(x.max(dim=-1).values, outside, t, tuple(logits.shape), group, limit, ignore_index)
        x -= m.unsqueeze(-1)
        sums = [x.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~in_range, 0.0)]  # z_target - m
        pad = None
        if eps > 0:  # smoothing needs sum_v (z_v - m) and V over the real columns: pad = the columns -inf for all
            if vocab_size is not None or x.shape[0] == 0:
                pad = torch.arange(v_local, device=x.device) >= valid
            else:
                pad = torch.isneginf(x.amax(0))
            real = (~pad).to(x.dtype)
            x.clamp_(min=torch.finfo(x.dtype).min)  # -inf -> lowest finite: exp still 0, and 0 * it is 0 in the mv
            sums += [torch.mv(x, real), real.sum().expand(x.shape[0])]
        x.exp_()
        sums.append(x.sum(-1))
        stats = torch.stack(sums)
        if tp > 1:
            stats = _reduced(stats, group)
        hit = torch.isneginf(stats[0])  # a target on a -inf column (the same on every rank after the sum)
        if not _agree.host_checks(x):
            torch._assert_async(~hit.any(), f"{_WHAT}: a target class id falls on a -inf (padding) logit")
        elif bool(hit.any()):
            _raise_padding_target(hit, x_in, t, group, vocab_size)
        log_z = stats[-1].log()
        loss = log_z - stats[0]
        v_real = stats[2] if eps > 0 else None
        if eps > 0:
            loss = (1.0 - eps) * loss + eps * (log_z - stats[1] / v_real)
        loss = loss.masked_fill(ignored, 0.0)
        x /= stats[-1].unsqueeze(-1)  # softmax
        ctx.save_for_backward(x, local_t, in_range, ignored, v_real, pad)
        ctx.eps = eps
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, in_range, ignored, v_real, pad = ctx.saved_tensors
        g = softmax  # reused in place: backward runs once
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= (1.0 - ctx.eps) * in_range.to(g.dtype)
        if pad is not None:  # - eps / V on the real columns: one in-place rank-1 update
            g.addr_(1.0 / v_real, (~pad).to(g.dtype), alpha=-ctx.eps)
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
    """Cross-entropy of vocabulary-split logits; equals ``F.cross_entropy`` over the real vocabulary.

    Args:
        logits_shard: ``[..., V_pad/tp]`` this rank's vocabulary columns (e.g. a ``ParallelLMHead`` output, whose
            padding columns hold -inf); columns holding -inf are not classes.
        target: ``[...]`` integer class ids of the real vocabulary, or ``ignore_index``. An id outside
            ``[0, V_pad)`` or on a -inf column raises on every rank (CPU: :class:`TokenIdError`, a ValueError;
            accelerators: a device-side assert).
        vocab_size: optional; the columns ``>= vocab_size`` are treated as padding (needed only for padded logits
            that do not carry -inf, e.g. from a plain ColumnParallelLinear); default ``tp * V_pad/tp``.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (per-token, ``[...]``).
    """
    pg = tp_key(group) if torch.compiler.is_compiling() else resolve_tp_group(group)  # traced: the group by name
    tp, _ = _size_rank(pg)
    if not isinstance(logits_shard, torch.Tensor) or not logits_shard.is_floating_point():
        raise TypeError("logits_shard must be a floating-point tensor")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise TypeError("target must be an integer tensor of class ids")
    if logits_shard.dim() < 1 or tuple(logits_shard.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits_shard {tuple(logits_shard.shape)} and target {tuple(target.shape)} must agree on "
            "all but the last (vocabulary) dim"
        )
    padded = tp * logits_shard.shape[-1]
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded
    ):
        raise ValueError(
            f"vocab_size={vocab_size} does not fit logits of {logits_shard.shape[-1]} columns per rank "
            f"x tp={tp} = {padded}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    loss = _VocabParallelCrossEntropy.apply(
        logits_shard,
        target,
        pg,
        None if vocab_size is None else int(vocab_size),
        int(ignore_index),
        float(label_smoothing),
    )
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().to(loss.dtype)
