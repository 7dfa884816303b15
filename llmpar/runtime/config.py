"""The DeepSpeed JSON config, read once: ``read_config(dict | path)`` -> the raw dict (a file is opened once, its
name in every error), ``Blocks.parse(raw)`` -> every block typed and checked, and the (pp, tp) degrees the mesh
needs, then ``Config.from_blocks(blocks, dp=...)`` -> the batch sizes for ``dp`` data-parallel ranks
(``Config.from_deepspeed(dict | path, dp=...)`` does all three).

Top-level keys (DeepSpeed's names and meaning):
    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp; any two of the three are
        enough (the third is inferred as DeepSpeed does, gradient_accumulation_steps defaulting to 1), an inconsistent
        triple is an error; none of the three: micro batch 1 (logged; DeepSpeed would refuse, but its own docs' snippet
        gives none)
    gradient_clipping (0 = off), steps_per_print (default 10), optimizer (absent: AdamW lr=1e-3, logged), scheduler,
    bf16 / bfloat16 {enabled}, zero_optimization -- each block read by ``blocks.py`` into its component's config
llmpar's own blocks: pipeline (its micro_batches is gradient_accumulation_steps, as in DeepSpeed's PipelineEngine),
    tensor_parallel {size}
An unknown key is an error naming the nearest valid key; a DeepSpeed key llmpar does not support yet is an error
saying so.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from llmpar.runtime.blocks import (PipelineConfig, TensorParallelConfig, optimizer_block, pipeline_block,
                                   scheduler_block, tensor_parallel_block, zero_block)
from llmpar.runtime.schedules import SchedulerConfig
from llmpar.validation import as_bool, as_float, as_int, check_keys
from llmpar.zero.config import OptimizerConfig, ZeroConfig

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


def read_config(config: Any) -> dict:
    """The config as a dict: a dict as given (copied), or a JSON file read once (errors name the file)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path}: not valid JSON: {e}") from None
        except OSError as e:
            raise ValueError(f"config file {path} cannot be read: {e.strerror or e}") from None
        if not isinstance(config, dict):
            raise TypeError(f"config file {path} must hold a JSON object, got {type(config).__name__}")
        return config
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
    return copy.deepcopy(config)


@dataclass(kw_only=True)
class Blocks:
    """Everything in the config that does not depend on the number of data-parallel ranks, parsed and checked
    once: the parallel degrees come from here before the mesh exists, the batch sizes after (``Config``)."""

    raw: dict
    bf16: bool = False
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    optimizer_given: bool = True
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    pipeline: PipelineConfig | None = None
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)

    @classmethod
    def parse(cls, raw: dict) -> "Blocks":
        check_keys("config", raw, _VALID, _UNSUPPORTED)
        for flag in _FLAGS_OFF_ONLY:
            if as_bool(flag, raw.get(flag, False)):
                raise ValueError(f'"{flag}": true is not supported by llmpar (leave it out or set it to false)')
        if "bf16" in raw and "bfloat16" in raw:
            raise ValueError('give "bf16" or its alias "bfloat16", not both')
        bf16_block = raw.get("bf16", raw.get("bfloat16", {}))
        check_keys("bf16", bf16_block, ["enabled"], {"immediate_grad_update": "not supported",
                                                     "check_grad_overflow": "not supported"})
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if key in raw:
                as_int(key, raw[key], minimum=1)
        given = "optimizer" in raw
        return cls(raw=raw, bf16=as_bool("bf16.enabled", bf16_block.get("enabled", False)),
                   gradient_clipping=as_float("gradient_clipping", raw.get("gradient_clipping", 0.0), minimum=0.0),
                   steps_per_print=as_int("steps_per_print", raw.get("steps_per_print", 10), minimum=1),
                   optimizer=optimizer_block(raw["optimizer"]) if given else OptimizerConfig(), optimizer_given=given,
                   scheduler=scheduler_block(raw["scheduler"]) if "scheduler" in raw else None,
                   zero=zero_block(raw.get("zero_optimization", {})),
                   pipeline=pipeline_block(raw["pipeline"]) if "pipeline" in raw else None,
                   tensor_parallel=tensor_parallel_block(raw.get("tensor_parallel", {})))

    @property
    def degrees(self) -> tuple[int, int]:
        """(pp, tp): what the mesh needs before dp is known."""
        return (self.pipeline.stages if self.pipeline is not None else 1), self.tensor_parallel.size


@dataclass(kw_only=True)
class Config(Blocks):
    """A checked DeepSpeed config for a given data-parallel degree ``dp``: the blocks and the batch sizes."""

    dp: int
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_deepspeed(cls, config: Any, *, dp: int) -> "Config":
        """Parse a DeepSpeed config (a dict, or a path to a JSON file) for ``dp`` data-parallel ranks."""
        return cls.from_blocks(Blocks.parse(read_config(config)), dp=dp)

    @classmethod
    def from_blocks(cls, blocks: Blocks, *, dp: int) -> "Config":
        """The config of ``blocks`` for ``dp`` data-parallel ranks: the batch sizes, as DeepSpeed derives them."""
        dp = as_int("dp", dp, minimum=1)
        pipe = copy.deepcopy(blocks.pipeline)
        micro, gas, train = _batch_sizes(blocks.raw, dp, pipe)
        if pipe is not None:
            pipe.micro_batches = gas
        if not blocks.optimizer_given:
            logger.info("llmpar.initialize: no \"optimizer\" in the config: using AdamW with lr=1e-3")
        given = {f.name: getattr(blocks, f.name) for f in fields(Blocks)}
        return cls(**{**given, "pipeline": pipe}, dp=dp, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                   gradient_accumulation_steps=gas)

    def fingerprint(self) -> str:
        """Canonical JSON of what was given (for the cross-rank equality check)."""
        return json.dumps(self.raw, sort_keys=True, default=str)


def _batch_sizes(raw: dict[str, Any], dp: int, pipe: PipelineConfig | None) -> tuple[int, int, int]:
    """(micro, gas, train) as DeepSpeed derives them, with its consistency rule train = micro * gas * dp. A pipeline's
    micro_batches is gradient_accumulation_steps (DeepSpeed's PipelineEngine): one given fills in the other."""
    get = {k: as_int(k, raw[k], minimum=1) for k in
           ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if k in raw}
    train, micro, gas = (get.get("train_batch_size"), get.get("train_micro_batch_size_per_gpu"),
                         get.get("gradient_accumulation_steps"))
    if pipe is not None and pipe.micro_batches is not None:
        if gas is not None and gas != pipe.micro_batches:
            raise ValueError(f'"pipeline.micro_batches"={pipe.micro_batches} and "gradient_accumulation_steps"={gas} '
                             "disagree: a pipeline step runs gradient_accumulation_steps micro-batches (give one, or "
                             "both equal)")
        gas = pipe.micro_batches
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


__all__ = ["Blocks", "Config", "read_config"]
