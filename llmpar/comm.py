"""``deepspeed.comm`` for scripts that ``import llmpar as deepspeed``: torch.distributed's API with DeepSpeed's
defaults (``group=None`` is the whole job; ``src`` / ``dst`` are global ranks, as in torch), on llmpar's process
group. ``init_distributed`` is llmpar's (``llmpar.init_distributed``) with DeepSpeed's arguments too.

    from llmpar import comm as dist
    dist.init_distributed(dist_backend="gloo")
    dist.all_reduce(t); dist.barrier(); dist.get_rank(), dist.get_world_size(), dist.get_local_rank()

A collective that fails (a dead or stuck peer, a timeout) raises ``llmpar.distributed.CollectiveError`` naming the
operation and the group. Every collective here is recorded by the flight recorder (``llmpar.distributed.flight``) like
llmpar's own: its group's sequence number, size, dtype, the caller's line, done once finished (``async_op=True``: once
the returned handle's ``wait()`` returned), so a failure's diagnosis counts the script's collectives too
(point-to-point sends and receives are not recorded). Where torch 2.13 renamed a collective
(``all_gather_into_tensor`` -> ``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``) the new
name is called when it exists (no deprecation warnings), under both names here. DeepSpeed's ``prof`` / ``log_name`` /
``debug`` keywords are accepted and ignored; its comms logger (``configure(enabled=True)``, ``log_summary``) is not
there: count bytes with ``llmpar.distributed.CommCounter``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import P2POp, ReduceOp  # noqa: F401  (re-exported under DeepSpeed's names)

from llmpar.distributed.collectives import TORCH_ALL_GATHER_INTO_TENSOR, TORCH_REDUCE_SCATTER_TENSOR, failing_as
from llmpar.distributed.flight import RECORDER, Entry, end
from llmpar.distributed.init import DistEnv, collective_timeout
from llmpar.distributed.init import init_distributed as _llmpar_init

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


# --------------------------------------------------------------------------------------------------- the job
def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
    *,
    backend: str | None = None,
    dims: Any = None,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    timeout_s: float | None = None,
    device_type: str | None = None,
) -> DistEnv:
    """Join the job (DeepSpeed's arguments, and llmpar's keywords: see ``llmpar.distributed.init_distributed``);
    returns llmpar's :class:`~llmpar.distributed.DistEnv`. dist_backend / backend: "nccl" (default on CUDA), "gloo"
    (default on CPU). timeout (a timedelta) / timeout_s: a collective's wait for its peers (default 10 minutes).
    init_method + rank + world_size: torch's explicit initialisation (e.g. "tcp://host:port"); without them the
    environment torchrun / DeepSpeed's launcher set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or a
    world of one. dist_init_required=False: torch.distributed must be initialized already.
    auto_mpi_discovery, distributed_port, verbose, config: accepted (no MPI discovery: launch with torchrun)."""
    if dist_backend is not None and backend is not None and dist_backend != backend:
        raise ValueError(f"dist_backend={dist_backend!r} and backend={backend!r} disagree: give one")
    backend = backend if backend is not None else dist_backend
    if timeout is not None:
        if not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        if timeout_s is not None and timeout_s != timeout.total_seconds():
            raise ValueError(f"timeout={timeout} and timeout_s={timeout_s} disagree: give one")
        timeout_s = timeout.total_seconds()
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialized")
    if not dist.is_initialized() and (init_method is not None or rank >= 0 or world_size > 0):
        # the caller's rendezvous: torch's init_process_group, then llmpar adopts the group
        kind = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(
            kind,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout(timeout_s)),
        )
    return _llmpar_init(backend=backend, dims=dims, tp=tp, pp=pp, dp=dp, timeout_s=timeout_s, device_type=device_type)


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    """A process group of these global ranks (collective over the whole job, as torch's)."""
    return dist.new_group(ranks)


def get_world_group() -> Any:
    return dist.group.WORLD


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """``LOCAL_RANK`` (set by torchrun and DeepSpeed's launcher; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


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


__all__ = [
    "P2POp",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
