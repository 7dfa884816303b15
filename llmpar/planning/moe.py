"""Mixture-of-experts estimates: expert vs dense memory per rank, all-to-all bytes per step, a suggested ep.

The routed experts of ``L`` MoE layers (``E`` experts of SwiGLU width ``I`` over hidden ``H``) hold
``psi_e = L * E * 3 * H * I`` parameters; everything else (attention, embeddings, routers, shared experts, dense MLPs)
is ``psi_d``. With ``ep`` expert-parallel ranks folded over the ``dp`` data-parallel ranks (``edp = dp / ep``, as
``ParallelDims(ep=...)`` and ``llmpar.zero.experts`` lay them out), one rank holds

    dense  : model_state_bytes(psi_d,      dp=dp,  stage, precision)      ZeRO over dp
    experts: model_state_bytes(psi_e / ep, dp=edp, stage, precision)      its E / ep experts, ZeRO over edp

All-to-all per step and rank, ``T`` tokens per rank per step (micro batch x sequence x accumulation), each routed to
``k`` experts, a fraction ``(ep - 1) / ep`` of them on other ranks under even routing, activations of ``a`` bytes:

    bytes sent = L * 4 * T * k * (ep - 1) / ep * H * a        dispatch + combine, forward and backward

:func:`suggest_ep` picks the smallest ep (dividing dp and E, at most a node's ranks so the exchange stays on the
node's links) whose model states fit the budget; the largest such ep when none does.

``llmpar plan`` prices a whole ``ModelSpec`` with experts (``num_experts`` > 0) per layout (tp, pp, dp, cp; the
routed experts on the busiest stage, ``ModelSpec.stage_split``): :func:`ep_variants` gives each layout its ep choices
(the requested one, or every ep dividing the experts and dp x cp with tp x ep ranks inside a node) and
:func:`pick_ep` keeps, per layout, the smallest ep whose memory fits (the largest when none fits): the suggested ep.
:func:`stage_table` reprices a layout at each ZeRO stage, experts and dense apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .estimate import PlanRequest, PlanRow, evaluate
from .layout import Layout
from .memory import model_state_bytes


def _positive(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")
    return value


@dataclass(kw_only=True, frozen=True)
class MoESpec:
    """The MoE part of a model: ``moe_layers`` layers of ``num_experts`` routed SwiGLU experts of width
    ``expert_intermediate`` over ``hidden``, ``top_k`` per token; ``dense_params``: every other parameter."""

    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    expert_intermediate: int
    dense_params: int

    def __post_init__(self) -> None:
        for name in ("moe_layers", "num_experts", "top_k", "hidden", "expert_intermediate"):
            _positive(name, getattr(self, name))
        _positive("dense_params", self.dense_params, 0)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} is larger than num_experts={self.num_experts}")

    @property
    def expert_params(self) -> int:
        """psi_e: the routed experts' parameters (gate, up, down of each)."""
        return self.moe_layers * self.num_experts * 3 * self.hidden * self.expert_intermediate


def _check_ep(spec: MoESpec, dp: int, ep: int) -> None:
    _positive("dp", dp)
    _positive("ep", ep)
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}: the expert-parallel ranks fold over the data-parallel ones")
    if spec.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={spec.num_experts}")


