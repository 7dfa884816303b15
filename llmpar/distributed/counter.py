"""What the collectives move, counted: :class:`CommCounter` (passed to them as ``counter=``)."""

from __future__ import annotations

import os

import torch.distributed as dist

from llmpar.distributed.groups import Group, GroupRef, as_group


def ranks_per_node() -> int:
    """Global ranks per node as torchrun lays them out: ``LOCAL_WORLD_SIZE`` when set, else the world (one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else dist.get_world_size()


class CommCounter:
    """Tally of what the collectives it is passed to (``counter=``) move; with None (the default) nothing is counted.

    Per op name: ``calls``, ``volume`` (elements in the ZeRO paper's units: an all-reduce of n counts 2n, a
    reduce-scatter of an [N*n] input counts N*n, an all-gather into an [N*n] output counts N*n, a broadcast of n counts
    n), ``bytes_sent`` (bytes this rank sends under the ring algorithm: all-reduce 2 (N-1)/N of the payload,
    reduce-scatter and all-gather (N-1)/N, broadcast the payload from the root) and ``cross_node_bytes`` (bytes this
    rank receives from ranks on other nodes when the collective runs in its direct form, each peer's chunk straight
    to its destination: an all-gather or reduce-scatter of chunk c gets c from each peer, an all-reduce 2c, an
    all-to-all its row; what must cross the slow links whatever the algorithm). Nodes are ``ranks_per_node``
    consecutive global ranks (torchrun's layout; default: ``LOCAL_WORLD_SIZE``, else one node). The compressed
    collectives (``compressed.py``) count their wire bytes under their own op names. Owned by whoever passes it.
    """

    def __init__(self, *, ranks_per_node: int | None = None) -> None:
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node={ranks_per_node!r} must be a positive int or None")
        self.ranks_per_node = ranks_per_node
        self.calls: dict[str, int] = {}
        self.volume: dict[str, int] = {}
        self.bytes_sent: dict[str, float] = {}
        self.cross_node_bytes: dict[str, float] = {}

    def record(self, op: str, volume: int, sent_bytes: float, cross_bytes: float = 0.0) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.volume[op] = self.volume.get(op, 0) + int(volume)
        self.bytes_sent[op] = self.bytes_sent.get(op, 0.0) + float(sent_bytes)
        self.cross_node_bytes[op] = self.cross_node_bytes.get(op, 0.0) + float(cross_bytes)

    def node_of(self, rank: int) -> int:
        """The node of global ``rank``."""
        return rank // (self.ranks_per_node or ranks_per_node())

    def cross_peers(self, group: "Group | GroupRef") -> int:
        """How many members of ``group`` sit on another node than this rank."""
        mine = self.node_of(dist.get_rank())
        return sum(1 for g in dist.get_process_group_ranks(as_group(group)) if self.node_of(g) != mine)

    def total_volume(self) -> int:
        return sum(self.volume.values())

    def total_bytes_sent(self) -> float:
        return sum(self.bytes_sent.values())

    def total_cross_node_bytes(self) -> float:
        return sum(self.cross_node_bytes.values())

    def reset(self) -> None:
        self.calls.clear()
        self.volume.clear()
        self.bytes_sent.clear()
        self.cross_node_bytes.clear()


__all__ = ["CommCounter", "ranks_per_node"]
