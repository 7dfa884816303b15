"""Tensor-parallel communication as autograd Functions (private) with public wrappers.

Two kinds of region, after Megatron-Core's ``mappings.py``:

* the **tensor** region splits the *last* (hidden) dimension: ``x: [..., h]`` <-> shard ``[..., h / tp]``;
* the **sequence** region splits the *first* dimension (the sequence in Megatron's ``[s, b, h]`` layout; for
  batch-first activations it partitions the batch, which splits the tokens just as well): ``[s, ...]`` <->
  ``[s / tp, ...]``.

=================================  ===========================  ==================================
wrapper                             forward                      backward
=================================  ===========================  ==================================
copy_to_tensor_region               identity                     all-reduce
reduce_from_tensor_region           all-reduce                   identity
scatter_to_tensor_region            keep own last-dim shard      all-gather last dim
gather_from_tensor_region           all-gather last dim          keep own last-dim shard
scatter_to_sequence_region          keep own dim-0 shard         all-gather dim 0
gather_from_sequence_region         all-gather dim 0             reduce-scatter dim 0 (or keep shard)
reduce_scatter_to_sequence_region   reduce-scatter dim 0         all-gather dim 0
=================================  ===========================  ==================================

Every byte moves through :mod:`llmpar.distributed.collectives`. With one rank every wrapper is the identity. Under
``torch.compiler.is_compiling()`` each wrapper runs its traceable twin in :mod:`._traceable` instead (functional
collectives, the group kept as a name in ``ctx``): no graph break.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmpar.distributed.collectives import all_gather_flat, all_reduce, reduce_scatter_flat
from llmpar.tensor_parallel import _traceable
from llmpar.tensor_parallel._utils import Group, resolve_tp_group, tp_size_rank

# ----------------------------------------------------------------------------- plain (non-autograd) helpers


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A new tensor holding the sum of ``x`` over ``group``."""
    out = x.contiguous().clone()
    all_reduce(out, group)
    return out


def all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x: [n, ...]`` -> ``[tp * n, ...]`` with group rank r's rows at ``[r * n, (r + 1) * n)``."""
    tp, _ = tp_size_rank(group)
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out.view(-1), x.view(-1), group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x: [tp * n, ...]`` -> ``[n, ...]``: the sum over ranks of rows ``[rank * n, (rank + 1) * n)``."""
    tp, _ = tp_size_rank(group)
    if x.shape[0] % tp:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by tp={tp} for a reduce-scatter")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // tp, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out.view(-1), x.view(-1), group)
    return out


def split_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tp, rank = tp_size_rank(group)
    if x.shape[0] % tp:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by tp={tp} (sequence parallelism)")
    n = x.shape[0] // tp
    return x[rank * n : (rank + 1) * n].contiguous()


def all_gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x: [..., h]`` -> ``[..., tp * h]`` with group rank r's columns at ``[r * h, (r + 1) * h)``."""
    tp, _ = tp_size_rank(group)
    x = x.contiguous()
    out = torch.empty((tp, *x.shape), dtype=x.dtype, device=x.device)
    all_gather_flat(out.view(-1), x.view(-1), group)
    return out.movedim(0, -2).reshape(*x.shape[:-1], tp * x.shape[-1])


def split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tp, rank = tp_size_rank(group)
    if x.shape[-1] % tp:
        raise ValueError(f"last dim of size {x.shape[-1]} is not divisible by tp={tp}")
    n = x.shape[-1] // tp
    return x[..., rank * n : (rank + 1) * n].contiguous()


# ----------------------------------------------------------------------------- autograd Functions


class _CopyToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last(grad, ctx.group), None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_dim0(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


# ----------------------------------------------------------------------------- public wrappers


def _prep(x: torch.Tensor, group: Group) -> tuple[dist.ProcessGroup, bool]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    pg = resolve_tp_group(group)
    return pg, tp_size_rank(pg)[0] == 1


def copy_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` backward. ``x: [..., h]`` (replicated)."""
    if torch.compiler.is_compiling():
        return _traceable.copy_to_tensor_region(x, group)
    pg, single = _prep(x, group)
    return x if single else _CopyToTensorRegion.apply(x, pg)


def reduce_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of the partial ``x`` over ``group`` forward; identity backward."""
    if torch.compiler.is_compiling():
        return _traceable.reduce_from_tensor_region(x, group)
    pg, single = _prep(x, group)
    return x if single else _ReduceFromTensorRegion.apply(x, pg)


def scatter_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[..., h]`` -> this rank's ``[..., h / tp]``; backward all-gathers the last dim."""
    if torch.compiler.is_compiling():
        return _traceable.scatter_to_tensor_region(x, group)
    pg, single = _prep(x, group)
    return x if single else _ScatterToTensorRegion.apply(x, pg)


def gather_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[..., h / tp]`` -> ``[..., h]`` (all-gather of the last dim); backward keeps this rank's shard."""
    if torch.compiler.is_compiling():
        return _traceable.gather_from_tensor_region(x, group)
    pg, single = _prep(x, group)
    return x if single else _GatherFromTensorRegion.apply(x, pg)


def scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[s, ...]`` -> this rank's ``[s / tp, ...]``; backward all-gathers dim 0."""
    if torch.compiler.is_compiling():
        return _traceable.scatter_to_sequence_region(x, group)
    pg, single = _prep(x, group)
    return x if single else _ScatterToSequenceRegion.apply(x, pg)


def gather_from_sequence_region(x: torch.Tensor, group: Group, *, grad_is_partial: bool = True) -> torch.Tensor:
    """``[s / tp, ...]`` -> ``[s, ...]``; backward reduce-scatters dim 0 (or only keeps the shard when the
    gradient arriving is already complete on every rank, ``grad_is_partial=False``)."""
    if torch.compiler.is_compiling():
        return _traceable.gather_from_sequence_region(x, group, grad_is_partial)
    pg, single = _prep(x, group)
    return x if single else _GatherFromSequenceRegion.apply(x, pg, grad_is_partial)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial ``[s, ...]`` -> summed ``[s / tp, ...]`` shard; backward all-gathers dim 0."""
    if torch.compiler.is_compiling():
        return _traceable.reduce_scatter_to_sequence_region(x, group)
    pg, single = _prep(x, group)
    return x if single else _ReduceScatterToSequenceRegion.apply(x, pg)
