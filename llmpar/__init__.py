"""llmpar: tensor parallelism, ZeRO and fused kernels for training LLMs on plain PyTorch.

The top-level names are imported lazily so that ``import llmpar`` stays cheap and never touches CUDA.

DeepSpeed scripts run with ``import llmpar as deepspeed``: ``initialize``, ``add_config_arguments``,
``init_distributed``, ``comm``, ``zero``, ``checkpointing``, ``utils`` (``log_dist``, ``zero_to_fp32``),
``ops.adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``) and ``DeepSpeedEngine`` (the base of both engines) are here under
DeepSpeed's names.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute", or a submodule name
_EXPORTS: dict[str, str] = {
    "ParallelDims": "llmpar.distributed.dims:ParallelDims",
    "init_distributed": "llmpar.comm:init_distributed",
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
    "add_config_arguments": "llmpar.runtime.args:add_config_arguments",
    "Engine": "llmpar.runtime.engine:Engine",
    "PipelineEngine": "llmpar.runtime.pipeline_engine:PipelineEngine",
    "DeepSpeedEngine": "llmpar.runtime.engine_base:EngineBase",
    "ZeroOptimizer": "llmpar.zero.optimizer:ZeroOptimizer",
    "log_dist": "llmpar.utils:log_dist",
    "logger": "llmpar.utils:logger",
    "comm": "comm",
    "checkpointing": "checkpointing",
    "utils": "utils",
    "zero": "zero",
    "ops": "ops",
    "pipe": "pipe",
    "PipelineModule": "llmpar.pipe:PipelineModule",
}
# DeepSpeed's module names inside lower packages (``deepspeed.ops.adam``): loaded with any export once their package
# is an attribute here, so that ``llmpar.ops.adam`` is one whenever ``llmpar.ops`` is
_COMPAT_SHIMS = ("llmpar.ops.adam",)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'llmpar' has no attribute {name!r}")
    if ":" in target:
        module_name, attr = target.split(":")
        value = getattr(importlib.import_module(module_name), attr)
    else:
        full = f"{__name__}.{target}"
        if full in sys.modules:  # being imported right now (an import inside it asked): the import system binds it
            return sys.modules[full]
        value = importlib.import_module(full)
    globals()[name] = value
    for shim in _COMPAT_SHIMS:
        if shim.split(".")[1] in globals():
            importlib.import_module(shim)
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = ["__version__", *_EXPORTS]
