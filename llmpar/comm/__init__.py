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

from torch.distributed import P2POp, ReduceOp  # noqa: F401  (re-exported under DeepSpeed's names)

from llmpar.comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    allgather_fn,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    configure,
    gather,
    has_all_gather_into_tensor,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    irecv,
    isend,
    log_summary,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_fn,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    send,
)
from llmpar.comm.job import (
    destroy_process_group,
    get_all_ranks_from_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    new_group,
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
