"""``deepspeed.comm``'s job: joining it (``init_distributed`` with DeepSpeed's arguments and llmpar's keywords) and
asking it who is where (ranks, world size, groups), over torch.distributed with DeepSpeed's defaults (``group=None``
is the whole job; ranks are global, as in torch)."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from llmpar.distributed.init import DistEnv, collective_timeout
from llmpar.distributed.init import init_distributed as _llmpar_init


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
