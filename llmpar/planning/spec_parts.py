"""The tensors of one transformer layer as ``ModelSpec`` counts them: attention (multi-head / grouped-query with
optional biases and q/k norms, or DeepSeek's multi-head latent attention) and the MLP (dense, or a mixture of
experts: router, routed experts, shared experts), on one of ``tp`` tensor-parallel and ``ep`` expert-parallel
ranks. The formulas are written out in ``model_spec``'s module docstring; the MoE and MLA fields are checked here.
"""

from __future__ import annotations

import math
from typing import Any


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"model {name}={value!r} must be an integer >= {low}")


def check_moe_fields(spec: Any) -> None:
    """ValueError naming the field when the MoE / MLA / head-dim fields of ``spec`` do not describe a model."""
    if spec.kv_channels is not None:
        _int_at_least("kv_channels", spec.kv_channels, 1)
    _int_at_least("num_experts", spec.num_experts, 0)
    _int_at_least("top_k", spec.top_k, 0)
    _int_at_least("shared_intermediate", spec.shared_intermediate, 0)
    _int_at_least("first_dense_layers", spec.first_dense_layers, 0)
    if spec.num_experts:
        if spec.moe_intermediate is None:
            object.__setattr__(spec, "moe_intermediate", spec.ffn_hidden)
        _int_at_least("moe_intermediate", spec.moe_intermediate, 1)
        if not 1 <= spec.top_k <= spec.num_experts:
            raise ValueError(f"model top_k={spec.top_k!r} must be in [1, num_experts={spec.num_experts}]")
        if spec.first_dense_layers >= spec.n_layers:
            raise ValueError(
                f"model first_dense_layers={spec.first_dense_layers} leaves no MoE layer of n_layers={spec.n_layers}"
            )
    elif spec.top_k or spec.shared_intermediate or spec.first_dense_layers or spec.moe_intermediate is not None:
        raise ValueError(
            "model top_k / moe_intermediate / shared_intermediate / first_dense_layers need num_experts > 0"
        )
    if spec.kv_lora_rank is not None:
        _int_at_least("kv_lora_rank", spec.kv_lora_rank, 1)
        if spec.q_lora_rank is not None:
            _int_at_least("q_lora_rank", spec.q_lora_rank, 1)
        for name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _int_at_least(name, getattr(spec, name), 1)
        if spec.fused_qkv or spec.qk_norm:
            raise ValueError("model kv_lora_rank (latent attention) excludes fused_qkv and qk_norm")


def hf_moe_fields(config: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The fields a Hugging Face MoE / MLA config spells its own way: DeepSeek's ``n_shared_experts`` (each of
    ``moe_intermediate_size``) and its ``head_dim`` (the rope part, not a head of q); Qwen-MoE's sparse-layer
    pattern, accepted only when every layer is an MoE layer."""
    out: dict[str, Any] = {}
    if config.get("n_shared_experts"):
        width = config.get("moe_intermediate_size") or kwargs.get("ffn_hidden") or 0
        out["shared_intermediate"] = int(config["n_shared_experts"]) * int(width)
    if "kv_lora_rank" in kwargs and "kv_channels" not in config:
        out["kv_channels"] = None  # ``head_dim`` of an MLA config is qk_rope_head_dim
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) not in (1, None):
        raise ValueError(
            f"model config mlp_only_layers={config.get('mlp_only_layers')!r} / decoder_sparse_step="
            f"{config.get('decoder_sparse_step')!r}: only every layer MoE (after first_k_dense_replace) is planned"
        )
    if not kwargs.get("num_experts") and not out.get("num_experts"):
        for key in ("top_k", "moe_intermediate", "shared_intermediate", "first_dense_layers"):
            kwargs.pop(key, None)  # a dense config's defaults (e.g. num_experts_per_tok) describe no expert
        out.pop("shared_intermediate", None)
    return out


def attention_tensors(spec: Any, tp: int) -> list[int]:
    """Elements of each attention tensor of one layer on one of ``tp`` ranks: Q, K, V (one when fused), Wo, biases,
    q/k norms; with latent attention q_a, its norm, q_b (or q), kv_a, its norm, kv_b, Wo."""
    h, n = spec.hidden, spec.n_heads
    if spec.kv_lora_rank is not None:
        rq, rkv, dn, dr, dv = (
            spec.q_lora_rank,
            spec.kv_lora_rank,
            spec.qk_nope_head_dim,
            spec.qk_rope_head_dim,
            spec.v_head_dim,
        )
        q = [h * n * (dn + dr) // tp] if rq is None else [h * rq, rq, rq * n * (dn + dr) // tp]
        return q + [h * (rkv + dr), rkv, rkv * n * (dn + dv) // tp, n * dv * h // tp]
    hd = spec.head_dim
    q, kv = n * hd, spec.n_kv_heads * hd
    mats = [h * (q + 2 * kv) // tp] if spec.fused_qkv else [h * q // tp, h * kv // tp, h * kv // tp]
    out = mats + [q * h // tp]
    if spec.bias:
        out += ([(q + 2 * kv) // tp] if spec.fused_qkv else [q // tp, kv // tp, kv // tp]) + [h]
    return out + ([hd, hd] if spec.qk_norm else [])


def mlp_tensors(spec: Any, tp: int, moe: bool, ep: int = 1) -> list[int]:
    """Elements of each MLP tensor of one layer: dense (``ffn_hidden`` split by tp, biases) or MoE (router E h,
    the E / ep routed experts packed as [E/ep, 2I, h] and [E/ep, h, I], shared experts split by tp)."""
    h = spec.hidden
    if not moe:
        f = math.ceil(spec.ffn_hidden / tp)
        return [h * f] * (3 if spec.gated_mlp else 2) + ([f, h] if spec.bias else [])
    e, i = spec.num_experts // ep, spec.moe_intermediate
    shared = [h * math.ceil(spec.shared_intermediate / tp)] * 3 if spec.shared_intermediate else []
    return [spec.num_experts * h, e * 2 * i * h, e * h * i] + shared


def routed_per_layer(spec: Any) -> int:
    """Routed expert parameters of one MoE layer, E 3 h I (0 for a dense model)."""
    return spec.num_experts * 3 * spec.hidden * spec.moe_intermediate if spec.num_experts else 0
