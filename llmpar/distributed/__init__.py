"""Where ranks meet: parallel degrees, the named mesh, initialisation, and the collectives every byte goes through."""

from llmpar.distributed.agree import check_same_on_ranks, raise_if_any_failed
from llmpar.distributed.collectives import (
    GroupRef,
    Handle,
    all_gather_flat,
    all_reduce,
    as_group,
    barrier,
    broadcast,
    broadcast_coalesced,
    collective_device,
    global_rank,
    group_rank,
    group_size,
    irecv,
    isend,
    recv,
    reduce_scatter_flat,
    reduce_scatter_uses_exchange,
    send,
)
from llmpar.distributed.dims import MESH_AXES, ParallelDims
from llmpar.distributed.errors import CollectiveError
from llmpar.distributed.exchange import all_to_all_single, exchange
from llmpar.distributed.init import DistEnv, destroy_distributed, init_distributed

__all__ = [
    "CollectiveError",
    "MESH_AXES",
    "DistEnv",
    "GroupRef",
    "Handle",
    "ParallelDims",
    "all_gather_flat",
    "all_reduce",
    "all_to_all_single",
    "as_group",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "check_same_on_ranks",
    "collective_device",
    "destroy_distributed",
    "exchange",
    "global_rank",
    "group_rank",
    "group_size",
    "init_distributed",
    "irecv",
    "isend",
    "raise_if_any_failed",
    "recv",
    "reduce_scatter_flat",
    "reduce_scatter_uses_exchange",
    "send",
]
