"""DeepSpeed 0.19's AutoEP block, ``"expert_parallel"``, as llmpar reads it (re-exported by ``blocks.py``).

    "expert_parallel": {"enabled": true, "autoep_size": 2, "preset_model": "qwen3_moe", "top_k": "auto",
                        "score_func": "auto", "route_norm": null, "routed_scaling_factor": "auto"}

``autoep_size`` is the ``ep`` degree of ``ParallelDims``: it folds over the data-parallel (x cp) ranks, and
``llmpar.initialize`` spreads the model's ``llmpar.moe.MoEBlock`` layers over the ``ep`` group it builds (a layer
built with ``ep_group=None`` gets it through ``MoEBlock.set_ep_group``), and ZeRO reduces and shards their experts over
the expert-data-parallel group. The routing keys (``preset_model`` and its overrides) resolve to a
``llmpar.moe.RouterConfig`` (:meth:`ExpertParallelConfig.router_config`) for layers built from the config, as
DeepSpeed resolves them from its presets: a key left at ``"auto"`` / null takes the preset's value. The patterns
and attribute names (``moe_layer_pattern``, ``expert_w1``, ...) locate the MoE layers of a model being swapped and are
kept as given (``overrides``). ``use_grouped_mm`` (default true) and ``disable_triton_grouped_mm`` (default false)
choose the grouped GEMM backends of every ``llmpar.moe.Experts`` at ``initialize`` (:func:`apply_grouped_mm_impl`):
false -> the per-expert loop; true with Triton disabled -> ``torch._grouped_mm`` where it is fused, else the loop; true
-> any (``llmpar.ops.grouped_gemm_backends``: ``torch._grouped_mm``, the Triton kernel, the loop), the same math.
DeepSpeed's other implementation switches (combine kernels, DeepEP tuning) are accepted and change nothing
(``ds_keys.EXPERT_PARALLEL``); what would change the math llmpar does not support is an error:
``expert_tensor_parallel_size`` > 1 (layers built with ``MoEBlock(etp_group=...)`` are trained: ``experts.py``),
``comm_backend`` "deepep", a non-null ``load_balance_coeff`` (DeepSpeed refuses it
too).

llmpar's own key ``add_aux_loss`` (default true): ``engine.backward(loss)`` adds the auxiliary losses of the MoE
layers' last training forward through the engine (each already weighted by its router's ``aux_loss_coeff``,
``seq_aux_loss_coeff``, ``z_loss_coeff``: Megatron's ``--moe-aux-loss-coeff`` way); false: the loss passed to
``backward`` is taken as is (DeepSpeed's legacy way, where the script adds ``l_aux`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmpar.validation import as_bool, as_int, check_keys

# DeepSpeed's presets: (score_func, route_norm, group-limited routing's group score)
PRESETS: dict[str, tuple[str, bool, str]] = {
    "mixtral": ("softmax", True, "top2_sum"),
    "qwen3_moe": ("softmax", True, "top2_sum"),
    "qwen3_5_moe": ("softmax", True, "top2_sum"),
    "deepseek_v2": ("softmax", False, "max"),
    "deepseek_v3": ("sigmoid", False, "top2_sum"),
    "minimax_m3": ("sigmoid", True, "top2_sum"),
}
# keys naming the layers of a model to swap: kept as given
_LOCATORS = (
    "moe_layer_pattern",
    "expert_pattern",
    "router_pattern",
    "expert_w1",
    "expert_w2",
    "expert_w3",
    "num_experts_attr",
    "top_k_attr",
    "has_shared_experts",
    "shared_experts_pattern",
    "shared_experts_gate_pattern",
    "expert_activation",
)
_KEYS = (
    "enabled",
    "autoep_size",
    "preset_model",
    "top_k",
    "score_func",
    "route_norm",
    "route_scale",
    "routed_scaling_factor",
    "num_expert_groups",
    "num_limited_groups",
    "load_balance_coeff",
    "expert_tensor_parallel_size",
    "comm_backend",
    "add_aux_loss",
    "use_grouped_mm",
    "disable_triton_grouped_mm",
    *_LOCATORS,
)


@dataclass(kw_only=True)
class ExpertParallelConfig:
    """``"expert_parallel"`` (DeepSpeed's AutoEP block; module docstring). ``autoep_size``: the expert-parallel
    degree (dividing dp x cp); ``top_k`` / ``score_func`` / ``route_norm`` / ``routed_scaling_factor`` /
    ``num_expert_groups`` / ``num_limited_groups``: routing overrides ("auto" / null: the preset's or the model's);
    ``route_scale``: DeepSpeed's multiplier of the routing weights (folded into the scaling factor)."""

    enabled: bool = False  # false: autoep_size is ignored (MoE layers keep the groups they were built with)
    autoep_size: int = 1  # the ep degree of ParallelDims, dividing dp x cp
    preset_model: str | None = None  # the routing defaults of a model family (below)
    top_k: int | str = "auto"  # experts per token ("auto": the model's)
    score_func: str = "auto"  # "softmax" or "sigmoid" ("auto": the preset's)
    route_norm: bool | None = None  # renormalise the top-k weights to sum 1 (null: the preset's)
    route_scale: float = 1.0  # multiplies the routing weights
    routed_scaling_factor: float | str = "auto"  # DeepSeek's factor on the routed output ("auto": the model's)
    num_expert_groups: int | None = None  # group-limited routing: groups of experts (n_group)
    num_limited_groups: int | None = None  # groups a token may use (topk_group)
    load_balance_coeff: None = None  # must be null, as DeepSpeed 0.19 requires
    expert_tensor_parallel_size: int = 1  # experts split over tp: not supported (1)
    comm_backend: str = "comm"  # "deepep": not supported
    add_aux_loss: bool = True  # llmpar: engine.backward adds the MoE layers' aux losses
    use_grouped_mm: bool = True  # false: the experts run as a per-expert loop of GEMMs
    disable_triton_grouped_mm: bool = False  # true: never the Triton grouped GEMM (torch._grouped_mm or the loop)
    overrides: dict = field(default_factory=dict)  # the layer-locating keys as given (moe_layer_pattern, ...)

    @property
    def grouped_mm_impl(self) -> str:
        """The experts' grouped GEMM backends (``llmpar.ops.grouped_gemm_backends.IMPLS``): "loop" without
        ``use_grouped_mm``, "native" with ``disable_triton_grouped_mm``, else "auto"."""
        if not self.use_grouped_mm:
            return "loop"
        return "native" if self.disable_triton_grouped_mm else "auto"

    @property
    def ep(self) -> int:
        """The expert-parallel degree the block asks for (1 when disabled)."""
        return self.autoep_size if self.enabled else 1

    def router_config(self, base: Any = None) -> Any:
        """The :class:`llmpar.moe.RouterConfig` of this block: ``base`` (default: the preset's, else RouterConfig's
        defaults) with the keys given here."""
        import dataclasses

        from llmpar.moe.router import RouterConfig

        cfg = base if base is not None else RouterConfig()
        changes: dict[str, Any] = {}
        if self.preset_model is not None and base is None:
            score, norm, group_score = PRESETS[self.preset_model]
            changes.update(score_func=score, route_norm=norm, group_score=group_score)
        if self.score_func != "auto":
            changes["score_func"] = self.score_func
        if self.route_norm is not None:
            changes["route_norm"] = self.route_norm
        scale = cfg.routed_scaling_factor if self.routed_scaling_factor == "auto" else self.routed_scaling_factor
        if scale != cfg.routed_scaling_factor or self.route_scale != 1.0:
            changes["routed_scaling_factor"] = float(scale) * self.route_scale
        if self.num_expert_groups is not None:
            changes["n_group"] = self.num_expert_groups
        if self.num_limited_groups is not None:
            changes["topk_group"] = self.num_limited_groups
        return dataclasses.replace(cfg, **changes)


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f'"expert_parallel.{name}"={value!r} must be a positive finite number')
    return float(value)


