"""Layout planner: enumerate (tp, pp, dp, ZeRO stage, offload, activation checkpointing), keep the layouts whose
per-rank memory fits, rank them by estimated step time.

Step time of one rank (m micro-batches, p pipeline stages, world W, T tokens per step):

    compute   = F_hw T / (W peak mfu),  F_hw = 6N + 12Lhs per token (+2N + 4Lhs full recompute, +4Lhs selective)
    pipeline  = (compute + tp + pp) (m + p - 1) / m          the 1F1B bubble (p-1)/(m+p-1) of the step
    dp        = exposed part of the ZeRO traffic: what does not hide behind the backward pass (2/3 of compute;
                ZeRO-3 prefetching hides behind forward and backward)
    step      = pipeline + max(0, dp - overlap) + offload (PCIe + CPU Adam, not overlapped)

With ``PlanRequest.zeropp`` each ZeRO-2/3 layout whose dp ranks span whole nodes is also tried in its ZeRO++ form
(stage 3: qwZ int8 + hpZ over a node's dp ranks + qgZ int4; stage 2: qgZ), shown as ZeRO "3++" / "2++": its dp
seconds charge the cross-node bytes at the network's speed and the rest at NVLink's (``comm.py``), its memory adds
hpZ's secondary shard (``memory.py``).

Long context (``context.py``): with ``PlanRequest.context_parallel`` "on", or "auto" when no other layout fits,
the layouts with cp context-parallel ranks (ulysses when tp cp divides the heads, ring, hybrid) and the sequence-tiled
loss and MLP (cp = 1 included) are tried too, at pp=1: the sequence / cp per rank, ZeRO over dp x cp, the tp and dp
traffic of s / cp tokens, plus the exposed cp traffic (Ulysses' all-to-alls; the ring's excess over attention).

Constraints: tp divides the GPUs of a node and the (query and KV) heads, pp divides the layers, tp pp dp = GPUs,
the global batch is a multiple of dp x micro-batch, GPU bytes <= gpu memory - reserve, offloaded bytes of a
node's ranks <= host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .chinchilla import flops_per_token
from .comm import AxisComm, estimate_comm
from .context import cp_words
from .cp_plan import context_layouts, cp_comm
from .memory import CHECKPOINT_MODES, PRECISION_BYTES, Layout, MemoryEstimate, estimate_memory
from .model_spec import ModelSpec
from .presets import Hardware
from .units import format_bytes, format_seconds
from .zeropp import dp_nodes

DEFAULT_BATCH_TOKENS = 2**22  # ~4M tokens per step when no global batch is given (Llama's batch)
MAX_SEARCH_GPUS = 65536


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


@dataclass(kw_only=True)
class PlanResult:
    request: PlanRequest
    ranked: list[PlanRow]  # fitting layouts, fastest first
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    smallest_cluster: int | None = None  # when nothing fits: fewest GPUs of this type that fit
    smallest_layout: PlanRow | None = None
    message: str = ""


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _zero_offload_choices(dp: int, allow_offload: bool) -> list[tuple[int, str]]:
    """ZeRO stage and offload pairs worth trying. With dp = 1 the stages shard nothing, so only stage 0 and
    (single-GPU ZeRO-Offload) stage 2 + optimizer offload / stage 3 + parameter offload remain."""
    pairs = [(0, "none")] + ([(1, "none"), (2, "none"), (3, "none")] if dp > 1 else [])
    if allow_offload:
        pairs += [(2, "optimizer"), (3, "optimizer+params")] + ([(1, "optimizer"), (3, "optimizer")] if dp > 1 else [])
    return pairs


def enumerate_layouts(req: PlanRequest, *, gpus: int | None = None, context: bool = False) -> list[Layout]:
    """Every layout with tp | gpus per node, tp | heads and KV heads, pp | layers, tp pp dp = gpus; with
    ``context``, the context-parallel and tiled layouts instead (``_context_layouts``)."""
    gpus = req.gpus if gpus is None else gpus
    spec, gpn = req.model, min(req.hardware.gpus_per_node, gpus)
    out: list[Layout] = []
    for tp in _divisors(gpn):
        if gpus % tp or spec.n_heads % tp or spec.n_kv_heads % tp:  # type: ignore[operator]
            continue
        if context:
            out += context_layouts(req, gpus, tp, _zero_offload_choices)
            continue
        for pp in _divisors(spec.n_layers):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for stage, offload in _zero_offload_choices(dp, req.allow_offload):
                for ckpt in CHECKPOINT_MODES:
                    lay = Layout(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        zero_stage=stage,
                        offload=offload,
                        sequence_parallel=req.sequence_parallel and tp > 1,
                        activation_checkpointing=ckpt,
                    )
                    out.append(lay)
                    packed = _zeropp_variant(lay, req.hardware.gpus_per_node) if req.zeropp else None
                    if packed is not None:
                        out.append(packed)
    return out


def _zeropp_variant(lay: Layout, gpus_per_node: int) -> Layout | None:
    """The ZeRO++ form of a ZeRO-2/3 layout whose dp ranks span whole nodes: stage 3 with qwZ + hpZ (k = the dp ranks
    of a node) + qgZ, stage 2 with qgZ; None where it does not apply."""
    if lay.zero_stage < 2 or lay.dp == 1 or lay.offload == "optimizer+params":
        return None
    per_node, even = dp_nodes(tp=lay.tp, dp=lay.dp, pp=lay.pp, gpus_per_node=gpus_per_node)
    if per_node == lay.dp or not even:
        return None
    if lay.zero_stage == 2:
        return replace(lay, zero_quantized_gradients=True)
    return replace(
        lay,
        zero_quantized_weights=True,
        zero_hpz_partition_size=per_node if per_node > 1 else 1,
        zero_quantized_gradients=True,
    )


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
    pipelined = (compute + comm["tp"].seconds + comm["pp"].seconds + exposed_cp) * (m + p - 1) / m
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


def _fits_somewhere(req: PlanRequest, gpus: int) -> PlanRow | None:
    """A fitting layout on ``gpus`` GPUs looking only at memory (most memory-frugal choices, pp micro-batches in
    flight), or None."""
    sub = replace(req, gpus=gpus, global_batch=None)
    for layout in enumerate_layouts(sub):
        if layout.activation_checkpointing != "full" or (layout.dp > 1 and layout.zero_stage != 3):
            continue
        row = evaluate(sub, layout)
        if row.fits:
            return row
    return None


def smallest_cluster(req: PlanRequest, *, limit: int = MAX_SEARCH_GPUS) -> tuple[int, PlanRow] | None:
    """Fewest GPUs of the request's type that hold the model in some layout: 1..gpus-per-node, then whole nodes."""
    gpn = req.hardware.gpus_per_node
    # floor: whatever dp does, activations and ZeRO-3's gathered layers stay on the GPU
    spec, usable = req.model, req.hardware.mem_bytes - req.reserve_bytes
    floor = min(
        estimate_memory(
            spec,
            Layout(
                tp=tp,
                pp=pp,
                dp=2**30,
                zero_stage=3,
                offload="optimizer+params",
                sequence_parallel=req.sequence_parallel and tp > 1,
                activation_checkpointing="full",
            ),
            precision=req.precision,
            micro_batch=req.micro_batch,
            bucket_bytes=req.bucket_bytes,
        ).total
        for tp in _divisors(gpn)
        if spec.n_heads % tp == 0 and spec.n_kv_heads % tp == 0  # type: ignore[operator]
        for pp in _divisors(spec.n_layers)
    )
    if floor > usable:
        return None
    candidates = list(range(1, gpn + 1)) + list(range(2 * gpn, limit + 1, gpn))
    for gpus in candidates:
        row = _fits_somewhere(req, gpus)
        if row is not None:
            return gpus, row
    return None


