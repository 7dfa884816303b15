"""Version-robust collectives. Every byte llmpar moves between ranks goes through these functions.

All take the process group explicitly (a ``ProcessGroup`` or a 1-D ``DeviceMesh``); ranks passed as ``src``/``dst``
are *group-local*. With ``async_op=True`` they return a :class:`Handle` whose ``wait()`` also runs any finishing
step a fallback needs (slicing after an all-reduce, dividing for ``avg`` on backends without ReduceOp.AVG), so the
caller never sees which path was taken.

Flat collectives:
  reduce_scatter_flat: input ``[world * n]`` -> output ``[n]`` holding the reduction of chunk ``group_rank``
                       (on gloo a direct exchange of the chunks plus a local sum: the one place that knows it).
  all_gather_flat:     input ``[n]`` -> output ``[world * n]``, chunk ``r`` from group rank ``r``.
The handle and the failure wrapping every wrapper shares are ``handle.py``'s; point-to-point (``send`` / ``recv`` /
``isend`` / ``irecv``, and the batched exchange the flat collectives run as on gloo) is ``p2p.py``'s; both are
importable from here too.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from llmpar.distributed.counter import CommCounter
from llmpar.distributed.flight import RECORDER, Entry, end
from llmpar.distributed.groups import Group, GroupRef, as_group, global_rank, group_rank, group_size
from llmpar.distributed.handle import Handle, failing_as, handle_or_wait
from llmpar.distributed.p2p import exchange_pairs, irecv, isend, recv, send
from llmpar.distributed.p2p import has_kw as _has_kw  # noqa: F401  (llmpar.distributed.exchange imports it from here)

# torch 2.13 renamed the flat collectives (the old names warn FutureWarning): the new name where it exists
# torch's flat all-gather / reduce-scatter under their torch 2.13 names when present (no deprecation warning), else
# the older ones: the one place that picks (llmpar.comm uses them too)
TORCH_ALL_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
TORCH_REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# on gloo, reduce-scatters of at least this many elements exchange their chunks point to point (below it an
# all-to-all: measured at dp=2, 0.16 vs 0.22 ms at 1k elements, equal at 128k, 0.8 vs 1.0 ms at 512k)
DIRECT_REDUCE_SCATTER_MIN = 1 << 18

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
}


def _op(op: str) -> dist.ReduceOp.RedOpType:
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not supported: expected one of {sorted(_OPS)}")
    return _OPS[op]


def _unsupported(err: Exception) -> bool:
    msg = str(err).lower()
    return isinstance(err, (NotImplementedError, AttributeError)) or "not support" in msg or "unsupported" in msg


def all_reduce(
    tensor: torch.Tensor,
    group: "Group | GroupRef",
    *,
    op: str = "sum",
    async_op: bool = False,
    counter: CommCounter | None = None,
    what: str | None = None,
) -> Handle | None:
    """In-place all-reduce of ``tensor`` over ``group`` (``op`` in sum, avg, max, min, product). ``what``: names the
    operation in a failure's message (every collective here takes it)."""
    pg = as_group(group)
    what = what or f"all-reduce ({op}) of {tensor.numel()} elements"
    entry = RECORDER.start(pg, "all_reduce", tensor, what)
    with failing_as(what, pg):
        work = dist.all_reduce(tensor, op=_op(op), group=pg, async_op=True)
    size = dist.get_world_size(pg)
    if counter is not None:
        nbytes = tensor.numel() * tensor.element_size()
        counter.record(
            "all_reduce",
            2 * tensor.numel(),
            2 * (size - 1) / size * nbytes,
            2 * nbytes / size * counter.cross_peers(pg),
        )
    finish = (lambda: tensor.div_(size)) if op == "avg" else None
    return handle_or_wait(async_op, [work], finish, what, pg, entry)


def _check_flat(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())})")


