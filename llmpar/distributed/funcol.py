"""Traceable collectives: torch's functional collectives (``_c10d_functional`` ops) for code that torch.compile traces.

The eager collectives in :mod:`llmpar.distributed.collectives` write into caller buffers, pick a path per backend,
record every call in the flight recorder and may return a handle: none of that can live in a graph. Under
``torch.compiler.is_compiling()`` llmpar's parallel layers move their bytes through the functions here instead. Each
takes a :class:`GroupKey` (the group's registered *name*, its size and this rank's place in it: plain values, so an
autograd Function's ``ctx`` holds no ProcessGroup), returns a new tensor (no ``async_op``: the ``wait_tensor`` is in the
graph, where the compiler may move it) and never reads a tensor on the host. They run eagerly too (on gloo on CPU,
NCCL on GPUs), which is how the tests compare them with the eager path.

Shapes (``size`` = group size):
  all_reduce:          ``x: [...]`` -> ``[...]``, the reduction over the group (sum, avg, max, min, product).
  all_gather_dim0:     ``x: [n, ...]`` -> ``[size * n, ...]``, group rank r's rows at ``[r * n, (r + 1) * n)``.
  reduce_scatter_dim0: ``x: [size * n, ...]`` -> ``[n, ...]``, the sum over ranks of rows ``[rank * n, ...)``.
  all_to_all_dim0:     ``x: [sum(in_splits), ...]`` -> ``[sum(out_splits), ...]``, rows ``in_splits[j]`` to group
                       rank j, ``out_splits[j]`` rows from it (``None``: equal splits). Differentiable through
                       :func:`all_to_all_autograd` (backward: the all-to-all with the splits swapped).
  all_to_all_v:        the same with the splits as int tensors ``[size]`` (data, e.g. MoE token counts): one
                       ``llmpar::all_to_all_v`` op that reads them on the host when it runs, so a graph holds it with
                       no break and no specialisation on their values; its output's row count is an unbacked size
                       (``new_dynamic_size``) unless the caller states it (``recv_rows``). Differentiable (backward:
                       the same op with the splits swapped).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmpar.distributed.collectives import reduce_scatter_uses_exchange
from llmpar.distributed.groups import GroupRef

_OPS = ("sum", "avg", "max", "min", "product")


class GroupKey(NamedTuple):
    """A process group as plain values: what a traced region and an autograd ``ctx`` keep of it."""

    name: str
    size: int
    rank: int


@torch._dynamo.assume_constant_result
def _size_rank(name: str) -> tuple[int, int]:
    """(size, this rank's group rank) of the group registered as ``name``: run at trace time, a constant in the
    graph (the lookup itself is a C++ call torch.compile cannot trace)."""
    pg = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]  # a registered name
    return pg.size(), pg.rank()


def group_key(group: "dist.ProcessGroup | DeviceMesh | GroupRef | GroupKey") -> GroupKey:
    """The :class:`GroupKey` of a ProcessGroup, a 1-D DeviceMesh, a :class:`GroupRef` or a GroupKey. Traceable:
    torch.compile reads a group's name, size and rank as constants."""
    if isinstance(group, GroupKey):
        return group
    if isinstance(group, GroupRef):
        if group.name is not None:
            size, rank = _size_rank(group.name)
            return GroupKey(group.name, size, rank)
        group = group.get()
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a DeviceMesh passed as a group must be 1-D, got {group.ndim}-D {group.mesh_dim_names}")
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or a GroupRef, got {type(group).__name__}")
    return GroupKey(group.group_name, group.size(), group.rank())


@torch._dynamo.assume_constant_result
def _on_gloo(name: str) -> bool:
    """Whether the group registered as ``name`` runs its CPU collectives on gloo (a constant at trace time)."""
    pg = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]  # a registered name
    return reduce_scatter_uses_exchange(pg, "cpu")


