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
    bf16 / bfloat16 {enabled}, zero_optimization -- each block read by ``blocks.py`` into its component's config;
    tensorboard / csv_monitor / wandb (``monitor.py``), checkpoint {load_universal, auto_resume,
    auto_resume_interval} (``resume.py``), compile {deepcompile, passes, ...} (``compile.py``: DeepCompile's settings,
    checked, without effect; ``engine.compile()`` compiles)
llmpar's own blocks: pipeline (its micro_batches is gradient_accumulation_steps, as in DeepSpeed's PipelineEngine),
    tensor_parallel {size}, context_parallel {size, mode, ulysses_size} (``blocks.context_parallel_block``;
    DeepSpeed's top-level sequence_parallel_size=N is its Ulysses form, {"size": N, "mode": "ulysses"})
DeepSpeed 0.19's AutoEP block: expert_parallel {enabled, autoep_size, preset_model, top_k, score_func, route_norm,
    ...} (``expert_block.py``)
An unknown key is an error naming the nearest valid key; a DeepSpeed key llmpar does not support yet is an error
saying so. Every block is typed here, once: the engines and the integrations read ``Blocks`` / ``Config``, never the
raw dict (``raw`` is kept for the cross-rank fingerprint and the batch-size arithmetic, both in this module).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from llmpar.runtime.blocks import (
    PARALLEL_KEYS,
    ActivationCheckpointingConfig,
    ContextParallelConfig,
    ExpertParallelConfig,
    Fp16Config,
    ParallelBlocks,
    PipelineConfig,
    TensorParallelConfig,
    activation_checkpointing_block,
    expert_parallel_block,
    fp16_block,
    optimizer_block,
    parallel_blocks,
    scheduler_block,
    zero_block,
)
from llmpar.runtime.compile import CompileConfig, compile_block
from llmpar.runtime.ds_keys import TOP, strip_inert
from llmpar.runtime.monitor import BLOCKS as MONITORS
from llmpar.runtime.monitor import MonitorConfig, monitor_config
from llmpar.runtime.resume import CheckpointConfig, checkpoint_block
from llmpar.runtime.schedules import SchedulerConfig
from llmpar.validation import FLOAT32_MAX, FLOAT32_TINY, as_bool, as_float, as_int, check_keys
from llmpar.zero.config import OptimizerConfig, ZeroConfig

logger = logging.getLogger("llmpar")

