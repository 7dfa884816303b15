"""Readable tables and JSON for the planner and the Chinchilla calculator."""

from __future__ import annotations

import json
from typing import Any

from .chinchilla import ChinchillaResult
from .estimate import model_flops_utilisation, zero_label
from .moe import stage_table
from .planner import PlanResult
from .units import format_bytes, format_count, format_seconds


def plan_header(result: PlanResult) -> str:
    req = result.request
    spec, hw = req.model, req.hardware
    moe = (
        f", {format_count(spec.active_params())} active: {spec.num_experts} experts top-{spec.top_k} in "
        f"{spec.moe_layers} layers"
        if spec.num_experts
        else ""
    )
    return (
        f"{spec.name} ({format_count(spec.num_params())} params{moe}, {spec.n_layers} layers, hidden {spec.hidden}, "
        f"{spec.n_heads} heads) on {req.gpus} x {hw.name} ({format_bytes(hw.mem_bytes)}, "
        f"{req.gpus_per_node} per node)\n"
        f"seq {spec.seq_len}, micro-batch {req.micro_batch}, global batch {req.batch} "
        f"({format_count(req.batch * spec.seq_len)} tokens), {req.precision}, mfu {req.mfu:g}, "
        f"reserve {format_bytes(req.reserve_bytes)} per GPU"
    )


def plan_table(result: PlanResult, *, top: int = 10, explain: bool = True) -> str:
    lines = [plan_header(result), ""]
    if not result.ranked:
        lines.append(result.message)
        return "\n".join(lines)
    if result.message:
        lines += [result.message, ""]
    long = any(r.layout.cp > 1 or r.layout.tiled for r in result.ranked[:top])
    moe = bool(result.request.model.num_experts)
    cp_head = f" {'cp':>8}" if long else ""
    cp_head += f" {'ep':>3}" if moe else ""
    head = (
        f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>4}{cp_head} {'ZeRO':>4} {'offload':<16} {'recompute':<9} "
        f"{'GB/GPU':>7} {'step':>9} {'tokens/s':>9} {'MFU':>5} {'bubble':>6}"
    )
    lines += [head, "-" * len(head)]
    for i, row in enumerate(result.ranked[:top], 1):
        lay = row.layout
        cp = f" {_cp_cell(lay):>8}" if long else ""
        cp += f" {lay.ep:>3}" if moe else ""
        lines.append(
            f"{i:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>4}{cp} {zero_label(lay):>4} {lay.offload:<16} "
            f"{lay.activation_checkpointing:<9} {row.memory.total / 1e9:>7.1f} {format_seconds(row.step_s):>9} "
            f"{format_count(row.tokens_per_s):>9} {model_flops_utilisation(row, result.request):>5.0%} "
            f"{row.bubble:>6.0%}"
        )
        if explain:
            lines.append(f"      {row.explanation}")
    rest = len(result.ranked) - top
    if rest > 0:
        lines.append(f"... {rest} more layouts fit (--top N to show them)")
    if result.rejected:
        lines.append("rejected: " + ", ".join(f"{n} {why}" for why, n in sorted(result.rejected.items())))
    if moe:
        lines += ["", *moe_lines(result)]
    return "\n".join(lines)


def moe_summary(result: PlanResult) -> dict[str, Any]:
    """The MoE figures of the first-ranked layout: its (suggested or requested) ep, the all-to-all bytes one rank
    sends per step, and the dense / expert model states per GPU at each ZeRO stage (``moe.stage_table``)."""
    req, row = result.request, result.ranked[0]
    lay, spec = row.layout, req.model
    return {
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "moe_layers": spec.moe_layers,
        "expert_params": spec.expert_params(),
        "active_params": spec.active_params(),
        "ep": lay.ep,
        "ep_requested": req.ep is not None,
        "edp": lay.dp * lay.cp // lay.ep,
        "alltoall_bytes_per_step": row.comm["ep"].bytes,
        "alltoall_link": row.comm["ep"].link,
        "zero_stages": stage_table(req, lay),
    }


def moe_lines(result: PlanResult) -> list[str]:
    m = moe_summary(result)
    lay = result.ranked[0].layout
    how = "requested" if m["ep_requested"] else "suggested: the smallest within a node dividing the experts and dp x cp"
    lines = [
        f"experts at layout #1 ({m['num_experts']} experts, ep={m['ep']} [{how}], edp={m['edp']}): "
        f"{m['num_experts'] // m['ep']} experts per GPU, all-to-all {format_bytes(m['alltoall_bytes_per_step'])} "
        f"sent per GPU per step ({m['alltoall_link']})",
        f"model states per GPU by ZeRO stage (tp={lay.tp} pp={lay.pp} dp={lay.dp}, no offload):",
        f"  {'ZeRO':>4} {'dense':>10} {'experts':>10} {'GPU total':>10}",
    ]
    for r in m["zero_stages"]:
        lines.append(
            f"  {r['zero_stage']:>4} {format_bytes(r['dense']):>10} {format_bytes(r['experts']):>10} "
            f"{format_bytes(r['total']):>10}"
        )
    return lines


def _cp_cell(lay: Any) -> str:
    """``4 ring``, ``2 uly``, ``4 hyb``, with ``+T`` for the tiled loss / MLP."""
    mode = {"ulysses": "uly", "ring": "ring", "hybrid": "hyb"}[lay.cp_mode] if lay.cp > 1 else ""
    return f"{lay.cp}{' ' + mode if mode else ''}{'+T' if lay.tiled else ''}"


def plan_json(result: PlanResult, *, top: int | None = None) -> str:
    req = result.request
    rows = result.ranked if top is None else result.ranked[:top]
    doc: dict[str, Any] = {
        "model": {**req.model.to_dict(), "params": req.model.num_params(), "active_params": req.model.active_params()},
        "hardware": {k: getattr(req.hardware, k) for k in req.hardware.__dataclass_fields__},
        "gpus": req.gpus,
        "gpus_per_node": req.gpus_per_node,
        "micro_batch": req.micro_batch,
        "global_batch": req.batch,
        "precision": req.precision,
        "mfu": req.mfu,
        "reserve_bytes": req.reserve_bytes,
        "fits": bool(result.ranked),
        "layouts": [r.to_dict() for r in rows],
        "rejected": result.rejected,
        "smallest_cluster": result.smallest_cluster,
        "message": result.message,
    }
    if req.model.num_experts and result.ranked:
        doc["moe"] = moe_summary(result)
    return json.dumps(doc, indent=2)


def chinchilla_table(res: ChinchillaResult, extra: dict[str, Any]) -> str:
    how = "compute-optimal: N = sqrt(C / (6 r)), D = r N" if res.compute_optimal else "from C = 6 N D"
    lines = [
        f"compute C       {res.compute:.3e} FLOPs",
        f"params N        {format_count(res.params)} ({res.params:.3e})",
        f"tokens D        {format_count(res.tokens)} ({res.tokens:.3e})",
        f"tokens/param    {res.tokens_per_param:.3g}   [{how}]",
    ]
    if "flops_per_token" in extra:
        lines.append(f"FLOPs/token     {extra['flops_per_token']:.3e}   [6N + 12 L h s, {extra['flops_model']}]")
        lines.append(f"C with attention {extra['compute_with_attention']:.3e} FLOPs")
    if "seconds" in extra:
        lines.append(
            f"time to train   {format_seconds(extra['seconds'])} on {extra['gpus']} x "
            f"{extra['peak_flops'] / 1e12:g} TFLOP/s at MFU {extra['mfu']:g} "
            f"({extra['gpu_hours']:.3g} GPU-hours)"
        )
    return "\n".join(lines)
