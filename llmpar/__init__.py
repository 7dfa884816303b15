"""llmpar: tensor parallelism, ZeRO and fused kernels for training LLMs on plain PyTorch.

The top-level names are imported lazily so that ``import llmpar`` stays cheap and never touches CUDA.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_EXPORTS: dict[str, str] = {
    "ParallelDims": "llmpar.distributed.dims:ParallelDims",
    "init_distributed": "llmpar.distributed.init:init_distributed",
    "DistEnv": "llmpar.distributed.init:DistEnv",
    "parallelize": "llmpar.tensor_parallel.parallelize:parallelize",
    "ColumnParallelLinear": "llmpar.tensor_parallel.linear:ColumnParallelLinear",
    "RowParallelLinear": "llmpar.tensor_parallel.linear:RowParallelLinear",
    "ParallelLMHead": "llmpar.tensor_parallel.linear:ParallelLMHead",
    "VocabParallelEmbedding": "llmpar.tensor_parallel.embedding:VocabParallelEmbedding",
    "vocab_parallel_cross_entropy": "llmpar.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
    "build_pipeline": "llmpar.pipeline:build_pipeline",
    "PipelineRunner": "llmpar.pipeline.runner:PipelineRunner",
    "initialize": "llmpar.runtime.initialize:initialize",
    "Engine": "llmpar.runtime.engine:Engine",
    "PipelineEngine": "llmpar.runtime.pipeline_engine:PipelineEngine",
    "ZeroOptimizer": "llmpar.zero.optimizer:ZeroOptimizer",
}


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'llmpar' has no attribute {name!r}")
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = ["__version__", *_EXPORTS]