_VALID = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "optimizer",
    "scheduler",
    "bf16",
    "bfloat16",
    "fp16",
    "zero_optimization",
    "pipeline",
    "tensor_parallel",
    "activation_checkpointing",
    "context_parallel",
    "sequence_parallel_size",
    "expert_parallel",
    "checkpoint",
    "compile",
    *MONITORS,
]


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
    fp16: Fp16Config = field(default_factory=Fp16Config)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    optimizer_given: bool = True
    optimizer_params: dict = field(default_factory=dict)  # "optimizer.params" as given (engine.optimizer_params())
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    pipeline: PipelineConfig | None = None
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    tensor_parallel_given: bool = False
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)  # DeepCompile's settings (runtime/compile.py)

    @classmethod
    def parse(cls, raw: dict) -> "Blocks":
        """Check and type every block of ``raw`` (DeepSpeed's keys at their default / disabled values are accepted
        and dropped first: ``ds_keys.strip_inert``)."""
        given = strip_inert(raw)
        check_keys("config", given, _VALID)
        if "bf16" in given and "bfloat16" in given:
            raise ValueError('give "bf16" or its alias "bfloat16", not both')
        bf16_block = given.get("bf16", given.get("bfloat16", {}))
        check_keys("bf16", bf16_block, ["enabled"])
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if key in given:
                if given[key] == "auto":
                    raise ValueError(
                        f'"{key}"="auto": not supported here: "auto" values are filled in by the '
                        "HuggingFace integration; give a number"
                    )
                as_int(key, given[key], minimum=1)
        fp16 = fp16_block(given.get("fp16", {}))
        bf16 = as_bool("bf16.enabled", bf16_block.get("enabled", False))
        if fp16.enabled and bf16:
            raise ValueError('"fp16.enabled" and "bf16.enabled" are both true: pick one precision')
        opt_given = "optimizer" in given
        ckpt = given.get("activation_checkpointing")
        par = parallel_blocks(given)
        opt = optimizer_block(given["optimizer"]) if opt_given else OptimizerConfig()
        return cls(
            raw=raw,
            bf16=bf16,
            fp16=fp16,
            gradient_clipping=_clipping(given.get("gradient_clipping", 0.0)),
            steps_per_print=as_int("steps_per_print", given.get("steps_per_print", 10), minimum=1),
            optimizer=opt,
            optimizer_given=opt_given,
            optimizer_params=copy.deepcopy(raw["optimizer"].get("params", {})) if opt_given else {},
            scheduler=scheduler_block(given["scheduler"]) if "scheduler" in given else None,
            zero=zero_block(given.get("zero_optimization", {})),
            pipeline=par.pipeline,
            tensor_parallel=par.tensor_parallel,
            tensor_parallel_given=par.tensor_parallel_given,
            context_parallel=par.context_parallel,
            expert_parallel=expert_parallel_block(given.get("expert_parallel")),
            activation_checkpointing=activation_checkpointing_block(ckpt)
            if ckpt is not None
            else ActivationCheckpointingConfig(),
            checkpoint=checkpoint_block(given.get("checkpoint"), tuple(TOP["checkpoint"])),
            monitor=monitor_config(given),
            compile=compile_block(given.get("compile")),
        )

    @staticmethod
    def parallel_of(raw: dict) -> ParallelBlocks:
        """The parallel blocks of ``raw`` alone (``pipeline``, ``tensor_parallel``, ``context_parallel`` /
        ``sequence_parallel_size``), checked as :meth:`parse` checks them: the degrees for callers whose config may
        still hold ``"auto"`` values in other blocks (the HF integrations, before they fill them)."""
        if not isinstance(raw, dict):
            raise TypeError(f"config must be a dict (a DeepSpeed config), got {type(raw).__name__}")
        return parallel_blocks(strip_inert({k: raw[k] for k in PARALLEL_KEYS if k in raw}))

    @property
    def degrees(self) -> tuple[int, int]:
        """(pp, tp): what the mesh needs before dp is known (pp 1 for ``"stages": "auto"``: the PipelineModule's)."""
        return (self.pipeline.stages or 1 if self.pipeline is not None else 1), self.tensor_parallel.size

    def fingerprint(self) -> str:
        """Canonical JSON of what was given (for the cross-rank equality check)."""
        return json.dumps(self.raw, sort_keys=True, default=str)


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
        blocks.zero.check_dp(dp)
        if pipe is not None:
            pipe.micro_batches = gas
        if not blocks.optimizer_given:
            logger.info('llmpar.initialize: no "optimizer" in the config: using AdamW with lr=1e-3')
        given = {f.name: getattr(blocks, f.name) for f in fields(Blocks)}
        return cls(
            **{**given, "pipeline": pipe},
            dp=dp,
            train_batch_size=train,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=gas,
        )


def _clipping(value: Any) -> float:
    """``gradient_clipping``: 0 (off) or a max norm in [FLOAT32_TINY, FLOAT32_MAX] (the clip coefficient is computed
    in float32: a smaller one rounds to 0 and silently stops training)."""
    value = as_float("gradient_clipping", value, minimum=0.0, maximum=FLOAT32_MAX)
    if 0.0 < value < FLOAT32_TINY:
        raise ValueError(
            f'"gradient_clipping"={value} must be 0 (off) or in [{FLOAT32_TINY:g}, {FLOAT32_MAX:g}] '
            "(the clip coefficient is a float32)"
        )
    return value


def _batch_sizes(raw: dict[str, Any], dp: int, pipe: PipelineConfig | None) -> tuple[int, int, int]:
    """(micro, gas, train) as DeepSpeed derives them, with its consistency rule train = micro * gas * dp. A pipeline's
    micro_batches is gradient_accumulation_steps (DeepSpeed's PipelineEngine): one given fills in the other."""
    get = {
        k: as_int(k, raw[k], minimum=1)
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        if k in raw
    }
    train, micro, gas = (
        get.get("train_batch_size"),
        get.get("train_micro_batch_size_per_gpu"),
        get.get("gradient_accumulation_steps"),
    )
    if pipe is not None and pipe.micro_batches is not None:
        if gas is not None and gas != pipe.micro_batches:
            raise ValueError(
                f'"pipeline.micro_batches"={pipe.micro_batches} and "gradient_accumulation_steps"={gas} '
                "disagree: a pipeline step runs gradient_accumulation_steps micro-batches (give one, or "
                "both equal)"
            )
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
        raise ValueError(
            f"batch sizes are inconsistent: train_batch_size={train} must equal "
            f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} x dp={dp} "
            f"(= {(micro or 0) * (gas or 0) * dp})"
        )
    return micro, gas, train


__all__ = ["Blocks", "Config", "read_config"]
