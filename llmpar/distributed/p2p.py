"""Point-to-point between the ranks of a group, with group-local peer ranks whatever torch's version takes
(``group_dst`` / ``group_src`` / ``group_peer`` where they exist, global ranks before): ``send`` / ``recv`` /
``isend`` / ``irecv``, and :func:`exchange_pairs`, the batch of paired sends and receives the flat collectives run as on
gloo (``collectives.py``). Not recorded by the flight recorder (a point-to-point call is not a collective every member
of the group runs)."""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.distributed as dist

from llmpar.distributed.groups import Group, GroupRef, as_group, global_rank
from llmpar.distributed.handle import Handle


def exchange_pairs(pg: dist.ProcessGroup, pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list:
    """Send ``send`` to and receive ``recv`` from each group rank ``peer`` of ``pairs``, all at once (one batch of
    point-to-point ops): how the flat collectives run on gloo. Measured at dp=2 on 19.2M fp32 values: an all-gather
    20 ms vs 59 ms for gloo's all_gather_into_tensor, a reduce-scatter (with the local add) 22 ms vs 27 ms for an
    all-to-all + sum and 78 ms for gloo's reduce_scatter; bf16 11 vs 32 / 26 ms. Sends and receives between two ranks
    match in the order they are posted, as the collectives' calls are ordered on every rank."""
    ops = []
    for peer, send, recv in pairs:
        kw = {"group_peer": peer} if has_kw(dist.P2POp.__init__, "group_peer") else {"peer": global_rank(pg, peer)}
        ops.append(dist.P2POp(dist.isend, send, group=pg, **kw))
        ops.append(dist.P2POp(dist.irecv, recv, group=pg, **kw))
    return dist.batch_isend_irecv(ops) if ops else []


@functools.lru_cache(maxsize=None)
def has_kw(fn: Callable, kw: str) -> bool:
    """Whether ``fn`` (a torch.distributed function) takes keyword ``kw`` in this torch version."""
    try:
        return kw in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _p2p_kwargs(fn: Callable, key: str, peer: int, pg: dist.ProcessGroup) -> dict:
    if has_kw(fn, f"group_{key}"):
        size = dist.get_world_size(pg)
        if not 0 <= peer < size:
            raise ValueError(f"{key}={peer} is outside the group's ranks [0, {size})")
        return {f"group_{key}": peer, "group": pg}
    return {key: global_rank(pg, peer), "group": pg}


def send(tensor: torch.Tensor, dst: int, group: "Group | GroupRef") -> None:
    pg = as_group(group)
    dist.send(tensor, **_p2p_kwargs(dist.send, "dst", dst, pg))


def recv(tensor: torch.Tensor, src: int, group: "Group | GroupRef") -> None:
    pg = as_group(group)
    dist.recv(tensor, **_p2p_kwargs(dist.recv, "src", src, pg))


def isend(tensor: torch.Tensor, dst: int, group: "Group | GroupRef") -> Handle:
    pg = as_group(group)
    return Handle([dist.isend(tensor, **_p2p_kwargs(dist.isend, "dst", dst, pg))])


def irecv(tensor: torch.Tensor, src: int, group: "Group | GroupRef") -> Handle:
    pg = as_group(group)
    return Handle([dist.irecv(tensor, **_p2p_kwargs(dist.irecv, "src", src, pg))])


__all__ = ["exchange_pairs", "has_kw", "irecv", "isend", "recv", "send"]