def _wait(t: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


def all_reduce(x: torch.Tensor, key: GroupKey, op: str = "sum") -> torch.Tensor:
    """A new tensor: ``x`` reduced over the group (``op`` in sum, avg, max, min, product)."""
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not supported: expected one of {list(_OPS)}")
    red = "sum" if op == "avg" else op  # gloo has no AVG: divided afterwards, as the eager path does
    out = _wait(torch.ops._c10d_functional.all_reduce(x.contiguous(), red, key.name))
    return out / key.size if op == "avg" else out


def all_gather_dim0(x: torch.Tensor, key: GroupKey) -> torch.Tensor:
    """``[n, ...]`` -> ``[size * n, ...]`` in group-rank order. On gloo (CPU tensors) an all-to-all sending ``x`` to
    every peer, as the eager path's direct exchange does there."""
    if x.device.type == "cpu" and _on_gloo(key.name):
        return all_to_all_dim0(
            x.unsqueeze(0).expand(key.size, *x.shape).reshape(key.size * x.shape[0], *x.shape[1:]), key
        )
    return _wait(torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), key.size, key.name))


def reduce_scatter_dim0(x: torch.Tensor, key: GroupKey) -> torch.Tensor:
    """``[size * n, ...]`` -> ``[n, ...]``: the sum over the group of rows ``[rank * n, (rank + 1) * n)``. On gloo
    (CPU tensors) an all-to-all of the chunks and a local sum in rank order, as the eager path does there (gloo's own
    reduce-scatter costs 2-4x more)."""
    if x.shape[0] % key.size:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by group size {key.size} for a reduce-scatter")
    if x.device.type == "cpu" and _on_gloo(key.name):
        parts = all_to_all_dim0(x, key).view(key.size, x.shape[0] // key.size, *x.shape[1:])
        return (
            parts.sum(0, dtype=torch.float32).to(x.dtype)
            if x.dtype in (torch.bfloat16, torch.float16)
            else parts.sum(0)
        )
    return _wait(torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", key.size, key.name))


def all_to_all_dim0(
    x: torch.Tensor, key: GroupKey, out_splits: Sequence[int] | None = None, in_splits: Sequence[int] | None = None
) -> torch.Tensor:
    """Rows ``in_splits[j]`` of ``x`` to group rank j; ``out_splits[j]`` rows from it, in rank order (``None``: dim 0
    split equally). The split sizes may be symbolic (unbacked) ints under torch.compile."""
    if in_splits is None:
        if x.shape[0] % key.size:
            raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by group size {key.size} (all-to-all)")
        in_splits = [x.shape[0] // key.size] * key.size
    if out_splits is None:
        out_splits = [x.shape[0] // key.size] * key.size
    return _wait(
        torch.ops._c10d_functional.all_to_all_single(x.contiguous(), list(out_splits), list(in_splits), key.name)
    )


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, out_splits, in_splits):
        ctx.key, ctx.out_splits, ctx.in_splits = key, out_splits, in_splits
        return all_to_all_dim0(x, key, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_dim0(grad, ctx.key, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all_autograd(
    x: torch.Tensor, key: GroupKey, out_splits: Sequence[int] | None = None, in_splits: Sequence[int] | None = None
) -> torch.Tensor:
    """:func:`all_to_all_dim0`, differentiable: the gradient takes the reverse all-to-all (splits swapped)."""
    outs = None if out_splits is None else list(out_splits)
    ins = None if in_splits is None else list(in_splits)
    return _AllToAll.apply(x, key, outs, ins)


def _check_v(x: torch.Tensor, send_splits: torch.Tensor, recv_splits: torch.Tensor) -> None:
    for name, t in (("send_splits", send_splits), ("recv_splits", recv_splits)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"all_to_all_v: {name} must be a 1-D int64 tensor [group size], got {t.dtype} {t.shape}")
    if send_splits.shape != recv_splits.shape or x.dim() < 1:
        raise ValueError(
            f"all_to_all_v: send_splits {tuple(send_splits.shape)} and recv_splits {tuple(recv_splits.shape)} must "
            f"both be [group size], x {tuple(x.shape)} at least 1-D"
        )


@torch.library.custom_op("llmpar::all_to_all_v", mutates_args=())
def _all_to_all_v(
    x: torch.Tensor, send_splits: torch.Tensor, recv_splits: torch.Tensor, group_name: str, recv_rows: int | None
) -> torch.Tensor:
    """Eager impl: the splits read on the host (one device sync on a GPU), then the uneven all-to-all."""
    from llmpar.distributed.exchange import all_to_all_uneven

    _check_v(x, send_splits, recv_splits)
    ins, outs = send_splits.tolist(), recv_splits.tolist()
    if recv_rows is not None and sum(outs) != recv_rows:
        raise ValueError(f"all_to_all_v: recv_splits {outs} sum to {sum(outs)}, the caller stated {recv_rows} rows")
    out = x.new_empty((sum(outs), *x.shape[1:]))
    pg = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]  # a registered name
    all_to_all_uneven(out, x.contiguous(), outs, ins, pg, what=f"all_to_all_v ({sum(ins)} rows out, {sum(outs)} in)")
    return out


@_all_to_all_v.register_fake
def _all_to_all_v_fake(x, send_splits, recv_splits, group_name, recv_rows):
    _check_v(x, send_splits, recv_splits)
    rows = recv_rows if recv_rows is not None else torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:]))


def _v_setup(ctx, inputs, output) -> None:
    x, send_splits, recv_splits, group_name, _ = inputs
    ctx.save_for_backward(send_splits, recv_splits)
    ctx.group_name, ctx.rows = group_name, x.shape[0]


def _v_backward(ctx, grad):
    send_splits, recv_splits = ctx.saved_tensors
    gx = torch.ops.llmpar.all_to_all_v(grad.contiguous(), recv_splits, send_splits, ctx.group_name, ctx.rows)
    return gx, None, None, None, None


_all_to_all_v.register_autograd(_v_backward, setup_context=_v_setup)


def all_to_all_v(
    x: torch.Tensor, key: GroupKey, send_splits: torch.Tensor, recv_splits: torch.Tensor, recv_rows: int | None = None
) -> torch.Tensor:
    """Uneven all-to-all with data splits: ``send_splits[j]`` rows of ``x: [sum(send_splits), ...]`` to group rank
    j, ``recv_splits[j]`` rows from it -> ``[sum(recv_splits), ...]`` (int64 ``[size]`` tensors; ``recv_rows``: their
    sum when the caller knows it, else an unbacked size under torch.compile). Differentiable in ``x``."""
    return torch.ops.llmpar.all_to_all_v(x, send_splits, recv_splits, key.name, recv_rows)


def with_dynamic_rows(compiled: Callable[..., Any], module: torch.nn.Module) -> Callable[..., Any]:
    """``compiled`` (a ``torch.compile``'d forward of ``module``), run with dynamo allowed to trace ops whose output
    size is data when ``module`` holds layers exchanging tokens over ep > 1 ranks (an ``ep_size`` above 1): the rows
    :func:`all_to_all_v` receives are an unbacked size, which dynamo traces only under ``fullgraph=True`` or with
    ``capture_dynamic_output_shape_ops`` (else a graph break there and a recompile whenever the routing changes).
    The switch is set around these calls only, the same on every call (no recompile); other modules: ``compiled``."""
    if not any(getattr(m, "ep_size", 1) > 1 for m in module.modules()):
        return compiled
    patch = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with patch:
            return compiled(*args, **kwargs)

    return call


__all__ = [
    "GroupKey",
    "all_gather_dim0",
    "all_reduce",
    "all_to_all_autograd",
    "all_to_all_dim0",
    "all_to_all_v",
    "group_key",
    "reduce_scatter_dim0",
    "with_dynamic_rows",
]
