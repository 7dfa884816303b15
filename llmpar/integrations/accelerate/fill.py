"""The DeepSpeed config as accelerate fills it for its DeepSpeed route (``Accelerator._prepare_deepspeed``), and the
checks of the objects handed to ``prepare``: the plugin (given or from ``accelerate launch``'s environment), the
``"auto"`` values, the optimizer / scheduler against the config's blocks, what the engine under accelerate does not run.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch.utils.data import DataLoader

from llmpar.integrations.buckets import BUCKET_KEYS, bucket_sizes, hidden_size
from llmpar.runtime.config import Blocks

# DeepSpeed's LR schedule classes (deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES): objects of these are handed
# to the engine, as accelerate hands them to deepspeed.initialize
DS_SCHEDULES = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "WarmupCosineDecayLR")


def is_ds_schedule(obj: Any) -> bool:
    """``obj`` is one of DeepSpeed's LR schedule objects (by class name, as accelerate tells them)."""
    return type(obj).__name__ in DS_SCHEDULES and hasattr(obj, "step")


def one_plugin(plugin: Any, plugins: Any) -> DeepSpeedPlugin | None:
    """The DeepSpeed plugin of the arguments, or of the environment (``accelerate launch`` with DeepSpeed)."""
    if plugin is not None and plugins is not None:
        raise ValueError("pass deepspeed_plugin= or deepspeed_plugins=, not both")
    plugin = plugin if plugin is not None else plugins
    if isinstance(plugin, dict):
        if len(plugin) != 1:
            raise ValueError(
                f"deepspeed_plugins has {len(plugin)} plugins ({sorted(plugin)}): llmpar's Accelerator "
                "drives one engine; pass one DeepSpeedPlugin"
            )
        plugin = next(iter(plugin.values()))
    if plugin is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        plugin = DeepSpeedPlugin()
    if plugin is not None and not isinstance(plugin, DeepSpeedPlugin):
        raise TypeError(f"deepspeed_plugin must be an accelerate DeepSpeedPlugin, got {type(plugin).__name__}")
    return plugin


def check_objects(config: dict, optimizer: Any, scheduler: Any) -> None:
    """accelerate's rules for the optimizer / scheduler against the config's blocks, and what the engine under
    accelerate does not run."""
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ValueError(
                f"prepare() got optimizer {type(optimizer).__name__} and the DeepSpeed config has an "
                '"optimizer" block: remove the block, or pass accelerate.utils.DummyOptim'
            )
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ValueError(
                'prepare() got a DummyOptim but the DeepSpeed config has no "optimizer" block: add '
                "one, or pass a torch optimizer"
            )
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                f"prepare() got scheduler {type(scheduler).__name__} and the DeepSpeed config has a "
                '"scheduler" block: remove the block, or pass accelerate.utils.DummyScheduler'
            )
        if (
            "scheduler" not in config
            and isinstance(scheduler, DummyScheduler)
            and scheduler.lr_scheduler_callable is None
        ):
            raise ValueError(
                "prepare() got a DummyScheduler without lr_scheduler_callable but the DeepSpeed config "
                'has no "scheduler" block: add one, or give DummyScheduler(lr_scheduler_callable=)'
            )
        if optimizer is None and not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                f"prepare() got scheduler {type(scheduler).__name__} without its optimizer: pass both "
                "in the same prepare() call"
            )
        if isinstance(optimizer, DummyOptim) and not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                f"prepare() got a DummyOptim with scheduler {type(scheduler).__name__}: with "
                "DummyOptim pass a DummyScheduler (lr_scheduler_callable= for a torch schedule)"
            )
    parallel = Blocks.parallel_of(config)
    if parallel.tensor_parallel.size > 1:
        raise ValueError(
            f'"tensor_parallel"={config["tensor_parallel"]}: not supported through accelerate (its dataloaders shard '
            "over every process); use llmpar.initialize or llmpar.integrations.transformers"
        )
    if parallel.pipeline is not None:
        raise ValueError(
            '"pipeline": a pipeline engine trains with engine.train_batch(), not accelerate\'s loop; '
            "use llmpar.initialize"
        )


def hidden_size_autos(plugin: DeepSpeedPlugin, model: torch.nn.Module) -> dict[str, int]:
    """accelerate's "auto" bucket sizes from the model's hidden size (``llmpar.integrations.buckets``: the
    Trainer's rule too)."""
    autos = [k for k in BUCKET_KEYS if plugin.is_auto(k)]
    if not autos:
        return {}
    hidden = hidden_size(model)
    if hidden is None:
        raise ValueError(
            f'{autos} are "auto", filled from model.config.hidden_size, which this '
            f"{type(model).__name__} does not have: give them integers in the DeepSpeed config"
        )
    return bucket_sizes(hidden)


def micro_batch(plugin: DeepSpeedPlugin, args: tuple, split: int) -> int | None:
    """train_micro_batch_size_per_gpu: the config's, or for "auto" the batch size of the dataloaders in ``args``
    (divided by ``split`` = num_processes under ``split_batches``; the smallest when ``is_train_batch_min``, as
    accelerate)."""
    if not plugin.is_auto("train_micro_batch_size_per_gpu"):
        return plugin.get_value("train_micro_batch_size_per_gpu")
    sizes = [obj.batch_size for obj in args if isinstance(obj, DataLoader)]
    if not sizes or any(b is None for b in sizes):
        raise ValueError(
            '"train_micro_batch_size_per_gpu"="auto" is filled from the batch_size of the dataloaders '
            f"passed to prepare() with the model; got batch sizes {sizes}: pass the training dataloader "
            "(with an integer batch_size) in the same prepare() call, or give the config an integer"
        )
    sizes = [b // split for b in sizes]
    return min(sizes) if plugin.is_train_batch_min else max(sizes)


def schedule_autos(scheduler: DummyScheduler, processes: int) -> dict[str, Any]:
    """The "auto" values of the config's scheduler from a DummyScheduler: warmup from 0 to the DummyOptim's lr over
    ``warmup_num_steps`` (at least 1), ``total_num_steps`` / ``processes`` (rounded up; accelerate's rule: the
    script counts the batches of one unsharded loader)."""
    opt = scheduler.optimizer
    max_lr = opt.defaults["lr"] if getattr(opt, "defaults", None) is not None else getattr(opt, "lr", None)
    out: dict[str, Any] = {
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": max_lr,
        "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
    }
    if scheduler.total_num_steps is not None:
        out["scheduler.params.total_num_steps"] = math.ceil(scheduler.total_num_steps / processes)
    return out


__all__ = [
    "DS_SCHEDULES",
    "check_objects",
    "hidden_size_autos",
    "is_ds_schedule",
    "micro_batch",
    "one_plugin",
    "schedule_autos",
]
