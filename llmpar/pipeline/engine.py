"""``llmpar.initialize`` with a ``"pipeline"`` block: the pp x dp x tp engine.

    engine, optimizer, _, scheduler = llmpar.initialize(model=GPT(cfg), config={
        "train_micro_batch_size_per_gpu": 2,
        "pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 8},
        "tensor_parallel": {"size": 2},
        "zero_optimization": {"stage": 1}, "optimizer": {...}, "gradient_clipping": 1.0})
    loss = engine.train_batch(x, y)          # x, y: [micro * micro_batches, T], this dp rank's rows of the step

What it does: ``llmpar.init_distributed(pp=stages, tp=size)`` builds the ``[pp, dp, tp]`` mesh (dp = the rest of the
world; or pass ``mesh=``), ``llmpar.pipeline.split`` cuts the model into stages with tensor-parallel layers inside,
a :class:`PipelineRunner` drives the schedule, and a ZeroOptimizer (stage 0, 1 or 2) per pp rank shards that rank's
stage params over dp (``llmpar.pipeline.zero``); the clipping norm is the whole model's.

Semantics follow DeepSpeed's PipelineEngine: ``pipeline.micro_batches`` *is* ``gradient_accumulation_steps``, and
``train_batch`` runs one whole optimizer step (all micro-batches, ZeRO step, scheduler step) and returns the step's
mean loss (averaged over dp). With equal micro-batches this is exactly the plain engine's
``gas x (engine(x_i); engine.backward(loss_i); engine.step())``: mean over the batch, one optimizer step.
``train_batch`` takes the step's whole batch ``(x, y)`` of ``train_micro_batch_size_per_gpu x micro_batches`` rows,
or ``data_iter=``, an iterator of ``(x, y)`` micro-batches of which it pulls ``micro_batches`` (DeepSpeed's form).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from llmpar.config import DeepSpeedAccessors
from llmpar.distributed.collectives import check_same_on_ranks, group_rank, group_size
from llmpar.pipeline.runner import PipelineRunner, StepStats

logger = logging.getLogger("llmpar")


def wants_pipeline(config: Any) -> bool:
    """Whether ``config`` (dict, JSON path or parsed Config) has a ``pipeline`` block."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if isinstance(config, dict):
        return "pipeline" in config
    return getattr(config, "pipeline", None) is not None