def _check_pair(output: torch.Tensor, input: torch.Tensor, big: str, ratio: int) -> None:
    _check_flat("output", output)
    _check_flat("input", input)
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(
            f"output ({output.dtype}, {output.device}) and input ({input.dtype}, {input.device}) must share dtype "
            "and device"
        )
    small, large = (output, input) if big == "input" else (input, output)
    if large.numel() != small.numel() * ratio:
        raise ValueError(
            f"{big} has {large.numel()} elements but must have group size {ratio} x {small.numel()} = "
            f"{small.numel() * ratio}"
        )


def collective_device(group: "Group | GroupRef") -> torch.device:
    """The device this group's collectives run on: the current CUDA device under NCCL, else the CPU."""
    pg = as_group(group)
    return torch.device("cuda", torch.cuda.current_device()) if _backend(pg, "cuda") == "nccl" else torch.device("cpu")


def _backend(pg: dist.ProcessGroup, device_type: str) -> str:
    """The backend ``pg`` uses for tensors on ``device_type`` ("cpu:gloo,cuda:nccl" style names are split)."""
    name = str(dist.get_backend(pg))
    if ":" not in name:
        return name
    table = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return table.get(device_type, next(iter(table.values())))


def reduce_scatter_uses_exchange(group: "Group | GroupRef", device: torch.device | str = "cpu") -> bool:
    """Whether :func:`reduce_scatter_flat` (sum / avg) on ``group`` runs as a direct exchange plus a local sum (gloo):
    it then holds one more ``input``-sized buffer (the received chunks) while in flight."""
    return _backend(as_group(group), torch.device(device).type) == "gloo"


def reduce_scatter_scratch_numel(input: torch.Tensor, group: "Group | GroupRef") -> int:
    """How many elements of ``scratch`` :func:`reduce_scatter_flat` (sum / avg) receives into for this ``input`` on
    ``group``: ``(size - 1) / size`` of it on the point-to-point exchange (gloo, from DIRECT_REDUCE_SCATTER_MIN
    elements), else 0 (the path takes no scratch)."""
    if not reduce_scatter_uses_exchange(group, input.device) or input.numel() < DIRECT_REDUCE_SCATTER_MIN:
        return 0
    size = dist.get_world_size(as_group(group))
    return (size - 1) * (input.numel() // size)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: "Group | GroupRef",
    *,
    op: str = "sum",
    async_op: bool = False,
    counter: CommCounter | None = None,
    what: str | None = None,
    scratch: torch.Tensor | None = None,
) -> Handle | None:
    """``output[n] = reduce_r input_r[group_rank * n : (group_rank + 1) * n]`` over the ranks r of ``group``.

    Paths, picked here (the caller never sees which): on gloo, sum / avg run as a direct exchange of the chunks
    (:func:`~llmpar.distributed.p2p.exchange_pairs`) and a local sum in rank order (the same bytes, 2-4x faster than
    gloo's own reduce-scatter; it holds up to one more ``input``-sized buffer while in flight, see
    :func:`reduce_scatter_uses_exchange`); elsewhere ``reduce_scatter_tensor`` (``reduce_scatter_single`` from torch
    2.13); where neither exists, an all-reduce of a copy (2x traffic). Counted once, as the reduce-scatter it is,
    whichever path runs. ``scratch``: where the exchange receives the other ranks' chunks (at least ``(size - 1) *
    output.numel()`` elements of ``input``'s dtype and device, untouched until the handle is waited for), instead of
    a fresh buffer: on the CPU a fresh one page-faults on every 4 KiB it receives (ZeRO passes reused ones); ignored
    on the other paths (:func:`reduce_scatter_scratch_numel` says how much a call uses).
    """
    pg = as_group(group)
    size = dist.get_world_size(pg)
    _check_pair(output, input, "input", size)
    if scratch is not None and (
        scratch.dtype != input.dtype
        or scratch.device != input.device
        or not scratch.is_contiguous()
        or scratch.numel() < (size - 1) * output.numel()
    ):
        raise ValueError(
            f"scratch ({scratch.dtype}, {scratch.numel()} elements on {scratch.device}) must be a "
            f"contiguous {input.dtype} tensor on {input.device} of at least (group size - 1) x "
            f"output = {(size - 1) * output.numel()} elements"
        )
    reduce_op = _op(op)
    what = what or f"reduce-scatter ({op}) of {input.numel()} elements"
    entry = RECORDER.start(pg, "reduce_scatter", input, what)
    with failing_as(what, pg):
        return _reduce_scatter(output, input, pg, size, op, reduce_op, async_op, counter, what, scratch, entry)


