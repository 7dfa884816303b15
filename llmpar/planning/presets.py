"""Built-in model shapes (GPT-2 family, Llama 7B/13B/70B) and GPU types.

Model shapes are the published ones: GPT-2 from the OpenAI release (n_positions 1024, vocab 50257, tied head),
Llama 7B/13B from Touvron et al. 2023a, 70B from Llama 2 (grouped-query attention with 8 KV heads); all Llama at
the Llama 2 context of 4096. Parameter counts: 124.4M, 354.8M, 774.0M, 1.558B, 6.738B, 13.016B, 68.977B.

Mixtures of experts, from their published Hugging Face ``config.json`` (planned at a 4096 context like the Llamas;
``--seq`` for another): Mixtral-8x7B (32 layers of 8 experts of 14336, top-2, GQA 8 KV heads), Qwen3-30B-A3B
(48 layers of 128 experts of 768, top-8, heads of 128 with q/k norms, 4 KV heads), DeepSeek-V3 (61 layers, the first
3 dense of 18432, then 256 routed experts of 2048 + 1 shared, top-8, multi-head latent attention; its multi-token
prediction module is not counted). Parameter counts: 46.703B (12.880B active), 30.532B (3.353B active), 671.026B
(37.552B active).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .model_spec import ModelSpec


def _gpt2(name: str, n_layers: int, hidden: int, n_heads: int) -> ModelSpec:
    return ModelSpec(
        name=name, n_layers=n_layers, hidden=hidden, n_heads=n_heads, vocab=50257, seq_len=1024, fused_qkv=True
    )


def _llama(name: str, n_layers: int, hidden: int, n_heads: int, ffn: int, kv_heads: int | None = None) -> ModelSpec:
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=kv_heads,
        vocab=32000,
        seq_len=4096,
        ffn_hidden=ffn,
        tied_embeddings=False,
        gated_mlp=True,
        learned_positions=False,
        norm="rmsnorm",
        bias=False,
    )


def _moe(name: str, **kw: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        seq_len=4096,
        tied_embeddings=False,
        gated_mlp=True,
        learned_positions=False,
        norm="rmsnorm",
        bias=False,
        qk_norm=name.startswith("qwen3"),
        **kw,  # type: ignore[arg-type]
    )


MOE_PRESETS: dict[str, ModelSpec] = {
    "mixtral-8x7b": _moe(
        "mixtral-8x7b",
        vocab=32000,
        n_layers=32,
        hidden=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        num_experts=8,
        top_k=2,
    ),
    "qwen3-30b-a3b": _moe(
        "qwen3-30b-a3b",
        vocab=151936,
        n_layers=48,
        hidden=2048,
        n_heads=32,
        n_kv_heads=4,
        kv_channels=128,
        ffn_hidden=6144,
        num_experts=128,
        top_k=8,
        moe_intermediate=768,
    ),
    "deepseek-v3": _moe(
        "deepseek-v3",
        vocab=129280,
        n_layers=61,
        hidden=7168,
        n_heads=128,
        ffn_hidden=18432,
        num_experts=256,
        top_k=8,
        moe_intermediate=2048,
        shared_intermediate=2048,
        first_dense_layers=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),
}

MODEL_PRESETS: dict[str, ModelSpec] = {
    "gpt2-124m": _gpt2("gpt2-124m", 12, 768, 12),
    "gpt2-350m": _gpt2("gpt2-350m", 24, 1024, 16),
    "gpt2-774m": _gpt2("gpt2-774m", 36, 1280, 20),
    "gpt2-1.5b": _gpt2("gpt2-1.5b", 48, 1600, 25),
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 11008),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 13824),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 28672, kv_heads=8),
    **MOE_PRESETS,
}
_MODEL_ALIASES = {"gpt2": "gpt2-124m", "gpt2-medium": "gpt2-350m", "gpt2-large": "gpt2-774m", "gpt2-xl": "gpt2-1.5b"}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive; also ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``) or a JSON
    config file path (see ``ModelSpec.from_dict`` for the accepted keys)."""
    key = name_or_path.lower()
    key = _MODEL_ALIASES.get(key, key)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        if not Path(name_or_path).is_file():
            raise ValueError(f"model config file {name_or_path!r} does not exist")
        return ModelSpec.from_json(name_or_path)
    accepted = ", ".join([*MODEL_PRESETS, *_MODEL_ALIASES])
    raise ValueError(f"unknown model {name_or_path!r}; accepted presets: {accepted}, or a path to a JSON config")


@dataclass(kw_only=True, frozen=True)
class Hardware:
    """One GPU type and its links. Bandwidths are bytes/s per GPU per direction (what a ring collective sees).

    ``peak_flops``: dense bf16 tensor-core peak. ``intra_node_bw``: NVLink. ``inter_node_bw``: the GPU's share of
    the node's network (InfiniBand/RoCE). ``pcie_bw``: host <-> device, used for CPU offload.
    ``cpu_adam_params_per_s``: optimizer steps per second a rank's share of host cores runs (offload).
    """

    name: str
    mem_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    pcie_bw: float = 25e9
    cpu_mem_per_node: float = 1e12
    cpu_adam_params_per_s: float = 1e9

    def __post_init__(self) -> None:
        for name in (
            "mem_bytes",
            "peak_flops",
            "intra_node_bw",
            "inter_node_bw",
            "pcie_bw",
            "cpu_mem_per_node",
            "cpu_adam_params_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {name}={getattr(self, name)!r} must be positive")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware gpus_per_node={self.gpus_per_node!r} must be a positive integer")


GPU_PRESETS: dict[str, Hardware] = {
    # A100 SXM: 312 TFLOP/s bf16, NVLink3 600 GB/s bidirectional, HDR InfiniBand 200 Gb/s per GPU
    "a100-40gb": Hardware(name="a100-40gb", mem_bytes=40e9, peak_flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9),
    "a100": Hardware(name="a100", mem_bytes=80e9, peak_flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9),
    # H100 / H200 SXM: 989 TFLOP/s dense bf16, NVLink4 900 GB/s bidirectional, NDR 400 Gb/s per GPU, PCIe 5
    "h100": Hardware(
        name="h100", mem_bytes=80e9, peak_flops=989e12, intra_node_bw=450e9, inter_node_bw=50e9, pcie_bw=50e9
    ),
    "h200": Hardware(
        name="h200", mem_bytes=141e9, peak_flops=989e12, intra_node_bw=450e9, inter_node_bw=50e9, pcie_bw=50e9
    ),
}


def load_gpu(name: str) -> Hardware:
    key = name.lower()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown gpu {name!r}; accepted: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]
