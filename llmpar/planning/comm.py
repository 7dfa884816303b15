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

Links: ranks are ordered tp (innermost), dp, pp. tp stays in a node; dp and pp use NVLink when their groups fit in a
node and the network otherwise.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .memory import PRECISION_BYTES, Layout, _check_degree
from .model_spec import ModelSpec
from .presets import Hardware


@dataclass(kw_only=True, frozen=True)
class AxisComm:
    axis: str
    bytes: float  # sent by one rank per step
    seconds: float
    link: str  # "nvlink", "network", "pcie" or "-"

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
    _check_degree("micro_batch", micro_batch)
    _check_degree("micro_batches", micro_batches)
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
    out["tp"] = AxisComm(axis="tp", bytes=tp_bytes, seconds=tp_bytes / hw.intra_node_bw, link="nvlink" if t > 1 else "-")

    ring = (d - 1) / d
    stage = layout.zero_stage
    if stage == 0:
        dp_bytes = 2 * ring * gb * psi
    elif stage == 1:
        dp_bytes = ring * (gb + pb) * psi
    elif stage == 2:
        dp_bytes = ring * (m * gb + pb) * psi
    else:
        dp_bytes = ring * m * (2 * pb + gb) * psi
    link, bw = _link(hw, t * d)
    out["dp"] = AxisComm(axis="dp", bytes=dp_bytes, seconds=dp_bytes / bw, link=link if d > 1 else "-")

    pp_bytes = 2 * m * bsh / (t if layout.sequence_parallel else 1) if p > 1 else 0.0
    link, bw = _link(hw, t * d * p)
    out["pp"] = AxisComm(axis="pp", bytes=pp_bytes, seconds=pp_bytes / bw, link=link if p > 1 else "-")

    off_bytes, off_seconds = 0.0, 0.0
    if layout.offload != "none":
        share = psi / d
        off_bytes = (gb + pb) * share
        if layout.offload == "optimizer+params":
            off_bytes = gb * m * share + 2 * pb * m * share
        off_seconds = off_bytes / hw.pcie_bw + share / hw.cpu_adam_params_per_s
    out["offload"] = AxisComm(axis="offload", bytes=off_bytes, seconds=off_seconds,
                              link="pcie" if layout.offload != "none" else "-")
    return out