def _reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    pg: dist.ProcessGroup,
    size: int,
    op: str,
    reduce_op: dist.ReduceOp.RedOpType,
    async_op: bool,
    counter: CommCounter | None,
    what: str,
    scratch: torch.Tensor | None = None,
    entry: Entry | None = None,
) -> Handle | None:
    if counter is not None:
        nbytes = input.numel() * input.element_size()
        counter.record(
            "reduce_scatter", input.numel(), (size - 1) / size * nbytes, nbytes / size * counter.cross_peers(pg)
        )
    if op in ("sum", "avg") and reduce_scatter_uses_exchange(pg, input.device):
        me = dist.get_rank(pg)
        chunks = input.view(size, -1)
        if input.numel() >= DIRECT_REDUCE_SCATTER_MIN:  # point to point: this rank's own chunk is not copied
            n = chunks.shape[1]
            received = (
                scratch.view(-1)[: (size - 1) * n].view(size - 1, n)
                if scratch is not None
                else torch.empty(size - 1, n, dtype=input.dtype, device=input.device)
            )
            peers = [j for j in range(size) if j != me]
            works = exchange_pairs(pg, [(j, chunks[j], received[i]) for i, j in enumerate(peers)])
            parts = [chunks[me] if j == me else received[peers.index(j)] for j in range(size)]
        else:  # small buffers: one all-to-all costs less Python than a batch of point-to-point ops
            everyone = torch.empty_like(input)
            works = [dist.all_to_all_single(everyone, input, group=pg, async_op=True)]
            parts = list(everyone.view(size, -1))

        def summed() -> None:  # in rank order; bf16 / fp16 in float32, rounded once
            if size == 2:
                torch.add(parts[0], parts[1], out=output.view(-1))
            else:
                wide = parts[0].float() if parts[0].dtype in (torch.bfloat16, torch.float16) else parts[0].clone()
                for part in parts[1:]:
                    wide.add_(part)
                output.view(-1).copy_(wide)
            if op == "avg":
                output.div_(size)

        return handle_or_wait(async_op, works, summed, what, pg, entry)
    finish: Callable[[], object] | None = (lambda: output.div_(size)) if op == "avg" else None
    try:
        work = TORCH_REDUCE_SCATTER_TENSOR(output, input, op=reduce_op, group=pg, async_op=True)
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        if not _unsupported(err):
            raise
        # fallback for backends/versions without reduce-scatter: all-reduce a copy, keep our chunk (2x traffic)
        scratch = input.clone()
        work = dist.all_reduce(scratch, op=reduce_op, group=pg, async_op=True)
        me = dist.get_rank(pg)
        n = output.numel()

        def from_scratch() -> None:  # replaces the avg-only finish
            output.copy_(scratch.view(-1)[me * n : (me + 1) * n].view_as(output))
            if op == "avg":
                output.div_(size)

        finish = from_scratch

    return handle_or_wait(async_op, [work], finish, what, pg, entry)


