"""``deepspeed.comm``'s collectives and point-to-point calls over torch.distributed (DeepSpeed's defaults:
``group=None`` is the whole job, ``src`` / ``dst`` global ranks). Each collective runs through :func:`_run`:
recorded by the flight recorder (``llmpar.distributed.flight``: done once finished, or once an ``async_op=True``
handle's ``wait()`` returned), a backend failure raised as ``llmpar.distributed.CollectiveError`` naming the operation
and the group; point-to-point calls are not recorded. DeepSpeed's ``prof`` / ``log_name`` / ``debug`` keywords are
accepted and ignored; its comms logger (``configure`` / ``log_summary``) is refused with what to use instead."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from llmpar.distributed.collectives import TORCH_ALL_GATHER_INTO_TENSOR, TORCH_REDUCE_SCATTER_TENSOR, failing_as
from llmpar.distributed.flight import RECORDER, Entry, end

_IGNORED = ("prof", "log_name", "debug")


class _Work:
    """torch's work handle of an ``async_op=True`` collective: ``wait()`` marks the flight recorder's entry done and
    turns a failure into a ``CollectiveError``; everything else is the handle's."""

    def __init__(self, work: Any, what: str, pg: Any, entry: Entry | None) -> None:
        self._work, self._what, self._pg, self._entry = work, what, pg, entry

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with failing_as(self._what, self._pg):
            out = self._work.wait(*args, **kwargs)
        end(self._entry)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _run(
    what: str, group: Any, fn: Any, *args: Any, kind: str = "", record: torch.Tensor | None = None, **kwargs: Any
) -> Any:
    """``fn(*args, group=group, **kwargs)``; a collective (``kind``: "all_reduce", ...; "" for point-to-point, not
    recorded) is recorded by the flight recorder with ``record``'s size and dtype."""
    for k in _IGNORED:
        kwargs.pop(k, None)
    pg = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    entry = RECORDER.start(pg, kind, record, what) if pg is not None and kind else None
    with failing_as(what, pg):
        out = fn(*args, group=group, **kwargs)
    if kwargs.get("async_op") and out is not None:
        return _Work(out, what, pg, entry)
    end(entry)
    return out


# ------------------------------------------------------------------------------------------------ collectives
def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None, **kw: Any) -> Any:
    return _run("barrier", group, dist.barrier, kind="barrier", async_op=async_op, device_ids=device_ids, **kw)


def monitored_barrier(
    group: Any = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False, **kw: Any
) -> Any:
    return _run(
        "monitored barrier",
        group,
        dist.monitored_barrier,
        kind="barrier",
        timeout=timeout,
        wait_all_ranks=wait_all_ranks,
        **kw,
    )


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **kw: Any
) -> Any:
    return _run(
        f"all-reduce of {tensor.numel()} elements",
        group,
        dist.all_reduce,
        tensor,
        op=op,
        kind="all_reduce",
        record=tensor,
        async_op=async_op,
        **kw,
    )


inference_all_reduce = all_reduce


def all_reduce_coalesced(
    tensors: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **kw: Any
) -> Any:
    """All-reduce of several tensors as one flat buffer per dtype (torch's ``all_reduce_coalesced`` is deprecated)."""
    if async_op:
        raise ValueError("all_reduce_coalesced(async_op=True) is not supported: call it synchronously")
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        all_reduce(flat, op=op, group=group, **kw)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return None


def reduce(
    tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **kw: Any
) -> Any:
    return _run(
        f"reduce to rank {dst}",
        group,
        dist.reduce,
        tensor,
        dst,
        op=op,
        kind="reduce",
        record=tensor,
        async_op=async_op,
        **kw,
    )


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **kw: Any) -> Any:
    return _run(
        f"broadcast from rank {src}",
        group,
        dist.broadcast,
        tensor,
        src,
        kind="broadcast",
        record=tensor,
        async_op=async_op,
        **kw,
    )


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None, **kw: Any) -> Any:
    return _run(
        f"broadcast of objects from rank {src}",
        group,
        dist.broadcast_object_list,
        object_list,
        src,
        kind="broadcast",
        device=device,
        **kw,
    )


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False, **kw: Any
) -> Any:
    return _run(
        "all-gather",
        group,
        dist.all_gather,
        tensor_list,
        tensor,
        kind="all_gather",
        record=tensor,
        async_op=async_op,
        **kw,
    )


