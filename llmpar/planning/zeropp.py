"""ZeRO++-class compressed communication on the dp axis: where the dp ranks sit on nodes, the wire bytes of
blockwise-quantized rows, and the per-step bytes / cross-node bytes of the ZeRO collectives (formulas in
``comm.py``'s module docstring; memory terms in ``memory.py``).

A node holds ``gpus_per_node`` consecutive global ranks, tp innermost, then dp, then pp: a dp group of d ranks
(global stride tp) has ``gpus_per_node / tp`` of its ranks on each node it spans.
"""

from __future__ import annotations

import math
from typing import Any


def quant_row_bytes(m: int, bits: int, block: int) -> int:
    """Wire bytes of one quantized row of ``m`` values (``llmpar.ops.quant.row_bytes``): codes rounded up to 4 bytes,
    plus one float32 scale per ``block`` values."""
    codes = (m * bits + 7) // 8
    return (codes + 3) // 4 * 4 + 4 * math.ceil(m / block)


def dp_nodes(*, tp: int, dp: int, pp: int, gpus_per_node: int) -> tuple[int, bool]:
    """(dp ranks sharing a node with the busiest dp rank, whether every node holds that many consecutive dp ranks of
    each group). A dp group of tp x dp <= gpus_per_node ranks counts as inside one node (as ``_link`` does)."""
    span = tp * dp
    if span <= gpus_per_node:
        return dp, True
    if gpus_per_node % tp:
        raise ValueError(
            f"gpus_per_node={gpus_per_node} is not a multiple of tp={tp}: the dp ranks of a node are "
            "not whole tp groups"
        )
    fewest = gpus_per_node // tp
    for stage in range(pp):  # stage s holds global ranks [s span, (s+1) span): its first and last node may be partial
        start = stage * span
        first, last = gpus_per_node - start % gpus_per_node, (start + span) % gpus_per_node or gpus_per_node
        fewest = min(fewest, first // tp, last // tp)
    return fewest, span % gpus_per_node == 0


def _cross(group: int, per_node: int) -> int:
    """Peers on other nodes in a group of ``group`` consecutive dp ranks (aligned), ``per_node`` dp ranks a node,
    one dividing the other."""
    return max(0, group - per_node)


def _check_nested(name: str, k: int, per_node: int, even: bool, layout: Any) -> None:
    if not even:
        raise ValueError(
            f"{name}={k}: the dp ranks of layout tp={layout.tp} dp={layout.dp} pp={layout.pp} do not "
            f"split evenly over the nodes; choose a layout whose tp x dp is a multiple of gpus_per_node"
        )
    if k % per_node and per_node % k:
        raise ValueError(
            f"{name}={k} and the {per_node} dp ranks of a node: one must divide the other (a group "
            "inside a node or spanning whole nodes)"
        )


def grad_per_node(layout: Any, per_node: int, even: bool) -> int:
    """The qgZ split's dp ranks per 'node': ``zero_hpz_partition_size`` when set, else the ranks of a physical node
    (the runtime's ``NodeSplit``)."""
    k = layout.zero_hpz_partition_size
    q = k if k > 1 else per_node
    if 1 < q < layout.dp:
        _check_nested("zero_hpz_partition_size" if k > 1 else "dp ranks per node", q, per_node, even, layout)
    return q


def dp_comm(
    layout: Any, psi: float, *, pb: int, gb: int, micro_batches: int, per_node: int, even: bool, kept: float = 0.0
) -> tuple[float, float]:
    """(bytes one dp rank sends, bytes it receives from other nodes in the direct form) per step; stage 3:
    ``kept`` of the ``psi`` params stay gathered from forward to backward (not gathered again)."""
    d, m = layout.dp, micro_batches
    if d == 1:
        return 0.0, 0.0
    ring, share, x_dp = (d - 1) / d, psi / d, d - per_node
    stage = layout.zero_stage
    if stage == 0:  # all-reduce: reduce-scatter + all-gather of the gradients
        return 2 * ring * gb * psi, 2 * x_dp * gb * share
    gather = (ring * pb * psi, x_dp * pb * share)  # one flat all-gather of the params
    if stage == 1:
        return ring * (gb + pb) * psi, x_dp * (gb + pb) * share
    chunk, block = math.ceil(psi / d), layout.zero_quantization_block_size
    if layout.zero_quantized_gradients:
        q = grad_per_node(layout, per_node, even)
        rb = quant_row_bytes(chunk, layout.zero_quantized_gradients_bits, block)
        nodes = d // q
        if 1 < q < d:  # inside the node (n rows to each of q-1 peers), then between nodes (1 row to each of n-1)
            reduce = (
                (q - 1) * nodes * rb + (nodes - 1) * rb,
                _cross(q, per_node) * nodes * rb + (nodes - max(1, per_node // q)) * rb,
            )
        else:
            reduce = ((d - 1) * rb, x_dp * rb)
    else:
        reduce = (ring * gb * psi, x_dp * gb * share)
    if stage == 2:
        return m * reduce[0] + gather[0], m * reduce[1] + gather[1]
    fwd = gather
    if layout.zero_quantized_weights:
        rb = quant_row_bytes(chunk, layout.zero_quantized_weights_bits, block)
        fwd = ((d - 1) * rb, x_dp * rb)
    bwd = fwd
    k = layout.hpz
    if k > 1:  # from the secondary shards over the k dp ranks of the node, as stored (param dtype)
        _check_nested("zero_hpz_partition_size", k, per_node, even, layout)
        bwd = ((k - 1) / k * pb * psi, _cross(k, per_node) * pb * psi / k)
    again = 1.0 - kept / psi
    bwd = (bwd[0] * again, bwd[1] * again)
    return (m * (fwd[0] + bwd[0] + reduce[0]), m * (fwd[1] + bwd[1] + reduce[1]))


def zeropp_state_bytes(layout: Any, psi: float, sharded: float, pb: int, per_node: int | None) -> float:
    """Extra bytes a rank holds for ZeRO++: the hpZ secondary shard (``pb`` x sharded / k, from forward to backward;
    ``sharded``: the non-persistent params) and the qgZ error-feedback residuals (float32: 4 psi, + 4 psi / q with
    two levels). ``per_node``: dp ranks per node (None: one node)."""
    if layout.dp == 1:
        return 0.0
    out = pb * sharded / layout.hpz if layout.hpz > 1 else 0.0
    if layout.zero_quantized_gradients_error_feedback:
        k = layout.zero_hpz_partition_size
        q = k if k > 1 else (per_node or layout.dp)
        out += 4.0 * psi + (4.0 * psi / q if 1 < q < layout.dp else 0.0)
    return out