def expert_parallel_block(block: Any) -> ExpertParallelConfig:
    """``"expert_parallel"`` -> :class:`ExpertParallelConfig` (DeepSpeed's inert switches already stripped)."""
    if block is None:
        block = {}
    check_keys("expert_parallel", block, list(_KEYS))
    b = dict(block)
    where = "expert_parallel."
    preset = b.get("preset_model")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f'"expert_parallel.preset_model"={preset!r} is not one of {", ".join(PRESETS)}')
    top_k = b.get("top_k", "auto")
    if top_k != "auto":
        top_k = as_int(where + "top_k", top_k, minimum=1)
    score = b.get("score_func", "auto")
    if score not in ("auto", "softmax", "sigmoid"):
        raise ValueError(f'"expert_parallel.score_func"={score!r} is not one of auto, softmax, sigmoid')
    norm = b.get("route_norm")
    rsf = b.get("routed_scaling_factor", "auto")
    if rsf != "auto":
        rsf = _positive_number("routed_scaling_factor", rsf)
    groups = {k: b.get(k) for k in ("num_expert_groups", "num_limited_groups")}
    for k, v in groups.items():
        if v is not None:
            groups[k] = as_int(where + k, v, minimum=1)
    if b.get("load_balance_coeff") is not None:
        raise ValueError(
            f'"expert_parallel.load_balance_coeff"={b["load_balance_coeff"]!r}: not supported (DeepSpeed 0.19 refuses '
            "it too): give null; for aux-loss-free balancing build the layers with RouterConfig(expert_bias=True), "
            "for an auxiliary loss RouterConfig(aux_loss_coeff=...)"
        )
    etp = as_int(where + "expert_tensor_parallel_size", b.get("expert_tensor_parallel_size", 1), minimum=1)
    if etp != 1:
        raise ValueError(
            f'"expert_parallel.expert_tensor_parallel_size"={etp}: not supported by the engine (DeepSpeed 0.19 '
            "refuses it too): the swapped / spread layers keep their experts whole (accepted: 1); to split them, "
            "build the layers with llmpar.moe.MoEBlock(etp_group=...) over the tensor-parallel ranks (groups from "
            "llmpar.moe.expert_parallel_groups) and pass mesh=llmpar.init_distributed(tp=etp).mesh: llmpar.initialize "
            "trains those"
        )
    comm = b.get("comm_backend", "comm")
    if comm != "comm":
        raise ValueError(
            f'"expert_parallel.comm_backend"={comm!r}: not supported: tokens travel by all_to_all_single '
            '(accepted: "comm")'
        )
    return ExpertParallelConfig(
        enabled=as_bool(where + "enabled", b.get("enabled", False)),
        autoep_size=as_int(where + "autoep_size", b.get("autoep_size", 1), minimum=1),
        preset_model=preset,
        top_k=top_k,
        score_func=score,
        route_norm=None if norm is None else as_bool(where + "route_norm", norm),
        route_scale=_positive_number("route_scale", b.get("route_scale", 1.0)),
        routed_scaling_factor=rsf,
        num_expert_groups=groups["num_expert_groups"],
        num_limited_groups=groups["num_limited_groups"],
        add_aux_loss=as_bool(where + "add_aux_loss", b.get("add_aux_loss", True)),
        use_grouped_mm=as_bool(where + "use_grouped_mm", b.get("use_grouped_mm", True)),
        disable_triton_grouped_mm=as_bool(
            where + "disable_triton_grouped_mm", b.get("disable_triton_grouped_mm", False)
        ),
        overrides={k: b[k] for k in _LOCATORS if k in b},
    )


