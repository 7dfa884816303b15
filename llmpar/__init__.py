"""llmpar: tensor parallelism, ZeRO and fused kernels for training LLMs on plain PyTorch.

The top-level names are imported lazily so that ``import llmpar`` stays cheap and never touches CUDA.

DeepSpeed scripts run with ``import llmpar as deepspeed``: ``initialize``, ``add_config_arguments``,
``init_distributed``, ``comm``, ``zero``, ``checkpointing``, ``utils`` (``log_dist``, ``zero_to_fp32``),
``ops.adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``), ``get_accelerator`` and ``DeepSpeedEngine`` (the base of both
engines) are here under DeepSpeed's names. A ``from deepspeed.X import ...`` line becomes ``from llmpar.X import ...``:
``llmpar.accelerator`` (``get_accelerator``), ``llmpar.runtime.lr_schedules``, ``llmpar.runtime.utils``
(``set_random_seed``, ``see_memory_usage``), ``llmpar.comm``, ``llmpar.utils``, ``llmpar.ops.adam``,
``llmpar.pipe``, ``llmpar.zero``, ``llmpar.checkpointing``, ``llmpar.moe.layer`` (``MoE``), ``llmpar.moe.utils``,
``llmpar.utils.groups``; a DeepSpeed module llmpar has no counterpart of (``deepspeed.profiling``,
``deepspeed.moe.sharded_moe``, ...: :data:`NO_COUNTERPART`) is an ``ImportError`` saying what to use.
"""

from __future__ import annotations

import importlib
import importlib.abc
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
    "accelerator": "accelerator",
    "get_accelerator": "llmpar.accelerator:get_accelerator",
    "runtime": "runtime",
}
# DeepSpeed's module names inside lower packages (``deepspeed.ops.adam``): loaded with any export once their package
# is an attribute here, so that ``llmpar.ops.adam`` is one whenever ``llmpar.ops`` is (``llmpar.runtime.utils`` is
# loaded by ``llmpar.runtime`` on first use)
_COMPAT_SHIMS = ("llmpar.ops.adam",)

_OPS = "of DeepSpeed's ops llmpar provides llmpar.ops.adam (FusedAdam, DeepSpeedCPUAdam) only"
_ZERO = (
    "ZeRO's user API is llmpar.zero (Init, GatheredParameters); memory estimates are "
    "llmpar.planning.estimate_memory (`llmpar plan`)"
)
# DeepSpeed module paths (after ``deepspeed.``) with no llmpar counterpart: what to use instead
NO_COUNTERPART = {
    "moe": "of deepspeed.moe llmpar provides llmpar.moe.layer (MoE) and llmpar.moe.utils; the gate and expert "
    "internals are llmpar.moe.legacy (TopKGate), llmpar's own layer is llmpar.moe.MoEBlock",
    "profiling": "the FLOPs profiler is not provided: use torch.profiler.profile(with_flops=True), or "
    "llmpar.planning for model FLOPs and memory",
    "monitor": "the monitors are configured in the config's tensorboard / csv_monitor / wandb blocks; write your own "
    "events with engine.monitor.write_events([(name, value, step), ...]) (llmpar.runtime.monitor)",
    "inference": "the inference engine is not provided: run engine.module in eval mode",
    "module_inject": "kernel injection is not provided (llmpar.parallelize splits a model for tensor parallelism)",
    "model_implementations": "DeepSpeed's inference model implementations are not provided",
    "compression": "DeepSpeed's compression library is not provided",
    "autotuning": "the autotuner is not provided: `llmpar plan` suggests layouts",
    "elasticity": "elastic training is not provided (checkpoints reshard to any dp / tp / pp at load)",
    "launcher": "launch with torchrun (or `llmpar launch`, which translates onto torchrun / srun / mpirun)",
    "nvme": "NVMe offload is not provided (offload_optimizer / offload_param to the CPU are)",
    "ops.lamb": _OPS,
    "ops.transformer": _OPS,
    "ops.sparse_attention": _OPS,
    "ops.op_builder": _OPS,
    "ops.aio": _OPS,
    "ops.deepspeed4science": _OPS,
    "ops.quantizer": _OPS,
    "ops.lion": _OPS,
    "ops.adagrad": _OPS,
    "runtime.zero": _ZERO,
    "runtime.dataloader": "RepeatingLoader is llmpar.utils.RepeatingLoader; DeepSpeed's loader is "
    "engine.deepspeed_io(dataset)",
    "runtime.pipe": "the pipeline API is llmpar.pipe (PipelineModule, LayerSpec, TiedLayerSpec); the engine is "
    "llmpar.PipelineEngine",
    "runtime.activation_checkpointing": "activation checkpointing is llmpar.checkpointing (checkpoint) or the "
    "config's activation_checkpointing block",
    "runtime.fp16": "fp16 loss scaling is the config's fp16 block (llmpar.zero.loss_scale)",
    "runtime.bf16_optimizer": "bf16 is the config's bf16 block (fp32 masters in the ZeRO optimizer)",
    "utils.timer": "DeepSpeed's timers are not provided: use time.perf_counter or torch.profiler",
    "utils.logging": "the logger and log_dist are in llmpar.utils",
    "checkpoint.universal_checkpoint": "llmpar checkpoints load at any dp / tp / pp layout without conversion",
    "checkpoint.deepspeed_checkpoint": "llmpar checkpoints load at any dp / tp / pp layout without conversion",
}

# DeepSpeed module paths whose counterpart is an llmpar module of another name: (that module, how to use it)
ELSEWHERE = {
    "sequence": (
        "llmpar.context_parallel",
        'Ulysses sequence parallelism is its "ulysses" mode: the config\'s "context_parallel": {"mode": "ulysses", '
        '"size": N} block (DeepSpeed\'s "sequence_parallel_size": N means the same) makes llmpar.initialize shard '
        "the sequence and run attention through the all-to-all; a hand-built model uses "
        'llmpar.context_parallel.ContextParallel.from_mesh(mesh, "ulysses") (docs/context-parallel.md)',
    ),
}


class _NoCounterpart(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: asked only for modules no other finder found. ``llmpar.<path>`` for a DeepSpeed
    path in :data:`ELSEWHERE` (or below one) raises a ``ModuleNotFoundError`` naming the llmpar module that provides
    it, one in :data:`NO_COUNTERPART` one saying what to use; anything else is left to Python's own error."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> None:
        if not fullname.startswith(f"{__name__}."):
            return None
        rest = fullname[len(__name__) + 1 :]
        parts = rest.split(".")
        for n in range(len(parts), 0, -1):
            moved = ELSEWHERE.get(".".join(parts[:n]))
            if moved is not None:
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: DeepSpeed's deepspeed.{'.'.join(parts[:n])} is {moved[0]} in "
                    f"llmpar: {moved[1]}",
                    name=fullname,
                )
            why = NO_COUNTERPART.get(".".join(parts[:n]))
            if why is not None:
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: llmpar has no counterpart of DeepSpeed's deepspeed.{rest}: {why}",
                    name=fullname,
                )
        return None


if not any(isinstance(f, _NoCounterpart) for f in sys.meta_path):
    sys.meta_path.append(_NoCounterpart())


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
