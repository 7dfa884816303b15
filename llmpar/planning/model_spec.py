"""The shape of a decoder-only transformer, and its parameter count in total and per (tp, pp) rank.

Covers GPT-2 (learned positions, LayerNorm with bias, biased linears, GELU MLP, tied embeddings) and Llama
(rotary positions, RMSNorm, no biases, SwiGLU MLP, untied head, grouped-query attention) with one set of switches.

Parameters per layer (h = hidden, f = ffn_hidden, k = kv_heads x head_dim):

    attention  Wq, Wo: h x h;  Wk, Wv: h x k          (+ biases h + 2k + h)
    MLP        gated: 3 h f;  plain: 2 h f             (+ biases f + h)
    norms      2 per layer, h each (RMSNorm) or 2h (LayerNorm)

plus the token embedding V h, learned positions s h, the final norm and an untied head V h.

Mixture of experts (``num_experts`` E > 0; Mixtral, Qwen-MoE, DeepSeek-V3): every layer after the first
``first_dense_layers`` replaces its MLP by a router (E h), E routed SwiGLU experts of width I = ``moe_intermediate``
(3 h I each; whole on each of their ep ranks, never split by tp) and shared experts of total width S =
``shared_intermediate`` (3 h S, split by tp like a dense MLP). ``top_k`` experts run per token, so the matmul
parameters per token count k / E of the routed experts. Heads of ``kv_channels`` (HF ``head_dim``) when that is not
h / heads; ``qk_norm``: RMSNorm on q and k (Qwen3, 2 head_dim). Multi-head latent attention (``kv_lora_rank`` set;
DeepSeek-V2/V3, n heads, r_q = ``q_lora_rank``, r_kv = ``kv_lora_rank``, d_n / d_r / d_v = ``qk_nope_head_dim`` /
``qk_rope_head_dim`` / ``v_head_dim``):

    q  h r_q + r_q + r_q n (d_n + d_r)     (no q_lora_rank: h n (d_n + d_r))
    kv h (r_kv + d_r) + r_kv + r_kv n (d_n + d_v)          o  n d_v h
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .spec_parts import attention_tensors, check_moe_fields, hf_moe_fields, mlp_tensors, routed_per_layer

# keys accepted in a JSON config, ours first then Hugging Face / GPT-2 spellings
_ALIASES: dict[str, tuple[str, ...]] = {
    "n_layers": ("n_layers", "num_layers", "num_hidden_layers", "n_layer"),
    "hidden": ("hidden", "hidden_size", "n_embd", "d_model"),
    "n_heads": ("n_heads", "num_heads", "num_attention_heads", "n_head"),
    "n_kv_heads": ("n_kv_heads", "num_key_value_heads"),
    "vocab": ("vocab", "vocab_size"),
    "seq_len": ("seq_len", "max_position_embeddings", "n_positions", "n_ctx"),
    "ffn_hidden": ("ffn_hidden", "intermediate_size", "n_inner", "ffn_hidden_size"),
    "tied_embeddings": ("tied_embeddings", "tie_word_embeddings"),
    "gated_mlp": ("gated_mlp",),
    "learned_positions": ("learned_positions",),
    "norm": ("norm",),
    "bias": ("bias",),
    "fused_qkv": ("fused_qkv",),
    "name": ("name",),
    "kv_channels": ("kv_channels", "head_dim"),
    "qk_norm": ("qk_norm",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "top_k": ("top_k", "num_experts_per_tok"),
    "moe_intermediate": ("moe_intermediate", "moe_intermediate_size"),
    "shared_intermediate": ("shared_intermediate", "shared_expert_intermediate_size"),
    "first_dense_layers": ("first_dense_layers", "first_k_dense_replace"),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "v_head_dim": ("v_head_dim",),
}
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer. ``ffn_hidden`` defaults to 4 h, ``n_kv_heads`` to ``n_heads``."""

    name: str = "custom"
    n_layers: int
    hidden: int
    n_heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int | None = None
    n_kv_heads: int | None = None
    tied_embeddings: bool = True
    gated_mlp: bool = False
    learned_positions: bool = True
    norm: str = "layernorm"  # "layernorm" (weight + bias) or "rmsnorm" (weight)
    bias: bool = True  # biases on the linear layers
    fused_qkv: bool = False  # Q, K, V as one [h + 2k, h] matrix (GPT-2's c_attn, llmpar's GPT) instead of three
    kv_channels: int | None = None  # head dim when not hidden / n_heads (HF ``head_dim``)
    qk_norm: bool = False  # RMSNorm of head_dim on q and k (Qwen3)
    num_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    top_k: int = 0  # experts per token
    moe_intermediate: int | None = None  # routed (and shared) expert width; default ffn_hidden
    shared_intermediate: int = 0  # total width of the shared experts
    first_dense_layers: int = 0  # leading layers with a dense MLP of ffn_hidden (DeepSeek's first_k_dense_replace)
    q_lora_rank: int | None = None  # multi-head latent attention (module doc) when kv_lora_rank is set
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {name}={value!r} must be a positive integer")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 1:
            raise ValueError(f"model ffn_hidden={self.ffn_hidden!r} must be a positive integer")
        if self.kv_channels is None and self.kv_lora_rank is None and self.hidden % self.n_heads:
            raise ValueError(f"model hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model n_kv_heads={self.n_kv_heads!r} must be a positive divisor of n_heads={self.n_heads}"
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model norm={self.norm!r}; accepted: 'layernorm', 'rmsnorm'")
        check_moe_fields(self)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, config: dict[str, Any], *, name: str | None = None) -> "ModelSpec":
        """From our own keys or Hugging Face / GPT-2 config keys (``n_layer``, ``num_hidden_layers``, ...).

        A Llama-style config (``model_type == "llama"`` or ``hidden_act == "silu"``) defaults to SwiGLU, RMSNorm,
        no biases, rotary positions, untied head."""
        kind = config.get("model_type")
        llama_like = kind in ("llama", "mistral", "qwen2", "qwen3", *_MOE_TYPES) or config.get("hidden_act") == "silu"
        kwargs: dict[str, Any] = (
            dict(gated_mlp=True, norm="rmsnorm", bias=False, learned_positions=False, tied_embeddings=False)
            if llama_like
            else {"fused_qkv": True}
            if config.get("model_type") == "gpt2"
            else {}
        )
        if kind in ("qwen3", "qwen3_moe"):
            kwargs["qk_norm"] = True
        for field_name, keys in _ALIASES.items():
            for key in keys:
                if key in config and config[key] is not None:
                    kwargs[field_name] = config[key]
                    break
        kwargs.update(hf_moe_fields(config, kwargs))
        missing = [f for f in ("n_layers", "hidden", "n_heads", "vocab", "seq_len") if f not in kwargs]
        if missing:
            raise ValueError(
                f"model config is missing {missing}; each may be spelled as one of "
                + "; ".join(f"{m}: {', '.join(_ALIASES[m])}" for m in missing)
            )
        if name is not None:
            kwargs["name"] = name
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelSpec":
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"model config {str(path)!r} could not be read as JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise ValueError(f"model config {str(path)!r} must hold a JSON object, got {type(config).__name__}")
        return cls.from_dict(config, name=config.get("name", path.stem))

    def with_seq_len(self, seq_len: int | None) -> "ModelSpec":
        return self if seq_len is None else replace(self, seq_len=seq_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---------------------------------------------------------------- counts
    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden // self.n_heads

    @property
    def moe_layers(self) -> int:
        """Layers with a mixture-of-experts MLP (0 for a dense model)."""
        return self.n_layers - self.first_dense_layers if self.num_experts else 0

    def layer_kinds(self) -> list[bool]:
        """Per layer, whether its MLP is a mixture of experts."""
        return [self.num_experts > 0 and i >= self.first_dense_layers for i in range(self.n_layers)]

    def _layer_params(self, tp: int = 1, moe: bool | None = None, ep: int = 1) -> int:
        """Parameters of one transformer layer held by one of ``tp`` tensor-parallel ranks (Megatron split:
        Q/K/V and the first MLP matmul(s) column-parallel with their biases, Wo and the last MLP matmul
        row-parallel with replicated biases, norms replicated); ``moe``: its kind (default: an MoE layer when the
        model has experts), of which one of ``ep`` ranks holds num_experts / ep routed experts."""
        return sum(self.layer_tensors(tp, moe=moe, ep=ep))

    def _norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def _embedding_params(self, tp: int = 1) -> int:
        """Token embedding (vocab-parallel: ceil(V / tp) rows) plus learned positions (replicated)."""
        return math.ceil(self.vocab / tp) * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def layer_tensors(self, tp: int = 1, *, moe: bool | None = None, ep: int = 1) -> list[int]:
        """Elements of each tensor of one layer on one of ``tp`` ranks (they sum to ``layer_params(tp)``): Q, K, V
        (one tensor when ``fused_qkv``), Wo, the biases, the MLP's matrices (dense, or router, routed and shared
        experts: ``spec_parts``), the norms' weights (and biases)."""
        moe = self.num_experts > 0 if moe is None else moe
        norms = [self.hidden] * (4 if self.norm == "layernorm" else 2)
        return attention_tensors(self, tp) + mlp_tensors(self, tp, moe, ep) + norms

    def _stages(self, tp: int, pp: int, ep: int = 1) -> list[list[int]]:
        """The tensors of each pipeline stage: its layers, the token embedding and learned positions (first stage),
        the final norm and an untied head (last stage; with tied embeddings and pp > 1 its own embedding copy)."""
        h, v, n = self.hidden, math.ceil(self.vocab / tp), self.n_layers // pp
        kinds = {moe: self.layer_tensors(tp, moe=moe, ep=ep) for moe in {False, self.num_experts > 0}}
        embedding = [v * h] + ([self.seq_len * h] if self.learned_positions else [])
        head = [h] * (2 if self.norm == "layernorm" else 1) + ([v * h] if not self.tied_embeddings or pp > 1 else [])
        out = []
        for i, chunk in enumerate(self.layer_kinds()[j * n : (j + 1) * n] for j in range(pp)):
            layers = [x for moe in chunk for x in kinds[moe]]
            out.append((embedding if i == 0 else []) + layers + (head if i == pp - 1 else []))
        return out

    def stage_tensors(self, *, tp: int = 1, pp: int = 1) -> list[int]:
        """Elements of each tensor of the busiest (tp, pp) rank (the one ``params_per_rank`` counts; the first such
        stage on a tie), as ``_stages`` lists them."""
        self.check_layout(tp=tp, pp=pp)
        return max(self._stages(tp, pp), key=sum)

    def stage_split(self, *, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[int, int]:
        """``(other, routed)`` parameters of the busiest (tp, pp, ep) rank: the routed experts it holds (num_experts
        / ep of each of its MoE layers) and everything else."""
        self.check_layout(tp=tp, pp=pp)
        n, per = self.n_layers // pp, routed_per_layer(self) // ep
        stages = [sum(t) for t in self._stages(tp, pp, ep)]
        best = stages.index(max(stages))
        routed = sum(self.layer_kinds()[best * n : (best + 1) * n]) * per
        return stages[best] - routed, routed

    def stage3_kept_layers(self, reuse: int, *, tp: int = 1, pp: int = 1) -> int:
        """Layers of the busiest (tp, pp) rank that ZeRO-3 keeps gathered from forward to backward under
        ``stage3_max_reuse_distance`` ``reuse`` (elements; the runtime's rule, ``llmpar.zero.units.kept_units``):
        layer i of a stage's L when fewer than ``reuse`` elements are gathered between its forward and its backward
        use, the 2 (L-1-i) layers after it and the output head twice (its forward and its backward gather)."""
        self.check_layout(tp=tp, pp=pp)
        n, lp, head = self.n_layers // pp, self._layer_params(tp), math.ceil(self.vocab / tp) * self.hidden
        return sum(1 for i in range(n) if 2 * (n - 1 - i) * lp + 2 * head < reuse)

    def small_params(self, threshold: int, *, tp: int = 1, pp: int = 1) -> int:
        """Elements in tensors of at most ``threshold`` elements on the busiest (tp, pp) rank: what ZeRO-3 keeps
        gathered on every rank (``stage3_param_persistence_threshold``: biases, norms, small matrices)."""
        return sum(n for n in self.stage_tensors(tp=tp, pp=pp) if n <= threshold)

    def num_params(self) -> int:
        """Total parameters, psi (a tied head is counted once)."""
        return sum(self._stages(1, 1)[0])

    def expert_params(self) -> int:
        """psi_e: the routed experts' parameters, moe_layers x E x 3 h I (0 for a dense model)."""
        return self.moe_layers * routed_per_layer(self)

    def active_params(self) -> int:
        """Parameters a token uses: psi minus the (E - k) / E of the routed experts it does not visit."""
        idle = self.expert_params() * (self.num_experts - self.top_k) // self.num_experts if self.num_experts else 0
        return self.num_params() - idle

    def layer_params(self, tp: int = 1, ep: int = 1) -> int:
        return self._layer_params(tp, ep=ep)

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: psi minus the input-embedding lookup tables
        (a tied embedding still counts, once, as the output head) and, with experts, minus the (E - k) / E of the
        routed experts a token does not visit. Used for the 6 N FLOPs term."""
        lookup = self.seq_len * self.hidden if self.learned_positions else 0
        if not self.tied_embeddings:
            lookup += self.vocab * self.hidden
        return self.active_params() - lookup

    def params_per_rank(self, *, tp: int = 1, pp: int = 1) -> int:
        """Parameters held by the busiest (tp, pp) rank. Layers are split evenly over ``pp`` stages; the first stage
        also holds the embedding, the last the final norm and head (with tied embeddings and pp > 1 the last stage
        holds its own copy of the embedding, as Megatron does). Returns the largest stage's count."""
        return sum(self.stage_tensors(tp=tp, pp=pp))

    def check_layout(self, *, tp: int, pp: int) -> None:
        """ValueError unless tp divides the (query and key/value) heads and pp divides the layers."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp={tp!r} must be a positive integer")
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pp={pp!r} must be a positive integer")
        if self.n_heads % tp:
            raise ValueError(f"tp={tp} does not divide n_heads={self.n_heads} of model {self.name!r}")
        if self.n_kv_heads % tp:  # type: ignore[operator]
            raise ValueError(f"tp={tp} does not divide n_kv_heads={self.n_kv_heads} of model {self.name!r}")
        if self.n_layers % pp:
            raise ValueError(f"pp={pp} does not divide n_layers={self.n_layers} of model {self.name!r}")


def count_params(module: Any) -> int:
    """Parameters of an ``nn.Module`` (shared tensors, e.g. a tied head, counted once)."""
    if not hasattr(module, "parameters"):
        raise TypeError(f"expected an nn.Module (something with .parameters()), got {type(module).__name__}")
    return sum(p.numel() for p in module.parameters())
