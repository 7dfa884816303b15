"""The DeepSpeed JSON blocks, as llmpar reads them, each turned into the typed config of the component that acts on it:

    "zero_optimization" -> llmpar.zero.ZeroConfig        "optimizer" -> llmpar.zero.OptimizerConfig
    "scheduler"         -> runtime.schedules.SchedulerConfig
    "pipeline"          -> PipelineConfig (below)        "tensor_parallel" -> TensorParallelConfig (below)
    "context_parallel"  -> ContextParallelConfig (below; DeepSpeed's "sequence_parallel_size" is its Ulysses form)
    "expert_parallel"   -> ExpertParallelConfig (DeepSpeed's AutoEP block; ``expert_block.py``)

The three parallel blocks give the degrees the mesh needs before the data-parallel degree is known
(:func:`parallel_blocks`): read here once for ``initialize`` and for the integrations, which need the degrees before
they fill the config's ``"auto"`` values; context parallelism with a pipeline is refused in one place
(:func:`refuse_cp_with_pipeline`), for a ``"pipeline"`` block and for a ``PipelineModule`` alike.

DeepSpeed's spelling lives here only: its aliases (``gather_16bit_weights_on_model_save``, ``adam_w_mode``, ...),
its implementation switches (``torch_adam``, ``fused``) and the keys llmpar does not support, each an error saying so.
An unknown key is an error naming the nearest valid one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from llmpar.pipeline.schedules import normalize_schedule
from llmpar.runtime.expert_block import ExpertParallelConfig, expert_parallel_block  # noqa: F401  (re-exported)
from llmpar.runtime.schedules import SchedulerConfig
from llmpar.validation import as_bool, as_int, check_keys, nearest
from llmpar.zero.config import OPTIMIZER_TYPES, OffloadConfig, OptimizerConfig, ZeroConfig
from llmpar.zero.loss_scale import check_scaling

_UNSUPPORTED_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Lion", "Adagrad", "Muon", "SGD")
_OPTIMIZER_PARAMS = [
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "precision",
    "state_precision",
    "stochastic_rounding",
    "seed",
]
_SCHEDULER_PARAMS = {  # the params block each schedule takes
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps"),
}


# the name llmpar's ZeroConfig keeps, and DeepSpeed's other names for it: ``gather_16bit_weights_on_model_save`` (its
# field name; the ``stage3_`` form is its alias) and the older ``stage3_gather_fp16_weights_on_model_save``
_GATHER_16BIT = (
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
)


def zero_block(block: Any) -> ZeroConfig:
    """``"zero_optimization"`` -> :class:`ZeroConfig`."""
    check_keys("zero_optimization", block, [f.name for f in fields(ZeroConfig)] + list(_GATHER_16BIT[1:]))
    d = dict(block)
    given = [k for k in _GATHER_16BIT if k in d]
    if len(given) > 1:
        raise ValueError(
            f"zero_optimization: {' and '.join(repr(k) for k in given)} are one setting under several "
            "names (DeepSpeed's aliases): give one of them"
        )
    if given:
        d[_GATHER_16BIT[0]] = d.pop(given[0])
    for key in ("offload_optimizer", "offload_param"):
        if d.get(key) is not None:
            check_keys(f"zero_optimization.{key}", d[key], ["device", "pin_memory"])
            d[key] = OffloadConfig(**d[key])
    return ZeroConfig(**d)


def optimizer_block(block: Any) -> OptimizerConfig:
    """``"optimizer": {"type": "AdamW" | "Adam" | "AdamW8bit" | "AdamW4bit", "params": {...}}`` ->
    :class:`OptimizerConfig` (the 8/4-bit types: AdamW with quantized moments, ``llmpar.ops.lowbit``)."""
    check_keys("optimizer", block, ["type", "params"])
    if "type" not in block:
        raise ValueError('"optimizer" needs a "type" (AdamW, Adam, AdamW8bit or AdamW4bit)')
    typ = block["type"]
    if not isinstance(typ, str) or typ.lower() not in OPTIMIZER_TYPES:
        if isinstance(typ, str) and typ.lower() in {t.lower() for t in _UNSUPPORTED_OPTIMIZERS}:
            raise ValueError(
                f'"optimizer.type"={typ!r} is a DeepSpeed optimizer llmpar does not support; '
                "use AdamW, Adam, AdamW8bit or AdamW4bit"
            )
        raise ValueError(
            f'"optimizer.type"={typ!r} is not known{nearest(str(typ), list(OPTIMIZER_TYPES.values()))}; '
            "use AdamW, Adam, AdamW8bit or AdamW4bit"
        )
    params = block.get("params", {})
    check_keys("optimizer.params", params, _OPTIMIZER_PARAMS)  # DeepSpeed's switches were taken out by ds_keys
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
_PIPELINE_UNSUPPORTED = {"use_reentrant": 'not supported (the "activation_checkpointing" block checkpoints blocks)'}


@dataclass(kw_only=True)
class PipelineConfig:
    """``"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 8}`` (llmpar's block; DeepSpeed keeps these in
    its ``PipelineModule``). stages: pp (>= 1); schedule: gpipe, 1f1b (default) or interleaved_1f1b; micro_batches:
    *is* gradient_accumulation_steps (give either, or both equal); virtual_stages: stages per rank (default 2 for
    interleaved_1f1b, else 1); partition: "parameters" (balanced parameter counts; DeepSpeed's "best" means the
    same) or the first block index of stages 1..S-1. DeepSpeed's ``"stages": "auto"`` (None here) takes the stage
    count of the ``PipelineModule`` given to ``initialize``."""

    stages: int | None = 1
    schedule: str = "1f1b"
    micro_batches: int | None = None  # None: gradient_accumulation_steps
    virtual_stages: int | None = None
    partition: str | list[int] = "parameters"
    schedule_given: bool = False  # not a key: the block named a schedule (a PipelineModule's default depends on it)

    def __post_init__(self) -> None:
        if self.stages in ("auto", None):
            self.stages = None
        else:
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
            self.partition = "parameters" if self.partition == "best" else self.partition
            if self.partition != "parameters":
                raise ValueError(
                    f'"pipeline.partition"={self.partition!r} must be "parameters" or a list of block boundaries'
                )
        elif not isinstance(self.partition, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in self.partition
        ):
            raise TypeError(f'"pipeline.partition" must be "parameters" or a list of ints, got {self.partition!r}')

    @property
    def boundaries(self) -> list[int] | None:
        return None if isinstance(self.partition, str) else list(self.partition)


def pipeline_block(block: Any) -> PipelineConfig:
    check_keys("pipeline", block, _PIPELINE_KEYS, _PIPELINE_UNSUPPORTED)
    return PipelineConfig(**block, schedule_given="schedule" in block)


@dataclass(kw_only=True)
class TensorParallelConfig:
    """``"tensor_parallel": {"size": tp}`` (llmpar's block)."""

    size: int = 1


def tensor_parallel_block(block: Any) -> TensorParallelConfig:
    """``"tensor_parallel": {"size": tp}`` or DeepSpeed's ``{"autotp_size": tp}`` (AutoTP: ``llmpar.parallelize``
    splits the model); DeepSpeed's default ``"autotp_size": 0`` means off, as ``1``."""
    check_keys("tensor_parallel", block, ["size", "autotp_size"], {"tp_size": 'call it "size"'})
    if "size" in block and "autotp_size" in block:
        raise ValueError('give "tensor_parallel.size" or DeepSpeed\'s "autotp_size", not both')
    if "autotp_size" in block:
        size = as_int("tensor_parallel.autotp_size", block["autotp_size"], minimum=0)
        return TensorParallelConfig(size=max(size, 1))
    return TensorParallelConfig(size=as_int("tensor_parallel.size", block.get("size", 1), minimum=1))


CP_MODES = ("ulysses", "ring", "hybrid")


@dataclass(kw_only=True)
class ContextParallelConfig:
    """``"context_parallel"``: ``size`` ranks split each sequence (1: off). ``mode``: "ulysses" (all-to-all of heads
    <-> sequence over all ``size`` ranks), "ring" (key/value blocks passed around ``size`` ranks), "hybrid" (Ulysses
    over ``ulysses_size`` adjacent ranks, ring across the ``size / ulysses_size`` groups). ``ulysses_size`` is the
    Ulysses part: ``size`` for "ulysses", 1 for "ring"."""

    size: int = 1
    mode: str = "ulysses"
    ulysses_size: int = 1

    @property
    def ring_size(self) -> int:
        return self.size // self.ulysses_size


def context_parallel_block(block: Any, sequence_parallel_size: Any = None) -> ContextParallelConfig:
    """``"context_parallel": {"size": N, "mode": "ulysses" | "ring" | "hybrid", "ulysses_size": k}`` and/or DeepSpeed's
    ``"sequence_parallel_size": N`` (Ulysses over N ranks) -> :class:`ContextParallelConfig`; both given must agree."""
    if block is None:
        block = {}
    check_keys("context_parallel", block, ["size", "mode", "ulysses_size"])
    size = as_int("context_parallel.size", block.get("size", 1), minimum=1)
    mode = block.get("mode", "ulysses")
    if mode not in CP_MODES:
        raise ValueError(f'"context_parallel.mode"={mode!r} is not valid: expected one of {", ".join(CP_MODES)}')
    if sequence_parallel_size is not None:
        sp = as_int("sequence_parallel_size", sequence_parallel_size, minimum=1)
        if block and sp != 1 and (("size" in block and size != sp) or mode != "ulysses"):
            raise ValueError(
                f'"sequence_parallel_size"={sp} (Ulysses over {sp} ranks, as in DeepSpeed) and '
                f'"context_parallel" {json.dumps(block)} disagree: give one of them'
            )
        if not block:
            size = sp
        elif "size" not in block and sp != 1:
            size = sp
    default_u = {"ulysses": size, "ring": 1, "hybrid": None}[mode]
    if "ulysses_size" not in block and default_u is None:
        raise ValueError(
            f'"context_parallel.mode"="hybrid" needs "context_parallel.ulysses_size": the Ulysses part, '
            f"a divisor of size={size}"
        )
    u = as_int("context_parallel.ulysses_size", block.get("ulysses_size", default_u), minimum=1)
    if default_u is not None and u != default_u:
        raise ValueError(
            f'"context_parallel.ulysses_size"={u} is not valid with mode "{mode}" and size={size}: '
            f'it is {default_u} there (use mode "hybrid" to mix Ulysses and ring)'
        )
    if size % u:
        raise ValueError(
            f'"context_parallel.ulysses_size"={u} does not divide "context_parallel.size"={size}: '
            f"the hybrid mode runs Ulysses over ulysses_size ranks and ring across size/ulysses_size"
        )
    return ContextParallelConfig(size=size, mode=mode, ulysses_size=u)


def refuse_cp_with_pipeline(cp: ContextParallelConfig, pipeline: str) -> None:
    """The one rule for context parallelism with a pipeline (``pipeline`` names it: a "pipeline" block, a
    PipelineModule): refused, a ValueError naming both."""
    if cp.size > 1:
        raise ValueError(
            f'"context_parallel.size"={cp.size} (or "sequence_parallel_size") with {pipeline}: context '
            "parallelism is not supported with pipeline parallelism; use one of them"
        )


# the top-level keys of the parallel blocks: what parallel_blocks reads
PARALLEL_KEYS = ("pipeline", "tensor_parallel", "context_parallel", "sequence_parallel_size")


@dataclass(frozen=True, kw_only=True)
class ParallelBlocks:
    """The blocks that give the parallel degrees, parsed and checked. ``tensor_parallel_given``: the config has a
    "tensor_parallel" block (its size must then match a tp_group given to initialize)."""

    pipeline: PipelineConfig | None = None
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    tensor_parallel_given: bool = False
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)