def all_gather_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: "Group | GroupRef",
    *,
    async_op: bool = False,
    counter: CommCounter | None = None,
    what: str | None = None,
) -> Handle | None:
    """``output[r * n : (r + 1) * n] = input`` of group rank ``r``, for every r (on gloo a direct exchange,
    :func:`~llmpar.distributed.p2p.exchange_pairs`; elsewhere the backend's all-gather)."""
    pg = as_group(group)
    size = dist.get_world_size(pg)
    _check_pair(output, input, "output", size)
    what = what or f"all-gather of {output.numel()} elements"
    entry = RECORDER.start(pg, "all_gather", input, what)
    if counter is not None:
        nbytes = output.numel() * output.element_size()
        counter.record(
            "all_gather", output.numel(), (size - 1) / size * nbytes, nbytes / size * counter.cross_peers(pg)
        )
    with failing_as(what, pg):
        if reduce_scatter_uses_exchange(pg, input.device):  # gloo: every chunk straight to every peer
            me = dist.get_rank(pg)
            chunks = output.view(size, -1)
            works = exchange_pairs(pg, [(j, input.view(-1), chunks[j]) for j in range(size) if j != me])
            chunks[me].copy_(input.view(-1))
            return handle_or_wait(async_op, works, None, what, pg, entry)
        try:
            work = TORCH_ALL_GATHER_INTO_TENSOR(output, input, group=pg, async_op=True)
        except (RuntimeError, NotImplementedError, AttributeError) as err:
            if not _unsupported(err):
                raise
            parts = list(output.view(-1).chunk(size))
            work = dist.all_gather(parts, input.view(-1), group=pg, async_op=True)
    return handle_or_wait(async_op, [work], None, what, pg, entry)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: "Group | GroupRef",
    *,
    async_op: bool = False,
    counter: CommCounter | None = None,
    what: str | None = None,
) -> Handle | None:
    """Broadcast ``tensor`` from group rank ``src`` to every rank of ``group``."""
    pg = as_group(group)
    what = what or f"broadcast of {tensor.numel()} elements from group rank {src}"
    if counter is not None:
        nbytes = tensor.numel() * tensor.element_size()
        me = dist.get_rank(pg)
        remote = counter.node_of(global_rank(pg, src)) != counter.node_of(dist.get_rank())
        counter.record("broadcast", tensor.numel(), nbytes if me == src else 0, nbytes if remote else 0)
    entry = RECORDER.start(pg, "broadcast", tensor, what)
    with failing_as(what, pg):
        work = dist.broadcast(tensor, src=global_rank(pg, src), group=pg, async_op=True)
    return handle_or_wait(async_op, [work], None, what, pg, entry)


def barrier(group: "Group | GroupRef", *, what: str = "barrier") -> None:
    pg = as_group(group)
    entry = RECORDER.start(pg, "barrier", None, what)
    with failing_as(what, pg):
        dist.barrier(group=pg)
    end(entry)


def broadcast_coalesced(
    tensors: list[torch.Tensor],
    src: int,
    group: "Group | GroupRef",
    *,
    bucket_numel: int = 1 << 25,
    counter: CommCounter | None = None,
) -> None:
    """Broadcast every tensor of ``tensors`` from group rank ``src`` in place, as DDP does with the model at start-up:
    one flat broadcast per (device, dtype) and bucket of at most ``bucket_numel`` elements (a bigger tensor alone)."""
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for t in tensors:
        lists = buckets.setdefault((t.device, t.dtype), [[]])
        if lists[-1] and sum(x.numel() for x in lists[-1]) + t.numel() > bucket_numel:
            lists.append([])
        lists[-1].append(t)
    for ts in (ts for lists in buckets.values() for ts in lists):
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        broadcast(flat, src, group, counter=counter)
        offset = 0
        for t in ts:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


__all__ = [
    "CommCounter",
    "Group",
    "GroupRef",
    "Handle",
    "all_gather_flat",
    "all_reduce",
    "as_group",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "collective_device",
    "failing_as",
    "global_rank",
    "group_rank",
    "group_size",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter_flat",
    "reduce_scatter_uses_exchange",
    "send",
]