class PipelineEngine(DeepSpeedAccessors):
    """One optimizer step per :meth:`train_batch` over this rank's pipeline stages (module docstring)."""

    def __init__(self, module: nn.Module, config: Any, runner: PipelineRunner, optimizer: Any, scheduler: Any,
                 mesh: Any) -> None:
        self.module, self.config, self.runner, self.optimizer, self.lr_scheduler = (module, config, runner,
                                                                                    optimizer, scheduler)
        self.mesh = mesh
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0

    def is_pipe_parallel(self) -> bool:
        return self.runner.split.pp > 1

    @property
    def stages(self) -> list[nn.Module]:
        """This rank's stage modules."""
        return list(self.runner.split.modules)

    def train(self, mode: bool = True) -> "PipelineEngine":
        for m in self.runner.split.modules:
            m.train(mode)
        return self

    def eval(self) -> "PipelineEngine":
        return self.train(False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a pipeline engine runs whole steps: use engine.train_batch(x, y) (or data_iter=) instead "
                        "of engine(x) / engine.backward / engine.step")

    forward = backward = step = __call__

    # the step
    def train_batch(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None, *,
                    data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Forward + backward of all ``micro_batches``, the ZeRO step and the scheduler step; returns the step's mean
        loss (a float64 scalar, the same on every rank)."""
        if data_iter is not None:
            if x is not None or y is not None:
                raise TypeError("train_batch takes (x, y) or data_iter=, not both")
            pairs = [next(data_iter) for _ in range(self.config.gradient_accumulation_steps)]
            if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
                raise TypeError("data_iter must yield (inputs, targets) pairs")
            x, y = [p[0] for p in pairs], [p[1] for p in pairs]
        elif x is None and y is None:
            raise TypeError("train_batch needs (x, y) or data_iter=")
        rows = self.runner.batch_rows
        for what, t in (("x", x), ("y", y)):  # up front, so that the pipeline stays usable (the runner checks too)
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != rows):
                raise ValueError(f"train_batch: {what} has {t.shape[0] if t.dim() else 0} rows; a step takes "
                                 f"train_micro_batch_size_per_gpu x gradient_accumulation_steps = {rows} rows per "
                                 "dp rank")
        loss = self.runner.step(x, y)
        applied = self.optimizer.step()
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if not applied:
            self.skipped_steps += 1
        self.optimizer.zero_grad()
        self.micro_steps += self.config.gradient_accumulation_steps
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        if self.global_steps % self.config.steps_per_print == 0:
            logger.info("step %d: loss %.4f, lr %s, grad norm %.4g, bubble %.3f", self.global_steps, loss,
                        [round(lr, 8) for lr in self.get_lr()], self.optimizer.last_grad_norm or 0.0,
                        self.last_stats().bubble if self.runner.last_stats else 0.0)
        return torch.tensor(loss, dtype=torch.float64)

    # bubble accounting
    def bubble_fraction(self) -> float:
        """The schedule's idle fraction, (p - 1) / (m + p - 1) for GPipe and 1F1B (``schedules.py``)."""
        return self.runner.bubble_formula()

    def last_stats(self) -> StepStats:
        """This rank's measured numbers for the last step (wall, busy, measured ``bubble``, in-flight micro-batches)."""
        if self.runner.last_stats is None:
            raise RuntimeError("last_stats() needs a train_batch() first")
        return self.runner.last_stats

    def pipeline_stats(self) -> list[StepStats]:
        """Every pp rank's :class:`StepStats` of the last step (a collective over pp: call it on every rank)."""
        return self.runner.gather_stats()


def initialize_pipeline(*, model: nn.Module, config: Any, mesh: Any = None, loss_fn: Callable | None = None,
                        counter: Any = None, training_data: Any = None, collate_fn: Any = None):
    """``llmpar.initialize`` for a config with a ``pipeline`` block. Returns ``(engine, optimizer, loader, sched)``."""
    import llmpar
    from llmpar.config import Config
    from llmpar.pipeline import build_pipeline
    from llmpar.pipeline.zero import zero_optimizer
    from llmpar.zero.lr_schedules import WarmupSchedule

    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if isinstance(config, Config):
        pp, tp = config.pipeline.stages, config.tensor_parallel.size
    else:  # the degrees are needed before dp is known: parse the two blocks alone first
        from llmpar.config import _parallel_blocks

        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
        pipe, tp_cfg = _parallel_blocks(dict(config))
        pp, tp = pipe.stages, tp_cfg.size
    loss_fn = loss_fn if loss_fn is not None else getattr(model, "loss", None)
    if not callable(loss_fn):
        raise TypeError("a pipeline engine needs loss_fn=(output, target) -> mean loss (or a model with a .loss "
                        "attribute, as llmpar.models.GPT)")
    if mesh is None:
        mesh = llmpar.init_distributed(pp=pp, tp=tp).mesh
    names = mesh.mesh_dim_names or ()
    if not {"pp", "dp", "tp"} <= set(names):
        raise ValueError(f"mesh has axes {names}; a pipeline engine needs the [pp, dp, tp] mesh of "
                         "llmpar.init_distributed(pp=, tp=)")
    if (mesh["pp"].size(), mesh["tp"].size()) != (pp, tp):
        raise ValueError(f"mesh has pp={mesh['pp'].size()}, tp={mesh['tp'].size()} but the config asks for "
                         f"pipeline.stages={pp}, tensor_parallel.size={tp}")
    dp_group = mesh["dp"].get_group()
    dp = group_size(dp_group)
    cfg = config if isinstance(config, Config) else Config.from_deepspeed(config, dp=dp)
    if cfg.dp != dp:
        raise ValueError(f"the config was parsed for dp={cfg.dp} but the mesh has dp={dp}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if cfg.zero.stage == 3:
        raise ValueError('"zero_optimization.stage"=3 is not supported with "pipeline": use stage 0, 1 or 2 (ZeRO '
                         "shards each stage's params over dp)")
    check_same_on_ranks(cfg.fingerprint(), dist.group.WORLD, what="the DeepSpeed config differs between ranks",
                        hint="give every rank the same config")
    if cfg.bf16:
        model.to(torch.bfloat16)
    p = cfg.pipeline
    runner = build_pipeline(model, mesh, loss_fn, micro_batches=cfg.gradient_accumulation_steps, schedule=p.schedule,
                            virtual_stages=p.virtual_stages, boundaries=p.boundaries, dp_group=None, verbose=True)
    runner.batch_rows = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    opt = zero_optimizer(runner, cfg.optimizer, stage=cfg.zero.stage, zero_config=cfg.zero,
                         max_grad_norm=cfg.gradient_clipping or None, counter=counter,
                         grad_accum_dtype=torch.float32 if cfg.bf16 and cfg.gradient_accumulation_steps > 1 else None)
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = PipelineEngine(model, cfg, runner, opt, sched, mesh)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(training_data, num_replicas=dp, rank=group_rank(dp_group), shuffle=True)
        loader = DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                            collate_fn=collate_fn)
    return engine, opt, loader, sched


__all__ = ["PipelineEngine", "initialize_pipeline", "wants_pipeline"]
