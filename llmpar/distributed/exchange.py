"""Exchanges between ranks that are not reductions: an all-to-all of equal chunks and a batch of point-to-point
sends / receives, the two moves context parallelism is built on (Ulysses trades heads for sequence with an
all-to-all; ring attention passes key / value blocks to the next rank while computing on the current one).

Both take the group explicitly and group-local peer ranks, and wrap a backend failure (a dead or stuck peer, a
timeout) into a :class:`~llmpar.distributed.errors.CollectiveError` naming the operation and the group.

  all_to_all_single: input ``[world * n]`` (contiguous) -> output ``[world * n]``: chunk r of the output is chunk
                     ``group_rank`` of group rank r's input.
  all_to_all_uneven: rows of uneven counts along dim 0 (a mixture of experts' token exchange): input ``[sum(in_splits),
                     *rest]`` -> output ``[sum(out_splits), *rest]``; block r of the output (``out_splits[r]`` rows) is
                     block ``group_rank`` of group rank r's input. Zero-row blocks, and zero-row tensors, are fine.
  exchange:          ``sends = [(tensor, peer), ...]``, ``recvs = [(tensor, peer), ...]`` posted as one batch; the
                     returned :class:`Handle`'s ``wait()`` blocks until all arrived. Between two ranks, sends and
                     receives match in the order they are posted (every rank must post its exchanges in the same
                     order, as collectives are).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmpar.distributed.collectives import Handle, _has_kw, failing_as
from llmpar.distributed.flight import RECORDER
from llmpar.distributed.groups import Group, GroupRef, as_group, global_rank


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: "Group | GroupRef",
    *,
    async_op: bool = False,
    what: str | None = None,
) -> Handle | None:
    """``output.view(world, -1)[r] = input_r.view(world, -1)[group_rank]`` for every group rank r.

    ``input`` and ``output``: contiguous tensors of one dtype and device with the same number of elements, a
    multiple of the group size."""
    pg = as_group(group)
    size = dist.get_world_size(pg)
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())})")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(
            f"output ({output.dtype}, {output.device}) and input ({input.dtype}, {input.device}) must "
            "share dtype and device"
        )
    if output.numel() != input.numel() or input.numel() % size:
        raise ValueError(
            f"all-to-all needs input and output of the same size, a multiple of the group size {size}; "
            f"got {input.numel()} and {output.numel()} elements"
        )
    what = what or f"all-to-all of {input.numel()} elements"
    if size == 1:
        output.copy_(input)
        return Handle([], what=what, pg=pg) if async_op else None
    entry = RECORDER.start(pg, "all_to_all", input, what)  # a collective every rank of the group runs: recorded
    with failing_as(what, pg):
        work = dist.all_to_all_single(output.view(-1), input.view(-1), group=pg, async_op=True)
    handle = Handle([work], what=what, pg=pg, entry=entry)
    if async_op:
        return handle
    handle.wait()
    return None


def _check_splits(name: str, splits: list[int], size: int, rows: int) -> list[int]:
    splits = [int(s) for s in splits]
    if len(splits) != size or any(s < 0 for s in splits):
        raise ValueError(f"{name} must be {size} non-negative row counts (one per group rank), got {splits}")
    if sum(splits) != rows:
        raise ValueError(f"{name} {splits} add up to {sum(splits)} rows, but the tensor has {rows} rows")
    return splits


def all_to_all_uneven(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: "Group | GroupRef",
    *,
    async_op: bool = False,
    what: str | None = None,
) -> Handle | None:
    """Uneven all-to-all along dim 0: ``input`` rows ``[sum(input_splits), *rest]`` are cut into blocks of
    ``input_splits[r]`` rows, block r going to group rank r; ``output`` ``[sum(output_splits), *rest]`` receives
    ``output_splits[r]`` rows from group rank r, in rank order. Each rank's ``output_splits[r]`` must equal rank r's
    ``input_splits[group_rank]`` (exchange the counts first). Both tensors contiguous, of one dtype and device and the
    same trailing shape; with ``async_op`` the returned :class:`Handle` must be waited for before ``output`` is read
    (and ``input`` must stay alive until then)."""
    pg = as_group(group)
    size = dist.get_world_size(pg)
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous tensor of at least one dimension (got {tuple(t.shape)})")
    if output.dtype != input.dtype or output.device != input.device or output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"output ({output.dtype}, {output.device}, rows of {tuple(output.shape[1:])}) and input ({input.dtype}, "
            f"{input.device}, rows of {tuple(input.shape[1:])}) must share dtype, device and row shape"
        )
    out_splits = _check_splits("output_splits", output_splits, size, output.shape[0])
    in_splits = _check_splits("input_splits", input_splits, size, input.shape[0])
    what = what or f"uneven all-to-all of {input.shape[0]} -> {output.shape[0]} rows"
    if size == 1:
        output.copy_(input)
        return Handle([], what=what, pg=pg) if async_op else None
    entry = RECORDER.start(pg, "all_to_all", input, what)
    with failing_as(what, pg):
        work = dist.all_to_all_single(output, input, out_splits, in_splits, group=pg, async_op=True)
    handle = Handle([work], what=what, pg=pg, entry=entry)
    if async_op:
        return handle
    handle.wait()
    return None


def _p2p_op(fn, tensor: torch.Tensor, peer: int, pg: dist.ProcessGroup) -> dist.P2POp:
    size = dist.get_world_size(pg)
    if not 0 <= peer < size:
        raise ValueError(f"peer={peer} is outside the group's ranks [0, {size})")
    if _has_kw(dist.P2POp.__init__, "group_peer"):
        return dist.P2POp(fn, tensor, group=pg, group_peer=peer)
    return dist.P2POp(fn, tensor, group=pg, peer=global_rank(pg, peer))


def exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: "Group | GroupRef",
    *,
    what: str | None = None,
) -> Handle:
    """Post every send ``(tensor, group peer)`` and receive ``(tensor, group peer)`` as one batch; returns the
    in-flight :class:`Handle` (``wait()`` raises a CollectiveError naming ``what`` on a failure). Tensors must be
    contiguous; a receive's tensor is written only once the handle is waited for."""
    pg = as_group(group)
    what = what or f"point-to-point exchange ({len(sends)} sends, {len(recvs)} receives)"
    ops = []
    for kind, fn, pairs in (("send", dist.isend, sends), ("receive", dist.irecv, recvs)):
        for tensor, peer in pairs:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
                raise ValueError(f"every {kind} buffer of an exchange must be a contiguous tensor")
            ops.append(_p2p_op(fn, tensor, int(peer), pg))
    if not ops:
        return Handle([], what=what, pg=pg)
    with failing_as(what, pg):
        works = dist.batch_isend_irecv(ops)
    return Handle([w for w in works if w is not None], what=what, pg=pg)


__all__ = ["all_to_all_single", "all_to_all_uneven", "exchange"]