def all_gather_object(object_list: list, obj: Any, group: Any = None, **kw: Any) -> Any:
    return _run("all-gather of objects", group, dist.all_gather_object, object_list, obj, kind="all_gather", **kw)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False, **kw: Any
) -> Any:
    """``output[r * n:(r + 1) * n] = tensor`` of rank r (torch's ``all_gather_single``, formerly
    ``all_gather_into_tensor``)."""
    return _run(
        "all-gather into a tensor",
        group,
        TORCH_ALL_GATHER_INTO_TENSOR,
        output_tensor,
        tensor,
        kind="all_gather",
        record=tensor,
        async_op=async_op,
        **kw,
    )


allgather_fn = all_gather_into_tensor
all_gather_single = all_gather_into_tensor


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    """``output = reduce_r tensor_r[rank * n:(rank + 1) * n]`` (torch's ``reduce_scatter_single``, formerly
    ``reduce_scatter_tensor``)."""
    return _run(
        "reduce-scatter of a tensor",
        group,
        TORCH_REDUCE_SCATTER_TENSOR,
        output_tensor,
        tensor,
        op=op,
        kind="reduce_scatter",
        record=tensor,
        async_op=async_op,
        **kw,
    )


reduce_scatter_fn = reduce_scatter_tensor
reduce_scatter_single = reduce_scatter_tensor


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return _run(
        "reduce-scatter",
        group,
        dist.reduce_scatter,
        output,
        input_list,
        op=op,
        kind="reduce_scatter",
        record=output,
        async_op=async_op,
        **kw,
    )


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return _run(
        "all-to-all",
        group,
        dist.all_to_all_single,
        output,
        tensor,
        kind="all_to_all",
        record=tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        async_op=async_op,
        **kw,
    )


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return _run(
        "all-to-all of tensor lists",
        group,
        dist.all_to_all,
        output_tensor_list,
        input_tensor_list,
        kind="all_to_all",
        async_op=async_op,
        **kw,
    )


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return _run(
        f"gather to rank {dst}",
        group,
        dist.gather,
        tensor,
        gather_list,
        dst,
        kind="gather",
        record=tensor,
        async_op=async_op,
        **kw,
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return _run(
        f"scatter from rank {src}",
        group,
        dist.scatter,
        tensor,
        scatter_list,
        src,
        kind="scatter",
        record=tensor,
        async_op=async_op,
        **kw,
    )


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **kw: Any) -> Any:
    return _run(f"send to rank {dst}", group, dist.send, tensor, dst, tag=tag, **kw)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
    return _run(f"recv from rank {src}", group, dist.recv, tensor, src, tag=tag, **kw)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **kw: Any) -> Any:
    return _run(f"isend to rank {dst}", group, dist.isend, tensor, dst, tag=tag, **kw)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
    return _run(f"irecv from rank {src}", group, dist.irecv, tensor, src, tag=tag, **kw)


def batch_isend_irecv(p2p_op_list: list, **kw: Any) -> list:
    for k in _IGNORED:
        kw.pop(k, None)
    return dist.batch_isend_irecv(p2p_op_list, **kw)


# ------------------------------------------------------------------------------------------- DeepSpeed's logger
def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """DeepSpeed's comms-logger switch: only "off" is accepted (llmpar counts traffic with
    ``llmpar.distributed.CommCounter``, passed to ``llmpar.initialize(counter=...)``)."""
    if enabled or prof_all or prof_ops:
        raise ValueError(
            "the DeepSpeed comms logger is not supported: pass a llmpar.distributed.CommCounter to "
            "llmpar.initialize(counter=...) and read its calls / volume / bytes_sent"
        )


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    raise NotImplementedError(
        "deepspeed.comm.log_summary (the comms logger) is not supported: pass a "
        "llmpar.distributed.CommCounter to llmpar.initialize(counter=...) and read it"
    )
