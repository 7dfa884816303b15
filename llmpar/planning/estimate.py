"""One layout's estimate (:func:`evaluate`): per-rank memory, traffic per axis and step time of a
(tp, pp, dp, ZeRO, offload, recompute) layout for a :class:`PlanRequest`, whether it fits and why not, and the
sentence explaining each choice; ``planner.py`` enumerates the layouts and ranks these rows.

Step time of one rank (m micro-batches, p pipeline stages, world W, T tokens per step):

    compute   = F_hw T / (W peak mfu),  F_hw = 6N + 12Lhs per token (+2N + 4Lhs full recompute, +4Lhs selective)
                N: the parameters a token uses (an MoE model's k of E routed experts)
    pipeline  = (compute + tp + pp + ep) (m + p - 1) / m     the 1F1B bubble (p-1)/(m+p-1) of the step; ep: the
                MoE all-to-alls (``comm.py``), on the critical path
    dp        = exposed part of the ZeRO traffic: what does not hide behind the backward pass (2/3 of compute;
                ZeRO-3 prefetching hides behind forward and backward)
    step      = pipeline + max(0, dp - overlap) + offload (PCIe + CPU Adam, not overlapped)

A ZeRO++ layout's dp seconds charge the cross-node bytes at the network's speed and the rest at NVLink's
(``comm.py``), its memory adds hpZ's secondary shard (``memory.py``). A context-parallel layout (``context.py``) runs
the sequence / cp per rank, ZeRO over dp x cp, the tp and dp traffic of s / cp tokens, plus the exposed cp traffic
(Ulysses' all-to-alls; the ring's excess over attention). A layout fits when the global batch is a multiple of
dp x micro-batch, GPU bytes <= gpu memory - reserve, and the offloaded bytes of a node's ranks <= host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .chinchilla import flops_per_token
from .comm import AxisComm, estimate_comm
from .context import cp_words
from .cp_plan import cp_comm
from .layout import Layout
from .memory import PRECISION_BYTES, MemoryEstimate, estimate_memory
from .model_spec import ModelSpec
from .presets import Hardware
from .units import format_bytes, format_seconds

DEFAULT_BATCH_TOKENS = 2**22  # ~4M tokens per step when no global batch is given (Llama's batch)


@dataclass(kw_only=True, frozen=True)
class PlanRequest:
    """What to plan for. ``global_batch`` is in sequences; by default the smallest multiple of gpus x micro_batch
    holding >= 4M tokens (so every dp divides it). ``mfu``: fraction of peak the matmuls reach."""

    model: ModelSpec
    gpus: int
    hardware: Hardware
    micro_batch: int = 1
    global_batch: int | None = None
    precision: str = "fp32_master"
    mfu: float = 0.5
    reserve_bytes: float = 2e9  # CUDA context, allocator fragmentation, kernels' workspaces
    sequence_parallel: bool = True  # used whenever tp > 1
    allow_offload: bool = True
    bucket_bytes: float = 100e6
    zeropp: bool = False  # also try ZeRO++ (qwZ int8 + hpZ over a node + qgZ int4) where dp spans whole nodes
    context_parallel: str = "auto"  # "auto": cp / tiled layouts when nothing else fits; "on": always; "off": never
    ep: int | None = None  # expert parallelism of an MoE model; None: the smallest that fits (``moe.py``)

    def __post_init__(self) -> None:
        for name in ("gpus", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.global_batch is not None and (not isinstance(self.global_batch, int) or self.global_batch < 1):
            raise ValueError(f"global_batch={self.global_batch!r} must be a positive integer (sequences per step)")
        if self.global_batch is not None and self.global_batch % self.micro_batch:
            raise ValueError(f"global_batch={self.global_batch} is not a multiple of micro_batch={self.micro_batch}")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"precision={self.precision!r}; accepted: {', '.join(PRECISION_BYTES)}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu={self.mfu!r} must be in (0, 1]")
        if self.context_parallel not in ("auto", "on", "off"):
            raise ValueError(f"context_parallel={self.context_parallel!r}; accepted: 'auto', 'on', 'off'")
        if self.ep is not None:
            if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
                raise ValueError(f"ep={self.ep!r} must be a positive integer")
            if self.ep > 1 and not self.model.num_experts:
                raise ValueError(f"ep={self.ep} needs a mixture-of-experts model; {self.model.name} has no experts")
            if self.model.num_experts % self.ep:
                raise ValueError(f"ep={self.ep} does not divide num_experts={self.model.num_experts}")
        if not 0 <= self.reserve_bytes < self.hardware.mem_bytes:
            raise ValueError(f"reserve_bytes={self.reserve_bytes!r} must be >= 0 and below the gpu memory")

    @property
    def gpus_per_node(self) -> int:
        return min(self.hardware.gpus_per_node, self.gpus)

    @property
    def batch(self) -> int:
        if self.global_batch is not None:
            return self.global_batch
        unit = self.gpus * self.micro_batch
        return unit * max(1, math.ceil(DEFAULT_BATCH_TOKENS / self.model.seq_len / unit))


@dataclass(kw_only=True)
class PlanRow:
    layout: Layout
    memory: MemoryEstimate
    comm: dict[str, AxisComm]
    micro_batches: int
    compute_s: float
    bubble: float  # fraction of the pipelined time spent idle, (p-1)/(m+p-1)
    exposed_dp_s: float
    step_s: float
    tokens_per_s: float
    fits: bool
    why_not: str = ""
    explanation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "memory": self.memory.to_dict(),
            "comm": {k: v.to_dict() for k, v in self.comm.items()},
            "micro_batches": self.micro_batches,
            "compute_s": self.compute_s,
            "bubble": self.bubble,
            "exposed_dp_s": self.exposed_dp_s,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
            "why_not": self.why_not,
            "explanation": self.explanation,
        }


def zero_label(lay: Layout) -> str:
    """The ZeRO stage, ``++`` when ZeRO++ options are on."""
    return f"{lay.zero_stage}++" if lay.compressed else str(lay.zero_stage)


def _zeropp_words(lay: Layout) -> str:
    words = []
    if lay.zero_quantized_weights:
        words.append(f"qwZ int{lay.zero_quantized_weights_bits}")
    if lay.hpz > 1:
        words.append(f"hpZ {lay.hpz}")
    if lay.zero_quantized_gradients:
        ef = " + error feedback" if lay.zero_quantized_gradients_error_feedback else ""
        words.append(f"qgZ int{lay.zero_quantized_gradients_bits}{ef}")
    return ", ".join(words)


def _hardware_flops_per_token(spec: ModelSpec, ckpt: str) -> float:
    n, lhs = spec.matmul_params(), spec.n_layers * spec.hidden * spec.seq_len
    extra = {"none": 0.0, "selective": 4.0 * lhs, "full": 2.0 * n + 4.0 * lhs}[ckpt]
    return flops_per_token(params=n, n_layers=spec.n_layers, hidden=spec.hidden, seq_len=spec.seq_len) + extra


def evaluate(req: PlanRequest, layout: Layout) -> PlanRow:
    """Memory, communication and step time of one layout (see module doc)."""
    spec, hw = req.model, req.hardware
    batch = req.batch
    if batch % (layout.dp * req.micro_batch):
        why = f"global batch {batch} is not a multiple of dp x micro-batch = {layout.dp * req.micro_batch}"
        m = 1
    else:
        why, m = "", batch // (layout.dp * req.micro_batch)
    mem = estimate_memory(
        spec,
        layout,
        precision=req.precision,
        micro_batch=req.micro_batch,
        micro_batches_in_flight=m,
        bucket_bytes=req.bucket_bytes,
        gpus_per_node=hw.gpus_per_node,
    )
    cp = layout.cp
    flat = replace(layout, dp=layout.dp * cp, cp=1, tiled=False) if cp > 1 else layout  # ZeRO over dp x cp
    comm = estimate_comm(
        spec,
        flat,
        hw,
        precision=req.precision,
        micro_batch=req.micro_batch,
        micro_batches=m,
        seq_len=math.ceil(spec.seq_len / cp),
    )
    tokens = batch * spec.seq_len
    compute = (
        _hardware_flops_per_token(spec, layout.activation_checkpointing)
        * tokens
        / (layout.world_size * hw.peak_flops * req.mfu)
    )
    exposed_cp = 0.0
    if cp > 1:
        comm["cp"], exposed_cp = cp_comm(
            spec,
            layout,
            hw,
            micro_batch=req.micro_batch,
            micro_batches=m,
            precision=req.precision,
            mfu=req.mfu,
            tokens=tokens,
        )
    p = layout.pp
    pipelined = (compute + comm["tp"].seconds + comm["pp"].seconds + comm["ep"].seconds + exposed_cp) * (m + p - 1) / m
    overlap = compute if layout.zero_stage == 3 else compute * 2.0 / 3.0
    exposed_dp = max(0.0, comm["dp"].seconds - overlap)
    step = pipelined + exposed_dp + comm["offload"].seconds
    usable = hw.mem_bytes - req.reserve_bytes
    node_cpu = mem.cpu * min(hw.gpus_per_node, layout.world_size)
    if not why and mem.total > usable:
        why = f"needs {mem.total / 1e9:.1f} GB per GPU > {usable / 1e9:.1f} GB usable"
    if not why and node_cpu > hw.cpu_mem_per_node:
        why = f"offload needs {node_cpu / 1e9:.0f} GB host memory per node > {hw.cpu_mem_per_node / 1e9:.0f} GB"
    row = PlanRow(
        layout=layout,
        memory=mem,
        comm=comm,
        micro_batches=m,
        compute_s=compute,
        bubble=(p - 1) / (m + p - 1),
        exposed_dp_s=exposed_dp,
        step_s=step,
        tokens_per_s=tokens / step,
        fits=not why,
        why_not=why,
    )
    row.explanation = explain(row, req)
    return row


def explain(row: PlanRow, req: PlanRequest) -> str:
    """One line per choice: what it splits and what it costs."""
    lay, c, parts = row.layout, row.comm, []
    if lay.tp > 1:
        sp = " + sequence parallel" if lay.sequence_parallel else ""
        parts.append(
            f"tp={lay.tp}{sp} in a node: weights and activations /{lay.tp}, "
            f"{format_seconds(c['tp'].seconds)} of all-reduces"
        )
    else:
        parts.append("tp=1: no tensor-parallel traffic")
    if lay.pp > 1:
        parts.append(
            f"pp={lay.pp}: {req.model.n_layers // lay.pp} layers per stage, bubble {row.bubble:.0%} "
            f"with m={row.micro_batches}"
        )
    what = {
        0: "replicated states",
        1: "optimizer states sharded",
        2: "optimizer states + grads sharded",
        3: "all model states sharded",
    }[lay.zero_stage]
    if lay.dp * lay.cp > 1:
        over = f"dp={lay.dp}" + (f" x cp={lay.cp}" if lay.cp > 1 else "")
        parts.append(
            f"{over} ZeRO-{lay.zero_stage} ({what} /{lay.dp * lay.cp}), {format_seconds(c['dp'].seconds)} "
            f"sync on {c['dp'].link}, {format_seconds(row.exposed_dp_s)} exposed"
        )
        if lay.compressed:
            parts.append(
                f"ZeRO++ ({_zeropp_words(lay)}): {format_bytes(c['dp'].bytes)} sent, "
                f"{format_bytes(c['dp'].cross_node_bytes)} from other nodes per step, "
                f"+{format_bytes(row.memory.zeropp)} per GPU"
            )
    elif lay.zero_stage:
        parts.append(f"dp=1: ZeRO-{lay.zero_stage} used only for its CPU offload")
    else:
        parts.append("dp=1: no data-parallel traffic")
    if req.model.num_experts:
        mem = row.memory
        a2a = (
            f", {format_bytes(c['ep'].bytes)} of all-to-all ({format_seconds(c['ep'].seconds)} on {c['ep'].link})"
            if lay.ep > 1
            else ", no all-to-all"
        )
        parts.append(
            f"ep={lay.ep} (edp={lay.dp * lay.cp // lay.ep}): {req.model.num_experts // lay.ep} experts per GPU, model "
            f"states {format_bytes(mem.experts)} experts + {format_bytes(mem.dense)} dense{a2a}"
        )
    if lay.offload != "none":
        parts.append(f"{lay.offload} offloaded to CPU: +{format_seconds(c['offload'].seconds)} PCIe + CPU Adam")
    ckpt = {
        "none": "no recompute",
        "selective": "selective recompute (attention scores)",
        "full": "full recompute (+1 forward)",
    }[lay.activation_checkpointing]
    parts.append(f"{ckpt}: activations {row.memory.activations / 1e9:.1f} GB")
    if lay.cp > 1 or lay.tiled:
        cp_s = f", {format_seconds(c['cp'].seconds)} of cp traffic on {c['cp'].link}" if lay.cp > 1 else ""
        parts.append(cp_words(lay) + cp_s)
    return "; ".join(parts)


def model_flops_utilisation(row: PlanRow, req: PlanRequest) -> float:
    """Model FLOPs (6N + 12Lhs per token, no recompute) per second over the cluster's peak."""
    per_token = _hardware_flops_per_token(req.model, "none")
    return per_token * row.tokens_per_s / (row.layout.world_size * req.hardware.peak_flops)
