"""The DeepSpeed JSON config, as llmpar reads it: ``Config.from_deepspeed(dict | path, dp=...)``.

Top-level keys (DeepSpeed's names and meaning):
    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp; any two of the three are
        enough (the third is inferred as DeepSpeed does, gradient_accumulation_steps defaulting to 1), an inconsistent
        triple is an error; none of the three: micro batch 1 (logged; DeepSpeed would refuse, but its own docs' snippet
        gives none)
    gradient_clipping (0 = off), steps_per_print (default 10), optimizer (-> llmpar.zero.OptimizerConfig; absent:
    AdamW lr=1e-3, logged), scheduler (-> llmpar.zero.lr_schedules.SchedulerConfig), bf16 / bfloat16 {enabled},
    zero_optimization (-> llmpar.zero.ZeroConfig)
llmpar's own blocks: pipeline (-> llmpar.pipeline.config.PipelineConfig; its micro_batches is
    gradient_accumulation_steps, as in DeepSpeed's PipelineEngine), tensor_parallel {size} (-> TensorParallelConfig)
An unknown key is an error naming the nearest valid key; a DeepSpeed key llmpar does not support yet is an error
saying so. The blocks are owned by the components that read them; this file only assembles and checks them.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from llmpar.zero.config import OptimizerConfig, ZeroConfig, as_bool, as_float, as_int, check_keys
from llmpar.zero.lr_schedules import SchedulerConfig

logger = logging.getLogger("llmpar")

_UNSUPPORTED = {
    "fp16": "fp16 with loss scaling is not supported; use bf16", "amp": "apex AMP is not supported; use bf16",
    "activation_checkpointing": "use torch.utils.checkpoint in the model",
    "sparse_attention": "not supported",
    "flops_profiler": "not supported", "tensorboard": "not supported", "wandb": "not supported",
    "csv_monitor": "not supported", "comet": "not supported", "comms_logger": "use llmpar CommCounter",
    "autotuning": "not supported", "elasticity": "not supported", "compression_training": "not supported",
    "data_efficiency": "not supported", "curriculum_learning": "not supported",
    "aio": "NVMe offload is not supported (CPU offload is)",
    "checkpoint": "DeepSpeed's checkpoint options are not supported (engine.save_checkpoint / load_checkpoint "
                  "are llmpar's: sharded, atomic, resharding on load)",
    "data_types": "not supported (bf16 reduces in bf16)",
    "communication_data_type": "not supported (gradients are reduced in the params' dtype)",
    "prescale_gradients": "not supported (llmpar always pre-divides by dp when packing)",
    "gradient_predivide_factor": "not supported", "sequence_parallel_size": "use llmpar tensor parallelism",
    "zero_allow_untested_optimizer": "only AdamW/Adam are supported", "zero_force_ds_cpu_optimizer": "not supported",
    "amp_enabled": "not supported",
}
_FLAGS_OFF_ONLY = ("wall_clock_breakdown", "memory_breakdown", "dump_state")  # accepted when false
_VALID = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
          "steps_per_print", "optimizer", "scheduler", "bf16", "bfloat16", "zero_optimization", "pipeline",
          "tensor_parallel", *_FLAGS_OFF_ONLY]


@dataclass(kw_only=True)
class TensorParallelConfig:
    """The ``"tensor_parallel": {"size": tp}`` block (llmpar's; used with ``pipeline``)."""

    size: int = 1

    @classmethod
    def from_dict(cls, block: Any) -> "TensorParallelConfig":
        check_keys("tensor_parallel", block, ["size"], {"tp_size": 'call it "size"', "autotp_size": 'call it "size"'})
        return cls(size=as_int("tensor_parallel.size", block.get("size", 1), minimum=1))


@dataclass(kw_only=True)
class Config:
    """A checked DeepSpeed config for a given data-parallel degree ``dp``."""

    dp: int
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    bf16: bool = False
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    optimizer_given: bool = True
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    pipeline: Any = None  # llmpar.pipeline.config.PipelineConfig when the config has a "pipeline" block
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_deepspeed(cls, config: dict | str | os.PathLike, *, dp: int) -> "Config":
        """Parse a DeepSpeed config (a dict, or a path to a JSON file) for ``dp`` data-parallel ranks."""
        if isinstance(config, (str, os.PathLike)):
            with open(config) as f:
                config = json.load(f)
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
        dp = as_int("dp", dp, minimum=1)
        raw = copy.deepcopy(config)
        check_keys("config", config, _VALID, _UNSUPPORTED)
        for flag in _FLAGS_OFF_ONLY:
            if as_bool(flag, config.get(flag, False)):
                raise ValueError(f'"{flag}": true is not supported by llmpar (leave it out or set it to false)')
        if "bf16" in config and "bfloat16" in config:
            raise ValueError('give "bf16" or its alias "bfloat16", not both')
        bf16_block = config.get("bf16", config.get("bfloat16", {}))
        check_keys("bf16", bf16_block, ["enabled"], {"immediate_grad_update": "not supported",
                                                     "check_grad_overflow": "not supported"})
        bf16 = as_bool("bf16.enabled", bf16_block.get("enabled", False))
        config = dict(config)  # _parallel_blocks may fill in gradient_accumulation_steps
        pipe, tp_cfg = _parallel_blocks(config)
        micro, gas, train = _batch_sizes(config, dp)
        if pipe is not None:
            pipe.micro_batches = gas
        clip = as_float("gradient_clipping", config.get("gradient_clipping", 0.0), minimum=0.0)
        steps_per_print = as_int("steps_per_print", config.get("steps_per_print", 10), minimum=1)
        given = "optimizer" in config
        opt = OptimizerConfig.from_dict(config["optimizer"]) if given else OptimizerConfig()
        if not given:
            logger.info("llmpar.initialize: no \"optimizer\" in the config: using AdamW with lr=1e-3")
        sched = SchedulerConfig.from_dict(config["scheduler"]) if "scheduler" in config else None
        zero = ZeroConfig.from_dict(config.get("zero_optimization", {}))
        return cls(dp=dp, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                   gradient_accumulation_steps=gas, gradient_clipping=clip, steps_per_print=steps_per_print,
                   bf16=bf16, optimizer=opt, optimizer_given=given, scheduler=sched, zero=zero, pipeline=pipe,
                   tensor_parallel=tp_cfg, raw=raw)

    def fingerprint(self) -> str:
        """Canonical JSON of what was given (for the cross-rank equality check)."""
        return json.dumps(self.raw, sort_keys=True, default=str)


def _parallel_blocks(config: dict[str, Any]) -> tuple[Any, TensorParallelConfig]:
    """The pipeline and tensor_parallel blocks. pipeline.micro_batches is gradient_accumulation_steps (DeepSpeed's
    PipelineEngine): one given fills in the other in ``config`` (a copy), both given must agree."""
    tp_cfg = TensorParallelConfig.from_dict(config.get("tensor_parallel", {}))
    if "pipeline" not in config:
        return None, tp_cfg
    from llmpar.pipeline.config import PipelineConfig

    pipe = PipelineConfig.from_dict(config["pipeline"])
    gas = config.get("gradient_accumulation_steps")
    if pipe.micro_batches is not None:
        if gas is not None and as_int("gradient_accumulation_steps", gas, minimum=1) != pipe.micro_batches:
            raise ValueError(f'"pipeline.micro_batches"={pipe.micro_batches} and "gradient_accumulation_steps"={gas} '
                             "disagree: a pipeline step runs gradient_accumulation_steps micro-batches (give one, or "
                             "both equal)")
        config["gradient_accumulation_steps"] = pipe.micro_batches
    return pipe, tp_cfg


def _batch_sizes(config: dict[str, Any], dp: int) -> tuple[int, int, int]:
    """(micro, gas, train) as DeepSpeed derives them, with its consistency rule train = micro * gas * dp."""
    get = {k: as_int(k, config[k], minimum=1) for k in
           ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if k in config}
    train, micro, gas = (get.get("train_batch_size"), get.get("train_micro_batch_size_per_gpu"),
                         get.get("gradient_accumulation_steps"))
    if train is None and micro is None and gas is None:  # DeepSpeed asserts here; its docs' snippets give none
        logger.info("llmpar.initialize: no batch size in the config: train_micro_batch_size_per_gpu=1")
        micro = 1
    if train is None and micro is None:
        raise ValueError('give "train_batch_size" or "train_micro_batch_size_per_gpu" (or both)')
    if train is not None and micro is not None and gas is None:
        gas = train // (micro * dp)
    elif train is not None and micro is None:
        gas = gas or 1
        micro = train // (gas * dp)
    elif train is None:
        gas = gas or 1
        train = micro * gas * dp
    if not micro or not gas or train != micro * gas * dp:
        raise ValueError(f"batch sizes are inconsistent: train_batch_size={train} must equal "
                         f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} x dp={dp} "
                         f"(= {(micro or 0) * (gas or 0) * dp})")
    return micro, gas, train


class DeepSpeedAccessors:
    """DeepSpeed engine accessors shared by llmpar's engines (they hold ``config`` and ``optimizer``)."""

    config: Config
    optimizer: Any

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.last_grad_norm

    # checkpoints (llmpar.checkpoint): every rank writes its own shards, one metadata.json for the run; params are
    # named as in the unsplit model, so a checkpoint loads at another dp / tp / pp degree, ZeRO stage or engine kind
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        async_save: bool = False) -> str:
        """Sharded, atomic checkpoint ``save_dir/tag`` (default ``global_step{N}``), collective over the engine's
        ranks; see ``llmpar.checkpoint``. ``async_save``: written by a thread from a host copy, published at the next
        ``wait_checkpoint`` / ``save_checkpoint`` / ``load_checkpoint``."""
        from llmpar.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, async_save=async_save)

    def wait_checkpoint(self) -> str | None:
        """Publish the pending async save (collective); its path, or None if none was pending."""
        from llmpar.checkpoint import wait_checkpoint

        return wait_checkpoint(self)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str, dict | None]:
        """Load ``load_dir/tag`` (default: ``latest``), saved at any dp / tp / pp degree, ZeRO stage or offload;
        returns (path, client_state)."""
        from llmpar.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag)
