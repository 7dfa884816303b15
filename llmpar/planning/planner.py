"""Layout planner: enumerate (tp, pp, dp, ZeRO stage, offload, activation checkpointing), keep the layouts whose
per-rank memory fits, rank them by estimated step time (each layout's estimate: ``estimate.py``, where the step-time
model is written out).

With ``PlanRequest.zeropp`` each ZeRO-2/3 layout whose dp ranks span whole nodes is also tried in its ZeRO++ form
(stage 3: qwZ int8 + hpZ over a node's dp ranks + qgZ int4; stage 2: qgZ), shown as ZeRO "3++" / "2++".

Long context (``context.py``): with ``PlanRequest.context_parallel`` "on", or "auto" when no other layout fits,
the layouts with cp context-parallel ranks (ulysses when tp cp divides the heads, ring, hybrid) and the sequence-tiled
loss and MLP (cp = 1 included) are tried too, at pp=1.

A mixture of experts (``moe.py``) gets an ep per layout: ``PlanRequest.ep``, or the smallest within a node dividing
the experts and dp x cp whose memory fits (``moe.pick_ep``).

Constraints: tp divides the GPUs of a node and the (query and KV) heads, pp divides the layers, tp pp dp = GPUs,
the global batch is a multiple of dp x micro-batch, GPU bytes <= gpu memory - reserve, offloaded bytes of a
node's ranks <= host memory. When nothing fits, :func:`smallest_cluster` finds the fewest GPUs of the type that do.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .cp_plan import context_layouts
from .estimate import (  # noqa: F401  (the request, a row and its estimate: importable from here as before)
    DEFAULT_BATCH_TOKENS,
    PlanRequest,
    PlanRow,
    evaluate,
    explain,
    model_flops_utilisation,
    zero_label,
)
from .layout import CHECKPOINT_MODES, Layout
from .memory import estimate_memory
from .moe import ep_variants, pick_ep
from .zeropp import dp_nodes

MAX_SEARCH_GPUS = 65536


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
    ``context``, the context-parallel and tiled layouts instead (``_context_layouts``); a mixture of experts at each
    of its ep choices (``moe.ep_variants``)."""
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
    return [v for lay in out for v in ep_variants(req, lay)]


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
    ep = f" ep={lay.ep}" if lay.ep > 1 else ""
    return (
        f"tp={lay.tp} pp={lay.pp} dp={lay.dp}{cp}{ep} ZeRO-{zero_label(lay)} offload={lay.offload} "
        f"recompute={lay.activation_checkpointing}"
    )


def _reject_kind(why: str) -> str:
    if why.startswith("global batch"):
        return "global batch not divisible"
    return "exceeds host memory" if why.startswith("offload") else "exceeds GPU memory"


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
    rows = pick_ep(rows) if req.model.num_experts else rows
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
                + (f", ep={req.ep} must divide dp x cp" if req.ep else "")
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
