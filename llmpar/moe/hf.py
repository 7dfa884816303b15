"""transformers' sparse MoE blocks swapped for :class:`~llmpar.moe.block.MoEBlock` holding the same weights.

    from llmpar.moe.hf import swap_moe_blocks
    model = AutoModelForCausalLM.from_pretrained(path)    # transformers' own loading (packed or per-expert files)
    swap_moe_blocks(model, ep_group=None)                 # -> how many blocks were swapped

Supported blocks (transformers >= 5; the first four with experts packed as ``gate_up_proj [E, 2I, H]`` /
``down_proj [E, H, I]`` and SiLU):

============================  ====================================================================================
``MixtralSparseMoeBlock``     softmax top-k, renormalised (``router_jitter_noise`` must be 0)
``Qwen2MoeSparseMoeBlock``    softmax top-k (renormalised when ``norm_topk_prob``), a shared expert with a sigmoid gate
``Qwen3MoeSparseMoeBlock``    softmax top-k (renormalised when ``norm_topk_prob``)
``DeepseekV3MoE``             sigmoid scores + ``e_score_correction_bias`` to pick, group-limited (``n_group`` /
                              ``topk_group``, top-2 sum), renormalised, ``routed_scaling_factor``; shared experts;
                              the bias is kept as loaded in training (no aux-loss-free update: transformers and
                              DeepSpeed's AutoEP with ``load_balance_coeff`` null leave it too)
``GptOssMLP``                 a router with a bias, softmax over the top-k logits; experts with biases, transposed,
                              gate / up interleaved, a clamped SwiGLU (:mod:`llmpar.moe.hf_gpt_oss`); the block
                              returns ``(output, None)`` where transformers' returns ``(output, router scores)``
============================  ====================================================================================

Weights. With ``ep_group=None`` (or one rank) the swapped block holds transformers' Parameter objects themselves
(router weight, packed experts, shared experts; DeepSeek's bias buffer): nothing is copied, and an optimizer built
before the swap still steps them. With ep ranks, rank r keeps a copy of its slice ``[r E/ep, (r+1) E/ep)`` of the
packed experts (the full tensors are then freed with the old block) and shares the rest. The swapped block's
``state_dict`` uses transformers' names (``gate.weight``, ``experts.gate_up_proj``, ``shared_expert.*``,
``shared_expert_gate.weight``, ``gate.e_score_correction_bias``) and ``load_state_dict`` accepts them, so
``save_pretrained`` / ``from_pretrained`` of the model keep transformers' layout (at ep > 1 the experts saved are this
rank's slice: gather them first). The model's recorded ``router_logits`` (``output_router_logits=True``, its
load-balancing loss) are the swapped blocks' router logits (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from llmpar.moe.block import MoEBlock
from llmpar.moe.experts import _tag_expert
from llmpar.moe.hf_gpt_oss import gpt_oss_parts
from llmpar.moe.router import RouterConfig


@dataclass
class _Spec:
    """What a transformers block is, in MoEBlock's terms, and which of its tensors are which of ours."""

    num_experts: int
    top_k: int
    intermediate: int
    router: RouterConfig
    shared_intermediate: int = 0
    shared_gate: bool = False
    names: dict[str, str] = field(default_factory=dict)  # our name -> transformers' name (inside the block)
    hf_router: str = "gate"  # the block's router module
    parts: Callable[..., tuple[nn.Module, nn.Module]] | None = None  # (router, experts) replacing MoEBlock's own
    returns_scores: bool = False  # the block returns (output, router scores)


