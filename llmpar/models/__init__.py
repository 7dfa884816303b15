"""Models used by the demo, the tests and the benchmarks, and ``llmpar.models.anatomy``: what any model's blocks,
attention, MLPs and embeddings are (asked by the pipeline split, ZeRO-3 units, activation checkpointing and tensor
parallel plans). The model names are imported lazily, so that asking the anatomy does not load the demo model."""

from __future__ import annotations

import importlib
from typing import Any

# public name -> "module:attribute"
_EXPORTS: dict[str, str] = {
    "GPT": "llmpar.models.gpt:GPT",
    "GPTConfig": "llmpar.models.gpt:GPTConfig",
    "GPTEmbedding": "llmpar.models.gpt:GPTEmbedding",
    "GPTHead": "llmpar.models.gpt:GPTHead",
    "Block": "llmpar.models.gpt:Block",
    "CausalSelfAttention": "llmpar.models.gpt:CausalSelfAttention",
    "MLP": "llmpar.models.gpt:MLP",
    "lm_loss": "llmpar.models.gpt:lm_loss",
}


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'llmpar.models' has no attribute {name!r}")
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = list(_EXPORTS)