def apply_grouped_mm_impl(model: Any, ep: ExpertParallelConfig) -> int:
    """Set ``grouped_mm_impl`` of every ``llmpar.moe.Experts`` in ``model`` (swapped or built, legacy layers' too)
    from the block; returns how many. Runs after the transformers MoE blocks are swapped."""
    from llmpar.moe.experts import Experts

    found = [m for m in model.modules() if isinstance(m, Experts)]
    for m in found:
        m.grouped_mm_impl = ep.grouped_mm_impl
    return len(found)


def refuse_ep_with_pipeline(ep: ExpertParallelConfig, pipeline: str) -> None:
    """Expert parallelism with a PipelineModule (``pipeline`` names the pipeline: a "pipeline" block, a
    PipelineModule): refused, a ValueError naming both. With a "pipeline" block the experts fold over each stage's dp
    ranks (``build_pipeline_engine``); a PipelineModule builds its own stages and is not spread yet."""
    if ep.ep > 1 and "PipelineModule" in pipeline:
        raise ValueError(
            f'"expert_parallel.autoep_size"={ep.autoep_size} with {pipeline}: expert parallelism is not supported '
            'with a PipelineModule yet; give the model as an nn.Sequential (or llmpar GPT) with a "pipeline" block'
        )


__all__ = [
    "PRESETS",
    "ExpertParallelConfig",
    "apply_grouped_mm_impl",
    "expert_parallel_block",
    "refuse_ep_with_pipeline",
]