def _short(lay: Layout) -> str:
    cp = (f" cp={lay.cp} ({lay.cp_mode})" if lay.cp > 1 else "") + (" tiled" if lay.tiled else "")
    return (
        f"tp={lay.tp} pp={lay.pp} dp={lay.dp}{cp} ZeRO-{zero_label(lay)} offload={lay.offload} "
        f"recompute={lay.activation_checkpointing}"
    )


def _reject_kind(why: str) -> str:
    if why.startswith("global batch"):
        return "global batch not divisible"
    return "exceeds host memory" if why.startswith("offload") else "exceeds GPU memory"


def model_flops_utilisation(row: PlanRow, req: PlanRequest) -> float:
    """Model FLOPs (6N + 12Lhs per token, no recompute) per second over the cluster's peak."""
    per_token = _hardware_flops_per_token(req.model, "none")
    return per_token * row.tokens_per_s / (row.layout.world_size * req.hardware.peak_flops)


def plan(req: PlanRequest) -> PlanResult:
    """Rank the fitting layouts by step time (ties: less memory first); when none fits, find the smallest cluster."""
    rows = [evaluate(req, layout) for layout in enumerate_layouts(req)]
    note = ""
    if req.context_parallel == "on" or (req.context_parallel == "auto" and not any(r.fits for r in rows)):
        long_rows = [evaluate(req, layout) for layout in enumerate_layouts(req, context=True)]
        if req.context_parallel == "auto" and any(r.fits for r in long_rows):
            rows = long_rows  # the recommendation: what fits only with context parallelism / tiling
            note = (
                f"no layout without context parallelism or the tiled loss / MLP fits seq {req.model.seq_len}; these do"
            )
        else:
            rows += long_rows
    ranked = sorted((r for r in rows if r.fits), key=lambda r: (r.step_s, r.memory.total))
    rejected: dict[str, int] = {}
    for r in rows:
        if not r.fits:
            rejected[_reject_kind(r.why_not)] = rejected.get(_reject_kind(r.why_not), 0) + 1
    result = PlanResult(request=req, ranked=ranked, rejected=rejected, message=note if ranked else "")
    if not ranked:
        gb = req.hardware.mem_bytes / 1e9
        name = req.model.name
        if not rows:
            result.message = (
                f"no layout of {req.gpus} GPUs exists for {name}: tp must divide "
                f"{req.gpus_per_node} GPUs per node and {req.model.n_heads} heads, pp must divide "
                f"{req.model.n_layers} layers, tp x pp must divide {req.gpus}"
            )
        else:
            best = min(rows, key=lambda r: r.memory.total)
            result.message = (
                f"{name} ({req.model.num_params() / 1e9:.2f}B params) fits no layout on {req.gpus} x "
                f"{gb:.0f} GB GPUs; the most frugal ({_short(best.layout)}) {best.why_not}"
            )
        usable = req.hardware.mem_bytes - req.reserve_bytes
        if any(r.why_not.startswith("global batch") and r.memory.total <= usable for r in rows):
            result.message = (
                f"{name}: no layout of {req.gpus} GPUs divides the global batch {req.batch} into "
                f"dp x micro-batch {req.micro_batch}; choose a global batch that is a multiple of "
                f"dp x micro-batch"
            )
            return result
        found = smallest_cluster(req)
        if found is None:
            result.message += f". No cluster of up to {MAX_SEARCH_GPUS} such GPUs fits it."
        else:
            result.smallest_cluster, result.smallest_layout = found
            result.message += (
                f". Smallest cluster of {gb:.0f} GB GPUs that fits: {found[0]} GPUs "
                f"({_short(found[1].layout)}, {found[1].memory.total / 1e9:.1f} GB per GPU)."
            )
            if found[0] < req.gpus:
                result.message += (
                    f" {req.gpus} GPUs fail on divisibility (tp | GPUs per node and heads, "
                    f"pp | layers, tp x pp | GPUs), not on size."
                )
    return result
