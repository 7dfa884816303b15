"""Communication per training step, per parallel axis, for one rank: bytes it sends and seconds on its link.

Ring collectives over n ranks move, per rank, 2 (n-1)/n x size (all-reduce) or (n-1)/n x size (reduce-scatter,
all-gather). With b = micro-batch, s = seq, h = hidden, L' = layers on the stage, m = micro-batches per step,
psi = parameters on the rank's (tp, pp) shard, P / G = bytes per parameter / gradient:

    tp   4 all-reduces per layer per micro-batch (2 forward, 2 backward; 6 with full recompute) of b s h
         activations: L' m n_ar 2 (t-1)/t b s h bytes_act (sequence parallel: all-gather + reduce-scatter, same bytes)
    dp   ZeRO 0: all-reduce G psi once per step                     -> 2 psi (ZeRO paper)
         ZeRO 1: reduce-scatter G psi + all-gather P psi per step     -> 2 psi
         ZeRO 2: reduce-scatter G psi per micro-batch + all-gather P psi per step  (2 psi when m = 1)
         ZeRO 3: all-gather P psi forward and backward + reduce-scatter G psi per micro-batch -> 3 psi
         each x (d-1)/d
    pp   per micro-batch an activation b s h forward and its gradient backward (/t with sequence parallel)
    offload  host <-> device over PCIe: gradients down and parameters up for the rank's 1/d partition per step
         (ZeRO-3 parameter offload: parameters up twice per micro-batch), plus the CPU Adam step

Links: ranks are ordered tp (innermost), dp, pp; a node holds ``gpus_per_node`` ranks. tp stays in a node; pp uses
NVLink when its groups fit in a node and the network otherwise. The dp axis splits its bytes by link: with p dp ranks
on a node (gpus_per_node / tp when tp dp spans nodes, else dp; the busiest rank's when the nodes split a dp group
unevenly) and c = psi / d, ``cross_node_bytes`` is what a rank receives from ranks on other nodes when each
collective runs in its direct form (every peer's chunk straight to its destination; what ``CommCounter`` reports as
``cross_node_bytes``): an all-gather or reduce-scatter over a group with x peers off the node receives x chunks
from the network (flat over dp: x = d - p), an all-reduce 2x, an all-to-all one row from each such peer. Seconds:
cross-node bytes at ``inter_node_bw`` plus the rest at ``intra_node_bw`` (the two links not overlapped).

    uncompressed, per step (G / P as above):
         ZeRO 0: 2 (d-p) G c      ZeRO 1: (d-p) (G + P) c      ZeRO 2: (d-p) (m G + P) c
         ZeRO 3: m (d-p) (2 P + G) c      (dp=16 over two 8-GPU nodes, bf16: 3 psi bytes, 3 x the unit (d-p) 2 c)

ZeRO++ (Wang et al. 2023; ``Layout``'s zero_quantized_* / zero_hpz_partition_size, ``llmpar/zero/compressed.py``).
A quantized row of n values is R_b(n) = round_up(ceil(n b / 8), 4) + 4 ceil(n / B) bytes (b bits, B =
zero_quantization_block_size values per fp32 scale; ``llmpar.ops.quant.row_bytes``):

    qwZ  (stage 3)  each param all-gather sends R_bw(c) codes + scales:  bytes (d-1) R_bw(c),  cross (d-p) R_bw(c)
    hpZ k (stage 3, 1 < k < d; k = d is plain ZeRO-3, as in the runtime)  forward gathers over dp as above
                    (quantized with qwZ); backward gathers the unit over the k dp ranks of the node from the
                    secondary shards, in param dtype:
                    bytes (k-1)/k P psi,  cross max(0, k-p) P psi / k  (0 when k <= p)
    qgZ  (stages 2-3)  the gradient reduce-scatter becomes all-to-alls of R_bg(c) rows. With q = k (hpZ) or p dp
                    ranks per node and n = d / q > 1 nodes (q > 1), two levels: inside the node each rank sends n
                    rows to each of its q-1 peers (bytes (q-1) n R_bg(c) = (q-1)/q psi quantized, cross
                    max(0, q-p) n R_bg(c)), then the partial sums between nodes, one row to each of n-1 peers
                    (bytes (n-1) R_bg(c) = (n-1)/n psi/q quantized, cross (n - max(1, p/q)) R_bg(c)); otherwise
                    one level:
                    bytes (d-1) R_bg(c), cross (d-p) R_bg(c)
    per step, stage 3: m x (forward gather + backward gather + gradient reduction), the backward gather less the
                    layers ``stage3_max_reuse_distance`` keeps (``ModelSpec.stage3_kept_layers``); stage 2:
                    m x reduction + the flat param all-gather. dp=16 over two 8-GPU nodes, bf16, qwZ int8 + hpZ 8 +
                    qgZ int4 two-level: cross = R_8(c) (d-p) + 0 + R_4(c) ~ (8.13 + 0.52) c ~ 0.54 psi bytes,
                    vs 3 psi uncompressed.
Mixture of experts (``Layout.ep``): the dp line above runs for the dense params over d and, again, for the rank's
routed experts (``ModelSpec.stage_split``) over the edp = d / ep ranks holding the same experts (strided by tp ep, so
``dp_nodes`` of tp ep ranks; ZeRO++ options are not applied to them). The ``ep`` axis is the all-to-all of each MoE
layer of the stage: T = b s m tokens per rank (/ t with sequence parallelism), each sent to k experts, (ep-1)/ep of
them on other ranks under even routing: dispatch and combine, forward and backward,

    ep   L'_moe 4 T k (ep-1)/ep h bytes_act      (``moe.alltoall_bytes``), on NVLink when tp ep ranks fit a node

Stage-3 persistent params (``stage3_param_persistence_threshold``) are counted like the others: the runtime gathers
them uncompressed once per step instead, a small difference for models whose small params are a small share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .layout import Layout, check_degree
from .memory import PRECISION_BYTES
from .model_spec import ModelSpec
from .presets import Hardware
from .zeropp import dp_comm, dp_nodes


@dataclass(kw_only=True, frozen=True)
class AxisComm:
    axis: str
    bytes: float  # sent by one rank per step
    seconds: float
    link: str  # "nvlink", "network", "pcie" or "-"
    cross_node_bytes: float = 0.0  # received by one rank per step from ranks on other nodes (direct form)

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


def _link(hw: Hardware, span: int) -> tuple[str, float]:
    return ("nvlink", hw.intra_node_bw) if span <= hw.gpus_per_node else ("network", hw.inter_node_bw)


def estimate_comm(
    spec: ModelSpec,
    layout: Layout,
    hw: Hardware,
    *,
    precision: str = "fp32_master",
    micro_batch: int = 1,
    micro_batches: int = 1,
    seq_len: int | None = None,
) -> dict[str, AxisComm]:
    """Per-axis bytes and seconds for one step of ``micro_batches`` micro-batches (see module doc)."""
    check_degree("micro_batch", micro_batch)
    check_degree("micro_batches", micro_batches)
    spec.check_layout(tp=layout.tp, pp=layout.pp)
    if layout.tp > hw.gpus_per_node:
        raise ValueError(f"tp={layout.tp} exceeds gpus_per_node={hw.gpus_per_node}; tensor parallelism stays in a node")
    t, p, d, m = layout.tp, layout.pp, layout.dp, micro_batches
    s = seq_len or spec.seq_len
    act_bytes = 4 if precision == "fp32" else 2
    bsh = micro_batch * s * spec.hidden * act_bytes
    pb, gb, _ = PRECISION_BYTES[precision]
    psi = spec.params_per_rank(tp=t, pp=p)
    out: dict[str, AxisComm] = {}

    n_ar = 6 if layout.activation_checkpointing == "full" else 4
    tp_bytes = (spec.n_layers // p) * m * n_ar * 2 * (t - 1) / t * bsh
    out["tp"] = AxisComm(
        axis="tp", bytes=tp_bytes, seconds=tp_bytes / hw.intra_node_bw, link="nvlink" if t > 1 else "-"
    )

    per_node, even = dp_nodes(tp=t, dp=d, pp=p, gpus_per_node=hw.gpus_per_node)
    kept = spec.stage3_kept_layers(layout.stage3_max_reuse_distance, tp=t, pp=p) * spec.layer_params(t)
    dense, routed = spec.stage_split(tp=t, pp=p, ep=layout.ep) if spec.num_experts else (psi, 0)
    dp_bytes, dp_cross = dp_comm(
        layout,
        dense,
        pb=pb,
        gb=gb,
        micro_batches=m,
        per_node=per_node,
        even=even,
        kept=kept if layout.zero_stage == 3 else 0.0,
    )
    if routed:
        edp, e = d // layout.ep, layout.ep
        plain = replace(layout, dp=edp, ep=1, zero_quantized_weights=False, zero_hpz_partition_size=1)
        plain = replace(plain, zero_quantized_gradients=False, zero_quantized_gradients_error_feedback=False)
        e_node, e_even = _edp_nodes(t * e, edp, p, hw.gpus_per_node)
        e_bytes, e_cross = dp_comm(plain, routed, pb=pb, gb=gb, micro_batches=m, per_node=e_node, even=e_even)
        dp_bytes, dp_cross = dp_bytes + e_bytes, dp_cross + e_cross
    link = "-" if d == 1 else ("network" if per_node < d else "nvlink")
    out["dp"] = AxisComm(
        axis="dp",
        bytes=dp_bytes,
        cross_node_bytes=dp_cross,
        link=link,
        seconds=dp_cross / hw.inter_node_bw + (dp_bytes - dp_cross) / hw.intra_node_bw,
    )

    pp_bytes = 2 * m * bsh / (t if layout.sequence_parallel else 1) if p > 1 else 0.0
    link, bw = _link(hw, t * d * p)
    out["pp"] = AxisComm(
        axis="pp",
        bytes=pp_bytes,
        seconds=pp_bytes / bw,
        link=link if p > 1 else "-",
        cross_node_bytes=pp_bytes if link == "network" else 0.0,
    )

    tokens = micro_batch * s * m // (t if layout.sequence_parallel else 1)
    ep_bytes = _busiest_moe_layers(spec, p) * alltoall_bytes_per_layer(
        spec, ep=layout.ep, tokens=tokens, act_bytes=act_bytes
    )
    link, bw = _link(hw, t * layout.ep)
    out["ep"] = AxisComm(
        axis="ep",
        bytes=ep_bytes,
        seconds=ep_bytes / bw,
        link=link if layout.ep > 1 else "-",
        cross_node_bytes=ep_bytes if link == "network" else 0.0,
    )

    off_bytes, off_seconds = 0.0, 0.0
    if layout.offload != "none":
        share = psi / d
        off_bytes = (gb + pb) * share
        if layout.offload == "optimizer+params":
            off_bytes = gb * m * share + 2 * pb * m * share
        off_seconds = off_bytes / hw.pcie_bw + share / hw.cpu_adam_params_per_s
    out["offload"] = AxisComm(
        axis="offload", bytes=off_bytes, seconds=off_seconds, link="pcie" if layout.offload != "none" else "-"
    )
    return out


def alltoall_bytes_per_layer(spec: ModelSpec, *, ep: int, tokens: int, act_bytes: int) -> float:
    """Bytes one rank sends by all-to-all in one MoE layer per step: 4 T k (ep-1)/ep h bytes_act (module doc)."""
    return 4 * tokens * spec.top_k * (ep - 1) / ep * spec.hidden * act_bytes if spec.num_experts else 0.0


def _edp_nodes(unit: int, edp: int, pp: int, gpus_per_node: int) -> tuple[int, bool]:
    """``dp_nodes`` for the edp ranks, ``unit`` = tp ep apart: one per node when a unit fills a node or more."""
    if unit * edp > gpus_per_node and (unit >= gpus_per_node or gpus_per_node % unit):
        return 1, unit % gpus_per_node == 0
    return dp_nodes(tp=unit, dp=edp, pp=pp, gpus_per_node=gpus_per_node)


def _busiest_moe_layers(spec: ModelSpec, pp: int) -> int:
    n = spec.n_layers // pp
    return max(sum(spec.layer_kinds()[i * n : (i + 1) * n]) for i in range(pp))