def parallel_blocks(given: dict) -> ParallelBlocks:
    """The parallel blocks of a config (its :data:`PARALLEL_KEYS`, DeepSpeed's inert keys already dropped)."""
    cp = context_parallel_block(given.get("context_parallel"), given.get("sequence_parallel_size"))
    if "pipeline" in given:
        refuse_cp_with_pipeline(cp, 'a "pipeline" block')
    return ParallelBlocks(
        pipeline=pipeline_block(given["pipeline"]) if "pipeline" in given else None,
        tensor_parallel=tensor_parallel_block(given.get("tensor_parallel", {})),
        tensor_parallel_given="tensor_parallel" in given,
        context_parallel=cp,
    )


@dataclass(kw_only=True)
class Fp16Config:
    """``"fp16"``: float16 params with fp32 masters and loss scaling (``loss_scale`` 0: dynamic, starting at
    2**initial_scale_power, halved on an overflow after ``hysteresis`` overflows, doubled after ``loss_scale_window``
    clean steps, never below ``min_loss_scale``), DeepSpeed's semantics and defaults."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False

    def __post_init__(self) -> None:
        self.enabled = as_bool("fp16.enabled", self.enabled)
        checked = check_scaling(
            loss_scale=self.loss_scale,
            initial_scale_power=self.initial_scale_power,
            loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            min_loss_scale=self.min_loss_scale,
        )  # the LossScaler's own ranges, at parse time
        for name, value in checked.items():
            setattr(self, name, value)
        self.auto_cast = as_bool("fp16.auto_cast", self.auto_cast)
        if self.auto_cast:
            raise ValueError(
                '"fp16.auto_cast"=true: not supported: the model runs in float16 (autocast inside the engine is not)'
            )


def fp16_block(block: Any) -> Fp16Config:
    check_keys("fp16", block, [f.name for f in fields(Fp16Config)])
    return Fp16Config(**block)


@dataclass(kw_only=True)
class ActivationCheckpointingConfig:
    """``"activation_checkpointing"``: present (``enabled``) means the blocks the model exposes are recomputed in
    backward; ``cpu_checkpointing`` keeps the saved inputs on the host; the other keys as DeepSpeed's."""

    enabled: bool = False
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        for name in (
            "enabled",
            "partition_activations",
            "cpu_checkpointing",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
            "profile",
        ):
            setattr(self, name, as_bool(f"activation_checkpointing.{name}", getattr(self, name)))
        if self.number_checkpoints is not None:
            self.number_checkpoints = as_int(
                "activation_checkpointing.number_checkpoints", self.number_checkpoints, minimum=1
            )


def activation_checkpointing_block(block: Any) -> ActivationCheckpointingConfig:
    keys = [f.name for f in fields(ActivationCheckpointingConfig) if f.name != "enabled"]
    check_keys("activation_checkpointing", block, keys)
    return ActivationCheckpointingConfig(enabled=True, **block)


__all__ = [
    "CP_MODES",
    "PARALLEL_KEYS",
    "ActivationCheckpointingConfig",
    "ContextParallelConfig",
    "Fp16Config",
    "ParallelBlocks",
    "PipelineConfig",
    "TensorParallelConfig",
    "activation_checkpointing_block",
    "context_parallel_block",
    "fp16_block",
    "optimizer_block",
    "parallel_blocks",
    "pipeline_block",
    "refuse_cp_with_pipeline",
    "scheduler_block",
    "tensor_parallel_block",
    "zero_block",
]
