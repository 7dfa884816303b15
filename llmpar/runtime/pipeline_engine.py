"""The pipeline engine, which ``llmpar.initialize`` returns for a config with a ``"pipeline"`` block (pp x dp x tp).

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

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from llmpar.checkpoint.protocol import Grid
from llmpar.runtime.config import Config
from llmpar.runtime.engine_base import EngineBase, reports_step
from llmpar.runtime.params import unsplit_names

if TYPE_CHECKING:  # the runner module loads torch.distributed.pipelining
    from llmpar.pipeline.runner import PipelineRunner, StepStats


class PipelineEngine(EngineBase):
    """One optimizer step per :meth:`train_batch` over this rank's pipeline stages (module docstring)."""

    def __init__(self, module: nn.Module, config: Config, runner: PipelineRunner, optimizer: Any, scheduler: Any,
                 mesh: Any) -> None:
        super().__init__(module, config, optimizer, scheduler)
        self.runner, self.mesh = runner, mesh

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
    @reports_step
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
        self.micro_steps += self.config.gradient_accumulation_steps
        self._finish_step(self.optimizer.step(), loss)
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

    # checkpoint protocol: the optimizer names a param ``stage{s}.{name in the stage module}``
    # (``stage1.blocks_3.attn.qkv.weight``); the checkpoint records the unsplit model's name
    # (``blocks.3.attn.qkv.weight``): the blocks of ``to_blocks`` hold the model's own submodules, so each stage-local
    # name maps through the block's tensor to its name in the model. A weight tied between stages maps to one name
    # (the model's first) and is written once, by the lowest stage holding it.
    def checkpoint_grid(self) -> Grid:
        """dp (the optimizer's group) x tp x pp (pp only when > 1)."""
        split = self.runner.split
        return Grid.of(self.optimizer.dp_group, split.tp_group, split.pp_group if split.pp > 1 else None,
                       self.optimizer.checkpoint_device())

    def checkpoint_modules(self) -> list[nn.Module]:
        """This rank's stage modules."""
        return list(self.runner.split.modules)

    def checkpoint_named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        """(``stage{s}.{local name}``, tensor) of this rank's stage params / buffers, tied ones under every name."""
        split = self.runner.split
        return [(f"stage{s}.{n}", t) for m, s in zip(split.modules, split.stage_indices)
                for n, t in getattr(m, kind)(remove_duplicate=False)]

    def checkpoint_names(self) -> dict[str, str]:
        """{``stage{s}.{local name}``: name in the unsplit model} of this rank's params and buffers."""
        return unsplit_names(self.module, self.checkpoint_named("named_parameters")
                             + self.checkpoint_named("named_buffers"))

    def checkpoint_duplicates(self) -> set[str]:
        """Optimizer names of this rank's tied copies that a lower stage holds too (that stage writes them)."""
        dup = {id(p) for p in self.runner.tied_duplicates}
        return {name for buf in self.optimizer.checkpoint_params() for name, p in buf if id(p) in dup}


__all__ = ["PipelineEngine"]
