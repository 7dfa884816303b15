"""Where ranks meet: parallel degrees, the named mesh, initialisation, and the collectives every byte goes through."""
from llmpar.distributed.collectives import (
    GroupRef,
    Handle,
    all_gather_flat,
    all_reduce,
    as_group,
    barrier,
    broadcast,
    global_rank,
    group_rank,
    group_size,
    irecv,
    isend,
    recv,
    reduce_scatter_flat,
    send,
)
from llmpar.distributed.dims import MESH_AXES, ParallelDims
from llmpar.distributed.init import DistEnv, destroy_distributed, init_distributed

__all__ = [
    "MESH_AXES",
    "DistEnv",
    "GroupRef",
    "Handle",
    "ParallelDims",
    "all_gather_flat",
    "all_reduce",
    "as_group",
    "barrier",
    "broadcast",
    "destroy_distributed",
    "global_rank",
    "group_rank",
    "group_size",
    "init_distributed",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter_flat",
    "send",
]