def _check_silu(block: Any) -> None:
    act = getattr(getattr(block.experts, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{type(block).__name__}: experts with hidden_act={act!r} are not swapped (SiLU only)")


def _packed(block: Any) -> tuple[int, int]:
    e, two_i, _ = block.experts.gate_up_proj.shape
    if getattr(block.experts, "is_transposed", False) or not getattr(block.experts, "is_concatenated", True):
        raise ValueError(f"{type(block).__name__}: experts not in the [E, 2I, H] concatenated layout")
    return e, two_i // 2


_EXPERT_NAMES = {
    "router.weight": "gate.weight",
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
}


def _shared_names(hf: str) -> dict[str, str]:
    return {f"shared_experts.{p}.weight": f"{hf}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}


def _mixtral(block: Any) -> _Spec:
    if getattr(block, "jitter_noise", 0.0):
        raise ValueError(
            f"MixtralSparseMoeBlock with router_jitter_noise={block.jitter_noise} is not swapped (MoEBlock's router "
            "has no jitter): set config.router_jitter_noise=0"
        )
    e, i = _packed(block)
    return _Spec(e, block.gate.top_k, i, RouterConfig(route_norm=True), names=dict(_EXPERT_NAMES))


def _qwen(block: Any) -> _Spec:
    e, i = _packed(block)
    spec = _Spec(e, block.gate.top_k, i, RouterConfig(route_norm=bool(block.gate.norm_topk_prob)))
    spec.names = dict(_EXPERT_NAMES)
    if hasattr(block, "shared_expert"):  # Qwen2-MoE
        spec.shared_intermediate, spec.shared_gate = block.shared_expert.gate_proj.weight.shape[0], True
        spec.names |= _shared_names("shared_expert") | {"shared_experts.gate.weight": "shared_expert_gate.weight"}
    return spec


def _deepseek_v3(block: Any) -> _Spec:
    e, i = _packed(block)
    gate = block.gate
    router = RouterConfig(
        score_func="sigmoid",
        route_norm=bool(gate.norm_topk_prob),
        routed_scaling_factor=float(gate.routed_scaling_factor),
        n_group=int(gate.num_group),
        topk_group=int(gate.topk_group),
        expert_bias=True,
        bias_update_rate=0.0,  # picks with the loaded bias and leaves it, as transformers and DeepSpeed's AutoEP do
    )
    spec = _Spec(e, gate.top_k, i, router, shared_intermediate=block.shared_experts.gate_proj.weight.shape[0])
    spec.names = dict(_EXPERT_NAMES) | _shared_names("shared_experts")
    spec.names["router.expert_bias"] = "gate.e_score_correction_bias"
    return spec


def _gpt_oss(block: Any) -> _Spec:
    e = block.router.weight.shape[0]
    return _Spec(
        e,
        block.router.top_k,
        block.experts.down_proj.shape[1],
        RouterConfig(),
        hf_router="router",
        parts=gpt_oss_parts,
        returns_scores=True,
    )


SPECS: dict[str, Callable[[Any], _Spec]] = {
    "MixtralSparseMoeBlock": _mixtral,
    "Qwen2MoeSparseMoeBlock": _qwen,
    "Qwen3MoeSparseMoeBlock": _qwen,
    "DeepseekV3MoE": _deepseek_v3,
    "GptOssMLP": _gpt_oss,
}


class HFMoEBlock(MoEBlock):
    """A :class:`MoEBlock` standing where a transformers block stood: its state dict speaks transformers' names
    (``hf_names``: ours -> theirs, inside the block). ``router.router_record`` (set by :func:`swap_block`: a child of
    the router holding no tensor) is called with each forward's ``(logits, weights, indices)`` as transformers'
    router returns them, so the model's recorded ``router_logits`` (``output_router_logits=True``: its
    load-balancing loss) come from the swapped block."""

    hf_names: dict[str, str]

    def __init__(self, *args: Any, hf_names: dict[str, str], hf_class: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hf_names, self.hf_class = dict(hf_names), hf_class
        self._register_state_dict_hook(_to_hf_names)
        self._register_load_state_dict_pre_hook(_from_hf_names, with_module=True)
        self.router.register_forward_hook(_record_routing)

    returns_scores = False  # gpt-oss's block returns (output, router scores): (output, None) here

    def set_ep_group(self, ep_group: Any) -> None:
        """:meth:`MoEBlock.set_ep_group`, and this rank's slice of expert tensors beyond the packed pair (gpt-oss's
        ``gate_up_proj_bias`` / ``down_proj_bias``)."""
        extra = {n: t for n, t in self.experts.named_parameters() if n not in ("gate_up_proj", "down_proj")}
        super().set_ep_group(ep_group)
        if self.ep_size > 1:
            n, lo = self.num_experts // self.ep_size, self.ep_rank * self.num_experts // self.ep_size
            for full in extra.values():  # the same Parameter keeps only its rows (as MoEBlock.set_ep_group)
                full.data = full.data[lo : lo + n].clone()
                _tag_expert(full, self.ep_size)

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        out = super().forward(x)
        return (out, None) if self.returns_scores else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, in place of transformers' {self.hf_class}"


def _record_routing(router: nn.Module, args: Any, routing: Any) -> None:
    record = getattr(router, "router_record", None)
    if record is not None:
        record(routing.logits, routing.weights, routing.indices)


def _recorder(hf_router: nn.Module) -> nn.Module:
    """A parameter-free instance of transformers' router class (so the model's output-capturing hooks match it) that
    returns what it is given; it takes over the hooks already installed on ``hf_router``."""
    cls = type(hf_router)
    rec_cls: Any = type(f"Recorded{cls.__name__}", (cls,), {"forward": lambda self, *outputs: outputs})
    rec = rec_cls.__new__(rec_cls)
    nn.Module.__init__(rec)
    rec._forward_hooks.update(hf_router._forward_hooks)
    return rec


def _to_hf_names(module: HFMoEBlock, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for ours, theirs in module.hf_names.items():
        if prefix + ours in state_dict:
            state_dict[prefix + theirs] = state_dict.pop(prefix + ours)


def _from_hf_names(module: HFMoEBlock, state_dict: dict, prefix: str, *args: Any) -> None:
    for ours, theirs in module.hf_names.items():
        if prefix + theirs in state_dict and ours != theirs:
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)


def _get(module: nn.Module, name: str) -> torch.Tensor:
    for part in name.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def _put(module: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, last = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, last, value)


def swap_block(block: Any, ep_group: Any = None) -> HFMoEBlock:
    """The :class:`HFMoEBlock` holding ``block``'s weights (see the module docstring); ``block`` is left as it was."""
    spec = SPECS[type(block).__name__](block)
    if spec.parts is None:
        _check_silu(block)
    w = block.experts.gate_up_proj
    ours = HFMoEBlock(
        getattr(block, spec.hf_router).weight.shape[-1],
        spec.intermediate,
        spec.num_experts,
        spec.top_k,
        ep_group=ep_group,
        router=spec.router,
        shared_intermediate_size=spec.shared_intermediate,
        shared_gate=spec.shared_gate,
        device="meta",
        dtype=w.dtype,
        hf_names=spec.names,
        hf_class=type(block).__name__,
    )
    lo, n = ours.experts.first_expert, ours.experts.num_local_experts
    for mine, theirs in spec.names.items():
        tensor = _get(block, theirs)
        if mine.startswith("experts."):
            if ours.ep_size > 1:
                tensor = nn.Parameter(tensor.detach()[lo : lo + n].clone(), requires_grad=tensor.requires_grad)
            tensor = _tag_expert(tensor, ours.ep_size)  # type: ignore[arg-type]
        _put(ours, mine, tensor)
    if spec.parts is not None:
        ours.router, ours.experts = spec.parts(block, lo, n, ours.ep_size)  # type: ignore[assignment]
        ours.router.register_forward_hook(_record_routing)
        ours.returns_scores = spec.returns_scores
    if ours.router.expert_load is not None:
        ours.router.expert_load = torch.zeros(spec.num_experts, device=w.device, dtype=torch.float32)
    left = [n for n, t in [*ours.named_parameters(), *ours.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(
            f"{type(block).__name__}: no transformers tensor for {left} (a layout this swap does not know)"
        )
    router = getattr(block, spec.hf_router, None)
    if isinstance(router, nn.Module):
        ours.router.router_record = _recorder(router)
    ours.train(block.training)
    return ours


def swap_moe_blocks(model: nn.Module, ep_group: Any = None) -> int:
    """Replace every supported transformers sparse MoE block of ``model`` (in place) by an :class:`HFMoEBlock`
    holding the same weights, its experts spread over ``ep_group`` (None: all on this rank). Returns how many blocks
    were swapped (0 for a model without one). Every rank of ``ep_group`` must call it on the same model (the blocks
    check their arguments across the group). A supported block in a configuration the swap cannot reproduce (another
    activation, Mixtral's router jitter) raises a ValueError naming it."""
    todo = [(name, m) for name, m in model.named_modules() if type(m).__name__ in SPECS]
    for name, block in todo:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, swap_block(block, ep_group))
    return len(todo)


__all__ = ["HFMoEBlock", "SPECS", "swap_block", "swap_moe_blocks"]
