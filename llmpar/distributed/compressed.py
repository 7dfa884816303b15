"""Compressed and hierarchical collectives for ZeRO (the ZeRO++ class): what crosses the wire is blockwise-quantized
(``llmpar.ops.quant``: int8 / int4 codes + one float32 scale per block), and the reduce-scatter can reduce inside each
node before anything crosses between nodes.

    NodeSplit(dp_group, ranks_per_node)     the dp axis as [nodes, per_node]: ``intra`` (my node's dp ranks) and
                                            ``inter`` (the dp ranks with my index on every node) groups
    all_gather_quantized(out, shard, group)            out[r*n:(r+1)*n] = dequant(quant(shard of r)), every r,
                                                       this rank's own chunk included (every rank holds equal values)
    reduce_scatter_quantized(out, wire, split, ...)    out[n] (+)= sum_r dequant(chunk d of rank r's quantized input)
        ``wire`` holds the input already quantized as ``world`` rows (row d: the chunk dp rank d owns; the caller
        quantizes while it packs, ``pack_quantize``). Two levels when the split has several nodes of several ranks:
        an all-to-all inside the node (each rank then sums its node's contributions to the chunks it forwards),
        a re-quantization of those partial sums, an all-to-all between nodes of the ranks with the same index.
        Cross-node bytes per rank: (nodes - 1) rows of ``n`` values, vs (world - per_node) rows single-level.

Both count what they move in a :class:`CommCounter` under "all_gather_q" / "all_to_all_q" (wire bytes). Async calls
return a handle whose ``is_completed()`` moves a two-level reduction on to its second all-to-all once the first
has landed, so a poller (the gradient reducer) keeps both levels in flight without blocking.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from llmpar.distributed.collectives import CommCounter, Handle, all_gather_flat, failing_as
from llmpar.distributed.counter import ranks_per_node as local_ranks_per_node
from llmpar.distributed.groups import Group, GroupRef, as_group, group_rank
from llmpar.ops.quant import dequantize_rows, dequantize_sum, pack_quantize, quantize_rows, row_bytes


class NodeSplit:
    """The dp group split by node: ``per_node`` dp ranks on each of ``nodes`` nodes (a collective over the dp ranks:
    each builds its node's ``intra`` group and its index's ``inter`` group).

    ``ranks_per_node`` counts global ranks (torchrun's ``LOCAL_WORLD_SIZE``); the dp ranks of one node are those whose
    global ranks fall on it, which with tp innermost is ``ranks_per_node / tp`` consecutive dp ranks. ``per_node``
    (e.g. ``zero_hpz_partition_size``) may instead be given directly, in dp ranks. Every node must hold the same
    number of consecutive dp ranks."""

    def __init__(
        self, dp_group: "Group | GroupRef", *, per_node: int | None = None, ranks_per_node: int | None = None
    ) -> None:
        pg = as_group(dp_group)
        ranks = dist.get_process_group_ranks(pg)
        world = len(ranks)
        if per_node is None:
            rpn = ranks_per_node or local_ranks_per_node()
            nodes_of = [g // rpn for g in ranks]
            per_node = nodes_of.count(nodes_of[0])
            blocks = [nodes_of[i : i + per_node] for i in range(0, world, per_node)]
            if world % per_node or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
                raise ValueError(
                    f"the dp ranks {ranks} do not split into equal runs of consecutive ranks per node "
                    f"({rpn} ranks per node): launch with tp innermost and whole nodes per dp group"
                )
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 or world % per_node:
            raise ValueError(f"ranks per node {per_node!r} must be a positive int dividing the dp degree {world}")
        self.per_node, self.nodes, self.world = per_node, world // per_node, world
        me = group_rank(pg)
        self.node, self.local = divmod(me, per_node)
        self.intra: GroupRef | None = None
        self.inter: GroupRef | None = None
        if 1 < per_node:  # my node's dp ranks
            self.intra = GroupRef(
                dist.new_group(ranks[self.node * per_node : (self.node + 1) * per_node], use_local_synchronization=True)
            )
        if 1 < self.nodes:  # the dp ranks with my index, one per node
            self.inter = GroupRef(dist.new_group(ranks[self.local :: per_node], use_local_synchronization=True))
        self.dp = GroupRef(pg)
        self.chains: list[ChainHandle] = []  # multi-step reductions still to launch a step, oldest first

    @property
    def hierarchical(self) -> bool:
        return self.per_node > 1 and self.nodes > 1

    def __repr__(self) -> str:
        return f"NodeSplit(nodes={self.nodes}, per_node={self.per_node})"


class ChainHandle:
    """A collective in steps: ``steps[i]()`` launches step i and returns its handle; ``finish`` runs after the last.
    ``is_completed`` advances through landed steps without blocking.

    Chains sharing a ``queue`` (those of one :class:`NodeSplit`) launch their later steps in the order the chains
    were made, whatever order they are polled or waited in: every rank then issues the same sequence of collectives
    on each group (a mismatch would hang or mix buffers)."""

    def __init__(
        self,
        steps: list[Callable[[], Handle]],
        finish: Callable[[], None] | None,
        queue: list["ChainHandle"] | None = None,
    ) -> None:
        self._steps, self._finish = list(steps), finish
        self._queue = queue if queue is not None else []
        self._done = False
        self._current: Handle | None = self._steps.pop(0)()
        if self._steps:
            self._queue.append(self)

    def _older_launched(self, *, block: bool) -> bool:
        """Whether every chain queued before this one has launched its last step (``block``: make it so)."""
        while self._queue and self._queue[0] is not self:
            older = self._queue[0]
            if block:
                older.wait()
            elif not older._advance(block=False) and older._steps:
                return False
        return True

    def _advance(self, *, block: bool) -> bool:
        while True:
            if self._current is not None:
                if not block and not self._current.is_completed():
                    return False
                self._current.wait()
                self._current = None
            if not self._steps:
                if not self._done:
                    self._done = True
                    if self._finish is not None:
                        self._finish()
                return True
            if not self._older_launched(block=block):
                return False
            self._current = self._steps.pop(0)()
            if not self._steps:
                self._queue.remove(self)

    def wait(self) -> None:
        self._advance(block=True)

    def is_completed(self) -> bool:
        return self._done or self._advance(block=False)


def _all_to_all(
    recv: torch.Tensor, send: torch.Tensor, group: "Group | GroupRef", counter: CommCounter | None, what: str
) -> Handle:
    pg = as_group(group)
    size = dist.get_world_size(pg)
    if counter is not None:
        row = send.numel() // size  # bytes per peer
        counter.record("all_to_all_q", send.numel(), (size - 1) * row, row * counter.cross_peers(pg))
    with failing_as(what, pg):
        work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=pg, async_op=True)
    return Handle([work], None, what=what, pg=pg)


def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    group: "Group | GroupRef",
    *,
    bits: int = 8,
    block: int = 256,
    async_op: bool = False,
    counter: CommCounter | None = None,
    what: str | None = None,
) -> Handle | None:
    """``output[r*n:(r+1)*n] = dequant(quant(input of group rank r))`` for every r (own chunk included): input
    ``[n]`` float, output ``[world*n]`` any float dtype (the dequantization writes it: the unpack pass)."""
    pg = as_group(group)
    size = dist.get_world_size(pg)
    n = input.numel()
    if output.numel() != size * n or input.dim() != 1 or not output.is_contiguous():
        raise ValueError(
            f"output has {output.numel()} elements, expected contiguous group size {size} x input "
            f"{n} = {size * n} (input 1-D)"
        )
    what = what or f"quantized all-gather of {output.numel()} elements"
    mine = quantize_rows(input.view(1, n), bits=bits, block=block)
    wire = torch.empty(size, mine.shape[1], dtype=torch.uint8, device=input.device)
    if counter is not None:
        nbytes = wire.numel()
        counter.record(
            "all_gather_q", output.numel(), (size - 1) / size * nbytes, nbytes / size * counter.cross_peers(pg)
        )
    gathered = all_gather_flat(wire.view(-1), mine.view(-1), pg, async_op=True, what=what)
    assert gathered is not None

    def unpack() -> None:
        dequantize_rows(wire, m=n, bits=bits, block=block, out=output.view(size, n))

    handle = Handle([gathered], unpack, what=what, pg=pg)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter_quantized(
    output: torch.Tensor,
    wire: torch.Tensor,
    split: NodeSplit,
    *,
    n: int,
    bits: int = 4,
    block: int = 256,
    accumulate: bool = False,
    residual: torch.Tensor | None = None,
    counter: CommCounter | None = None,
    what: str = "quantized reduce-scatter",
    async_op: bool = False,
) -> "ChainHandle | None":
    """``output[n] (+)= sum over dp ranks r of dequant(row d of r's wire)`` with d this rank's dp index (module
    docstring). ``wire``: ``uint8 [world, row_bytes(n)]``, row d the chunk of dp rank d (``pack_quantize(rows=world,
    m=n)``). ``residual`` (float32 ``[nodes * n]``): error feedback of the second level's re-quantization.
    The partial sums of the first level are summed in float32."""
    world = split.world
    rb = row_bytes(n, bits, block)
    if wire.dtype != torch.uint8 or tuple(wire.shape) != (world, rb):
        raise ValueError(f"wire must be uint8 [{world}, {rb}], got {wire.dtype} {tuple(wire.shape)}")
    if residual is not None and not split.hierarchical:
        raise ValueError(
            "residual is the second level's error feedback: only for a split with several nodes of several ranks"
        )
    if residual is not None and (residual.dtype != torch.float32 or residual.numel() != split.nodes * n):
        raise ValueError(
            f"residual must be float32 [{split.nodes * n}] (nodes x chunk), got {residual.dtype} "
            f"{tuple(residual.shape)}"
        )
    device = wire.device
    k, nodes = split.per_node, split.nodes
    state: dict[str, torch.Tensor] = {}

    def land(recv: torch.Tensor) -> None:
        dequantize_sum(recv, m=n, bits=bits, block=block, out=output, accumulate=accumulate)

    if not split.hierarchical:
        group = split.dp
        state["recv"] = torch.empty_like(wire)
        steps = [lambda: _all_to_all(state["recv"], wire, group, counter, what)]
        handle = ChainHandle(steps, lambda: land(state["recv"]), split.chains)
    else:
        intra, inter = split.intra, split.inter
        assert intra is not None and inter is not None  # a hierarchical split has both groups
        # level 1, inside the node: to intra peer l go the rows of the chunks owned by dp ranks (node', l)
        send1 = wire.view(nodes, k, rb).transpose(0, 1).contiguous()  # [k, nodes, rb]
        state["recv1"] = torch.empty_like(send1)

        def level2() -> Handle:
            recv1 = state.pop("recv1").transpose(0, 1).contiguous()  # [nodes, k sources, rb]
            partial = torch.empty(nodes, n, dtype=torch.float32, device=device)
            for node in range(nodes):
                dequantize_sum(recv1[node], m=n, bits=bits, block=block, out=partial[node])
            # the re-quantization of the partial sums, with its own error feedback
            send2 = pack_quantize([partial.view(-1)], rows=nodes, m=n, bits=bits, block=block, residual=residual)
            state["recv2"] = torch.empty_like(send2)
            return _all_to_all(state["recv2"], send2, inter, counter, what + " (between nodes)")

        steps = [lambda: _all_to_all(state["recv1"], send1, intra, counter, what + " (inside the node)"), level2]
        handle = ChainHandle(steps, lambda: land(state["recv2"]), split.chains)
    if async_op:
        return handle
    handle.wait()
    return None


__all__ = ["ChainHandle", "NodeSplit", "all_gather_quantized", "reduce_scatter_quantized"]
