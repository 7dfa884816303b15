"""The shape of a decoder-only transformer, and its parameter count in total and per (tp, pp) rank.

Covers GPT-2 (learned positions, LayerNorm with bias, biased linears, GELU MLP, tied embeddings) and Llama
(rotary positions, RMSNorm, no biases, SwiGLU MLP, untied head, grouped-query attention) with one set of switches.

Parameters per layer (h = hidden, f = ffn_hidden, k = kv_heads x head_dim):

    attention  Wq, Wo: h x h;  Wk, Wv: h x k          (+ biases h + 2k + h)
    MLP        gated: 3 h f;  plain: 2 h f             (+ biases f + h)
    norms      2 per layer, h each (RMSNorm) or 2h (LayerNorm)

plus the token embedding V h, learned positions s h, the final norm and an untied head V h.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

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
}


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
        if self.hidden % self.n_heads:
            raise ValueError(f"model hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model n_kv_heads={self.n_kv_heads!r} must be a positive divisor of n_heads={self.n_heads}"
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model norm={self.norm!r}; accepted: 'layernorm', 'rmsnorm'")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, config: dict[str, Any], *, name: str | None = None) -> "ModelSpec":
        """From our own keys or Hugging Face / GPT-2 config keys (``n_layer``, ``num_hidden_layers``, ...).

        A Llama-style config (``model_type == "llama"`` or ``hidden_act == "silu"``) defaults to SwiGLU, RMSNorm,
        no biases, rotary positions, untied head."""
        llama_like = config.get("model_type") in ("llama", "mistral", "qwen2") or config.get("hidden_act") == "silu"
        kwargs: dict[str, Any] = (
            dict(gated_mlp=True, norm="rmsnorm", bias=False, learned_positions=False, tied_embeddings=False)
            if llama_like
            else {"fused_qkv": True}
            if config.get("model_type") == "gpt2"
            else {}
        )
        for field_name, keys in _ALIASES.items():
            for key in keys:
                if key in config and config[key] is not None:
                    kwargs[field_name] = config[key]
                    break
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
        return self.hidden // self.n_heads

    def _layer_params(self, tp: int = 1) -> int:
        """Parameters of one transformer layer held by one of ``tp`` tensor-parallel ranks (Megatron split:
        Q/K/V and the first MLP matmul(s) column-parallel with their biases, Wo and the last MLP matmul
        row-parallel with replicated biases, norms replicated)."""
        h, f, kv = self.hidden, self.ffn_hidden, self.n_kv_heads * self.head_dim  # type: ignore[operator]
        attn = (2 * h * h + 2 * h * kv) // tp
        mlp = (3 if self.gated_mlp else 2) * h * math.ceil(f / tp)  # type: ignore[operator]
        biases = ((h + 2 * kv) // tp + h + math.ceil(f / tp) + h) if self.bias else 0  # type: ignore[operator]
        norms = 2 * self._norm_params()
        return attn + mlp + biases + norms

    def _norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def _embedding_params(self, tp: int = 1) -> int:
        """Token embedding (vocab-parallel: ceil(V / tp) rows) plus learned positions (replicated)."""
        return math.ceil(self.vocab / tp) * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def _head_params(self, tp: int = 1) -> int:
        """Final norm plus an untied output matrix (vocab-parallel)."""
        head = 0 if self.tied_embeddings else math.ceil(self.vocab / tp) * self.hidden
        return self._norm_params() + head

    def layer_tensors(self, tp: int = 1) -> list[int]:
        """Elements of each tensor of one layer on one of ``tp`` ranks (they sum to ``layer_params(tp)``): Q, K, V
        (one tensor when ``fused_qkv``), Wo, the MLP matrices, the biases, the norms' weights (and biases)."""
        h, f, kv = self.hidden, math.ceil(self.ffn_hidden / tp), self.n_kv_heads * self.head_dim  # type: ignore[operator]
        qkv = [h * (h + 2 * kv) // tp] if self.fused_qkv else [h * h // tp, h * kv // tp, h * kv // tp]
        out = qkv + [h * h // tp] + [h * f] * (3 if self.gated_mlp else 2)
        if self.bias:
            out += ([(h + 2 * kv) // tp] if self.fused_qkv else [h // tp, kv // tp, kv // tp]) + [h, f, h]
        return out + [h] * (4 if self.norm == "layernorm" else 2)

    def stage_tensors(self, *, tp: int = 1, pp: int = 1) -> list[int]:
        """Elements of each tensor of the busiest (tp, pp) rank (the one ``params_per_rank`` counts): its layers, and
        the token embedding and learned positions (first stage), the final norm and an untied head (last stage; with
        tied embeddings and pp > 1 the last stage's copy of the embedding)."""
        self.check_layout(tp=tp, pp=pp)
        h, v = self.hidden, math.ceil(self.vocab / tp)
        layers = self.layer_tensors(tp) * (self.n_layers // pp)
        embedding = [v * h] + ([self.seq_len * h] if self.learned_positions else [])
        head = [h] * (2 if self.norm == "layernorm" else 1) + ([v * h] if not self.tied_embeddings or pp > 1 else [])
        if pp == 1:
            return embedding + layers + head
        return embedding + layers if sum(embedding) >= sum(head) else layers + head

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
        return self._embedding_params() + self.n_layers * self._layer_params() + self._head_params()

    def layer_params(self, tp: int = 1) -> int:
        return self._layer_params(tp)

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: psi minus the input-embedding lookup tables
        (a tied embedding still counts, once, as the output head). Used for the 6 N FLOPs term."""
        lookup = self.seq_len * self.hidden if self.learned_positions else 0
        if not self.tied_embeddings:
            lookup += self.vocab * self.hidden
        return self.num_params() - lookup

    def params_per_rank(self, *, tp: int = 1, pp: int = 1) -> int:
        """Parameters held by the busiest (tp, pp) rank. Layers are split evenly over ``pp`` stages; the first stage
        also holds the embedding, the last the final norm and head (with tied embeddings and pp > 1 the last stage
        holds its own copy of the embedding, as Megatron does). Returns the larger of first and last stage."""
        self.check_layout(tp=tp, pp=pp)
        layers = (self.n_layers // pp) * self._layer_params(tp)
        if pp == 1:
            return self._embedding_params(tp) + layers + self._head_params(tp)
        tied_copy = math.ceil(self.vocab / tp) * self.hidden if self.tied_embeddings else 0
        first = self._embedding_params(tp) + layers
        last = layers + self._head_params(tp) + tied_copy
        return max(first, last)

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