def moe_memory(
    spec: MoESpec, *, dp: int, ep: int, zero_stage: int = 1, precision: str = "fp32_master"
) -> dict[str, float]:
    """Per-rank model-state bytes: ``{"dense", "experts", "total"}`` (module docstring; no offload)."""
    _check_ep(spec, dp, ep)
    dense = model_state_bytes(spec.dense_params, dp=dp, zero_stage=zero_stage, precision=precision)
    experts = model_state_bytes(spec.expert_params / ep, dp=dp // ep, zero_stage=zero_stage, precision=precision)
    d, e = sum(v for k, v in dense.items() if k != "cpu"), sum(v for k, v in experts.items() if k != "cpu")
    return {"dense": d, "experts": e, "total": d + e}


def alltoall_bytes(spec: MoESpec, *, ep: int, tokens_per_rank: int, activation_bytes: int = 2) -> float:
    """Bytes one rank sends by all-to-all per step (module docstring; 0 at ep=1)."""
    _positive("ep", ep)
    _positive("tokens_per_rank", tokens_per_rank, 0)
    _positive("activation_bytes", activation_bytes)
    away = (ep - 1) / ep
    return spec.moe_layers * 4 * tokens_per_rank * spec.top_k * away * spec.hidden * activation_bytes


def suggest_ep(
    spec: MoESpec,
    *,
    dp: int,
    budget_bytes: float,
    ranks_per_node: int,
    zero_stage: int = 1,
    precision: str = "fp32_master",
) -> int:
    """The smallest ep (a divisor of dp and num_experts, at most ``ranks_per_node``) whose model states fit
    ``budget_bytes`` per rank; the largest such ep when none fits (module docstring)."""
    _positive("ranks_per_node", ranks_per_node)
    _positive("dp", dp)
    options = [e for e in range(1, min(dp, ranks_per_node) + 1) if dp % e == 0 and spec.num_experts % e == 0]
    for ep in options:
        if moe_memory(spec, dp=dp, ep=ep, zero_stage=zero_stage, precision=precision)["total"] <= budget_bytes:
            return ep
    return options[-1]


def ep_choices(req: PlanRequest, layout: Layout) -> list[int]:
    """The ep a layout may take: the requested ``req.ep`` if it divides dp x cp; else every divisor of the experts
    and dp x cp with tp x ep <= GPUs per node (ep = 1 always); ``[1]`` for a dense model."""
    spec, ranks = req.model, layout.dp * layout.cp
    if not spec.num_experts:
        return [1]
    if req.ep is not None:
        return [req.ep] if ranks % req.ep == 0 else []
    gpn = req.hardware.gpus_per_node
    return [e for e in range(1, ranks + 1) if ranks % e == 0 and spec.num_experts % e == 0 and layout.tp * e <= gpn]


def ep_variants(req: PlanRequest, layout: Layout) -> list[Layout]:
    """``layout`` at each of its :func:`ep_choices`."""
    return [layout if e == layout.ep else replace(layout, ep=e) for e in ep_choices(req, layout)]


def pick_ep(rows: list[PlanRow]) -> list[PlanRow]:
    """Per layout (its rows at several ep), the row of the smallest ep that fits, else of the largest ep."""
    by_layout: dict[Layout, list[PlanRow]] = {}
    for row in rows:
        by_layout.setdefault(replace(row.layout, ep=1), []).append(row)
    out = []
    for group in by_layout.values():
        group.sort(key=lambda r: r.layout.ep)
        out.append(next((r for r in group if r.fits), group[-1]))
    return out


def stage_table(req: PlanRequest, layout: Layout) -> list[dict[str, Any]]:
    """``layout`` (no offload, no ZeRO++) at ZeRO stages 0-3: per stage the GPU model-state bytes of the dense
    params, of the routed experts, and the GPU total with activations and buffers."""
    plain = replace(
        layout,
        offload="none",
        zero_quantized_weights=False,
        zero_hpz_partition_size=1,
        zero_quantized_gradients=False,
        zero_quantized_gradients_error_feedback=False,
    )
    out = []
    for stage in (0, 1, 2, 3):
        mem = evaluate(req, replace(plain, zero_stage=stage)).memory
        out.append({"zero_stage": stage, "dense": mem.dense, "experts": mem.experts, "total": mem.total})
    return out


__all__ = [
    "MoESpec",
    "alltoall_bytes",
    "ep_choices",
    "ep_variants",
    "moe_memory",
    "pick_ep",
    "stage_table",
    "suggest_ep",
]
