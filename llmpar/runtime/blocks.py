"""The DeepSpeed JSON blocks, as llmpar reads them, each turned into the typed config of the component that acts on it:

    "zero_optimization" -> llmpar.zero.ZeroConfig        "optimizer" -> llmpar.zero.OptimizerConfig
    "scheduler"         -> runtime.schedules.SchedulerConfig
    "pipeline"          -> PipelineConfig (below)        "tensor_parallel" -> TensorParallelConfig (below)

DeepSpeed's spelling lives here only: its aliases (``stage3_gather_fp16_weights_on_model_save``, ``adam_w_mode``),
its implementation switches (``torch_adam``, ``fused``) and the keys llmpar does not support, each an error saying so.
An unknown key is an error naming the nearest valid one.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from llmpar.pipeline.schedules import normalize_schedule
from llmpar.runtime.schedules import SchedulerConfig
from llmpar.validation import as_int, check_keys, nearest
from llmpar.zero.config import OPTIMIZER_TYPES, OffloadConfig, OptimizerConfig, ZeroConfig

# zero_optimization keys DeepSpeed knows that llmpar does not support -> why
_ZERO_UNSUPPORTED = {
    "cpu_offload": "the legacy spelling is not supported: use \"offload_optimizer\": {\"device\": \"cpu\"}",
    "cpu_offload_params": "the legacy spelling is not supported: use \"offload_param\": {\"device\": \"cpu\"}",
    "cpu_offload_use_pin_memory": "the legacy spelling is not supported: use \"offload_optimizer\": {\"pin_memory\": true}",
    "stage3_module_granularity_threshold": "not supported (sharding units are modules: see stage3_unit_policy)",
    "zero_hpz_partition_size": "hierarchical partitioning (ZeRO++) is not supported",
    "zero_quantized_weights": "quantized communication (ZeRO++) is not supported",
    "zero_quantized_gradients": "quantized communication (ZeRO++) is not supported",
    "mics_shard_size": "MiCS is not supported", "mics_hierarchical_params_gather": "MiCS is not supported",
    "elastic_checkpoint": "not needed: llmpar checkpoints load at any dp / tp / pp degree",
    "load_from_fp32_weights": "not supported: llmpar checkpoints restore the fp32 master when saved with one (else it is derived from the params)",
    "round_robin_gradients": "not supported", "ignore_unused_parameters": "not supported (unused params get zero grads)",
    "legacy_stage1": "not supported", "use_multi_rank_bucket_allreduce": "not supported",
    "allgather_partitions": "not supported (llmpar always all-gathers the updated partitions)",
}
_OFFLOAD_UNSUPPORTED = {"buffer_count": "NVMe offload is not supported", "buffer_size": "NVMe offload is not supported",
                        "max_in_cpu": "NVMe offload is not supported", "nvme_path": "NVMe offload is not supported",
                        "pipeline_read": "NVMe offload is not supported", "pipeline_write": "NVMe offload is not supported",
                        "fast_init": "not supported", "ratio": "partial offload is not supported"}
_UNSUPPORTED_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Lion", "Adagrad", "Muon", "SGD")
_OPTIMIZER_PARAMS = ["lr", "betas", "eps", "weight_decay", "precision", "adam_w_mode", "torch_adam", "fused",
                     "bias_correction"]
_SCHEDULER_PARAMS = {  # the params block each schedule takes
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps"),
}


def zero_block(block: Any) -> ZeroConfig:
    """``"zero_optimization"`` -> :class:`ZeroConfig`."""
    check_keys("zero_optimization", block, [f.name for f in fields(ZeroConfig)]
               + ["stage3_gather_fp16_weights_on_model_save"], _ZERO_UNSUPPORTED)
    d = dict(block)
    if "stage3_gather_fp16_weights_on_model_save" in d:  # DeepSpeed's older alias
        if "stage3_gather_16bit_weights_on_model_save" in d:
            raise ValueError('give "stage3_gather_16bit_weights_on_model_save" or its alias '
                             '"stage3_gather_fp16_weights_on_model_save", not both')
        d["stage3_gather_16bit_weights_on_model_save"] = d.pop("stage3_gather_fp16_weights_on_model_save")
    for key in ("offload_optimizer", "offload_param"):
        if d.get(key) is not None:
            check_keys(f"zero_optimization.{key}", d[key], ["device", "pin_memory"], _OFFLOAD_UNSUPPORTED)
            d[key] = OffloadConfig(**d[key])
    return ZeroConfig(**d)


def optimizer_block(block: Any) -> OptimizerConfig:
    """``"optimizer": {"type": "AdamW" | "Adam", "params": {...}}`` -> :class:`OptimizerConfig`."""
    check_keys("optimizer", block, ["type", "params"])
    if "type" not in block:
        raise ValueError('"optimizer" needs a "type" (AdamW or Adam)')
    typ = block["type"]
    if not isinstance(typ, str) or typ.lower() not in OPTIMIZER_TYPES:
        if isinstance(typ, str) and typ.lower() in {t.lower() for t in _UNSUPPORTED_OPTIMIZERS}:
            raise ValueError(f'"optimizer.type"={typ!r} is a DeepSpeed optimizer llmpar does not support; '
                             "use AdamW or Adam")
        raise ValueError(f'"optimizer.type"={typ!r} is not known{nearest(str(typ), list(OPTIMIZER_TYPES.values()))}; '
                         "use AdamW or Adam")
    params = block.get("params", {})
    check_keys("optimizer.params", params, _OPTIMIZER_PARAMS, {"amsgrad": "AMSGrad is not supported"})
    params = dict(params)
    if params.pop("adam_w_mode", True) is not True:
        raise ValueError('"optimizer.params.adam_w_mode"=false (Adam with L2 regularisation) is not supported; '
                         "llmpar runs AdamW (decoupled weight decay)")
    if params.pop("bias_correction", True) is not True:
        raise ValueError('"optimizer.params.bias_correction"=false is not supported')
    params.pop("torch_adam", None)  # DeepSpeed implementation switches: llmpar always runs its fused step
    params.pop("fused", None)
    return OptimizerConfig(type=typ, **params)


def scheduler_block(block: Any) -> SchedulerConfig:
    """``"scheduler": {"type": ..., "params": {...}}`` -> :class:`SchedulerConfig` (DeepSpeed's schedules)."""
    check_keys("scheduler", block, ["type", "params"])
    if "type" not in block:
        raise ValueError(f'"scheduler" needs a "type" ({", ".join(_SCHEDULER_PARAMS)})')
    typ = block["type"]
    if typ not in _SCHEDULER_PARAMS:
        SchedulerConfig(type=typ)  # raises the clear unknown / unsupported-type error
    params = block.get("params", {})
    check_keys(f"scheduler.params ({typ})", params, list(_SCHEDULER_PARAMS[typ]))
    return SchedulerConfig(type=typ, **params)


_PIPELINE_KEYS = ["stages", "schedule", "micro_batches", "virtual_stages", "partition"]
_PIPELINE_UNSUPPORTED = {
    "activation_checkpoint_interval": "use torch.utils.checkpoint in the model",
    "pipe_partitioned": "not supported", "grad_partitioned": "not supported (use ZeRO stage 1/2 over dp)",
    "seed_layers": "not supported", "use_reentrant": "not supported",
}


@dataclass(kw_only=True)
class PipelineConfig:
    """``"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 8}`` (llmpar's block; DeepSpeed keeps these in
    its ``PipelineModule``). stages: pp (>= 1); schedule: gpipe, 1f1b (default) or interleaved_1f1b; micro_batches:
    *is* gradient_accumulation_steps (give either, or both equal); virtual_stages: stages per rank (default 2 for
    interleaved_1f1b, else 1); partition: "parameters" (balanced parameter counts) or the first block index of
    stages 1..S-1."""

    stages: int = 1
    schedule: str = "1f1b"
    micro_batches: int | None = None  # None: gradient_accumulation_steps
    virtual_stages: int | None = None
    partition: str | list[int] = "parameters"

    def __post_init__(self) -> None:
        self.stages = as_int("pipeline.stages", self.stages, minimum=1)
        try:
            self.schedule = normalize_schedule(self.schedule)
        except ValueError as e:
            raise ValueError(f'"pipeline.schedule": {e}') from None
        if self.micro_batches is not None:
            self.micro_batches = as_int("pipeline.micro_batches", self.micro_batches, minimum=1)
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule == "interleaved_1f1b" else 1
        self.virtual_stages = as_int("pipeline.virtual_stages", self.virtual_stages, minimum=1)
        if isinstance(self.partition, str):
            if self.partition != "parameters":
                raise ValueError(f'"pipeline.partition"={self.partition!r} must be "parameters" or a list of '
                                 "block boundaries")
        elif not isinstance(self.partition, list) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                             for b in self.partition):
            raise TypeError(f'"pipeline.partition" must be "parameters" or a list of ints, got {self.partition!r}')

    @property
    def boundaries(self) -> list[int] | None:
        return None if isinstance(self.partition, str) else list(self.partition)


def pipeline_block(block: Any) -> PipelineConfig:
    check_keys("pipeline", block, _PIPELINE_KEYS, _PIPELINE_UNSUPPORTED)
    return PipelineConfig(**block)


@dataclass(kw_only=True)
class TensorParallelConfig:
    """``"tensor_parallel": {"size": tp}`` (llmpar's block)."""

    size: int = 1


def tensor_parallel_block(block: Any) -> TensorParallelConfig:
    check_keys("tensor_parallel", block, ["size"], {"tp_size": 'call it "size"', "autotp_size": 'call it "size"'})
    return TensorParallelConfig(size=as_int("tensor_parallel.size", block.get("size", 1), minimum=1))


__all__ = ["PipelineConfig", "TensorParallelConfig", "optimizer_block", "pipeline_block", "scheduler_block",
           "tensor_parallel_block", "zero_block"]
