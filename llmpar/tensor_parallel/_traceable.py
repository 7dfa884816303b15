"""The tensor-parallel regions and parallel linears as torch.compile traces them.

The same math as :mod:`.comm` and :mod:`._overlap` (see the table in :mod:`.comm`), with every collective a
functional collective (:mod:`llmpar.distributed.funcol`) inside an autograd Function with an explicit backward whose
``ctx`` keeps the group as a :class:`~llmpar.distributed.funcol.GroupKey` (name, size, rank: no ProcessGroup), no
``async_op`` and no host read. The public wrappers in :mod:`.comm` and the layers switch to these under
``torch.compiler.is_compiling()``; eagerly they keep their own path (gloo exchanges, flight recorder, overlapped
chunks), which costs the graph nothing it could use: inside a graph the compiler schedules the waits itself.

Parallel linears, traced (``N`` tokens, ``n = N / tp`` under sequence parallelism):
  column: ``y[N, out/tp] = x_total W^T + b`` with ``x_total`` = :func:`copy_to_tensor_region` ``(x)`` (backward
  all-reduce), the all-gather of the ``[n, in]`` shards (backward reduce-scatter) under sequence parallelism, or ``x``
  itself for ``reduce_input_grad=False`` (the caller reduces the partial gradient);
  row: ``y = reduce(x W^T) + b``, the reduction an all-reduce or, under sequence parallelism, a reduce-scatter to
  ``[n, out]`` (backward all-gather; the bias gradient then all-reduced, each rank having summed its own tokens, so
  that it is the whole sequence's on every rank as eagerly). ``comm_chunks`` does not apply (one collective each;
  the compiler schedules the waits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpar.distributed import funcol
from llmpar.distributed.funcol import GroupKey
from llmpar.ops.gemm import linear_act


def tp_key(group: object) -> GroupKey:
    """:func:`funcol.group_key` of a tensor-parallel group (a mesh with a ``"tp"`` axis gives that axis)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh) and group.ndim != 1:
        group = group["tp"]
    return funcol.group_key(group)  # type: ignore[arg-type]


def _gather_last(x: torch.Tensor, key: GroupKey) -> torch.Tensor:
    """``[..., h]`` -> ``[..., tp * h]``, group rank r's columns at ``[r * h, (r + 1) * h)``."""
    g = funcol.all_gather_dim0(x.unsqueeze(0), key)  # [tp, ..., h]
    return g.movedim(0, -2).reshape(*x.shape[:-1], key.size * x.shape[-1])


def _split_last(x: torch.Tensor, key: GroupKey) -> torch.Tensor:
    if x.shape[-1] % key.size:
        raise ValueError(f"last dim of size {x.shape[-1]} is not divisible by tp={key.size}")
    n = x.shape[-1] // key.size
    return x[..., key.rank * n : (key.rank + 1) * n].contiguous()


def _split_dim0(x: torch.Tensor, key: GroupKey) -> torch.Tensor:
    if x.shape[0] % key.size:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by tp={key.size} (sequence parallelism)")
    n = x.shape[0] // key.size
    return x[key.rank * n : (key.rank + 1) * n].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, ctx.key), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        return funcol.all_reduce(x, key)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return _split_last(x, key)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.key), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return _gather_last(x, key)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.key), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return _split_dim0(x, key)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_gather_dim0(grad, ctx.key), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, grad_is_partial):
        ctx.key, ctx.partial = key, grad_is_partial
        return funcol.all_gather_dim0(x, key)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return funcol.reduce_scatter_dim0(grad, ctx.key), None, None
        return _split_dim0(grad, ctx.key), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return funcol.reduce_scatter_dim0(x, key)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_gather_dim0(grad, ctx.key), None


def _key(x: torch.Tensor, group: object) -> GroupKey:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return tp_key(group)


def copy_to_tensor_region(x: torch.Tensor, group: object) -> torch.Tensor:
    key = _key(x, group)
    return x if key.size == 1 else _Copy.apply(x, key)


def reduce_from_tensor_region(x: torch.Tensor, group: object) -> torch.Tensor:
    key = _key(x, group)
    return x if key.size == 1 else _Reduce.apply(x, key)


def scatter_to_tensor_region(x: torch.Tensor, group: object) -> torch.Tensor:
    key = _key(x, group)
    return x if key.size == 1 else _ScatterLast.apply(x, key)


def gather_from_tensor_region(x: torch.Tensor, group: object) -> torch.Tensor:
    key = _key(x, group)
    return x if key.size == 1 else _GatherLast.apply(x, key)


def scatter_to_sequence_region(x: torch.Tensor, group: object) -> torch.Tensor:
    key = _key(x, group)
    return x if key.size == 1 else _ScatterSeq.apply(x, key)


def gather_from_sequence_region(x: torch.Tensor, group: object, grad_is_partial: bool = True) -> torch.Tensor:
    key = _key(x, group)
    return x if key.size == 1 else _GatherSeq.apply(x, key, grad_is_partial)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: object) -> torch.Tensor:
    key = _key(x, group)
    return x if key.size == 1 else _ReduceScatterSeq.apply(x, key)


def column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: object,
    *,
    sequence_parallel: bool,
    reduce_input_grad: bool,
    act: str = "none",
    fused: bool = False,
) -> torch.Tensor:
    """Column-parallel ``act(x_total W^T + b)`` (see the module docstring): ``[..., in]`` (``[n, ..., in]`` under
    sequence parallelism) -> ``[..., out/tp]`` (``[tp * n, ..., out/tp]``). ``act`` applies on the ``fused`` path only
    (through ``llmpar.ops.linear_act``); the caller applies it otherwise, as on the eager path."""
    if sequence_parallel:
        x = gather_from_sequence_region(x, group)
    elif reduce_input_grad:
        x = copy_to_tensor_region(x, group)
    return linear_act(x, weight, bias, act=act) if fused else F.linear(x, weight, bias)


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: object,
    *,
    sequence_parallel: bool,
    fused: bool = False,
) -> torch.Tensor:
    """Row-parallel ``reduce(x W^T) + b``: ``[..., in/tp]`` -> ``[..., out]`` (``[N / tp, ..., out]`` under sequence
    parallelism; the bias added once, after the reduction). ``fused``: the product through ``llmpar.ops.linear_act``
    (a ``torch.library`` op with a fake implementation, traced as one node)."""
    y = linear_act(x, weight) if fused else F.linear(x, weight)
    if not sequence_parallel:
        y = reduce_from_tensor_region(y, group)
        return y if bias is None else y + bias
    y = reduce_scatter_to_sequence_region(y, group)
    # the replicated bias meets this rank's tokens only: its gradient is summed over the group, as the eager layer's
    return y if bias is None else y + copy_to_tensor_region(bias, group)
