"""Pipeline parallelism: cut a model into stages (:func:`split`, ``stages.py``) and run them with the schedules of
``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B) through :class:`PipelineRunner`, adding what they
lack for us: tensor-parallel layers inside each stage, tied embeddings across the first and last stage, loss and
gradient-accumulation semantics equal to plain training, bubble accounting, and failures reported on every rank.

    env = llmpar.init_distributed(pp=2, tp=2)
    runner = llmpar.pipeline.build_pipeline(model, env.mesh, GPT.loss, schedule="1f1b", micro_batches=8)
    loss = runner.step(x, y)          # then clip with runner.clip_grad_norm_ and step your optimizer

ZeRO over the dp axis (``zero.py``): build the runner with ``dp_group=None`` and the optimizer with
``zero_optimizer(runner, OptimizerConfig(...), stage=1, max_grad_norm=1.0)``; then ``runner.step``; ``opt.step()``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from llmpar.pipeline._failure import PipelineStageError
from llmpar.pipeline.blocks import StageModule, to_blocks
from llmpar.pipeline.partition import balanced_boundaries
from llmpar.pipeline.runner import PipelineRunner, StepStats
from llmpar.pipeline.schedules import SCHEDULES, bubble_fraction, normalize_schedule
from llmpar.pipeline.stages import PipelineSplit, StageInfo, split
from llmpar.pipeline.zero import zero_optimizer


def build_pipeline(
    model: nn.Module,
    mesh: Any,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    micro_batches: int,
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
    by: str = "params",
    boundaries: Sequence[int] | None = None,
    sample: Any = None,
    tp_plan: Mapping[str, str] | None = None,
    dp_group: Any = "mesh",
    track_memory: bool = False,
    verbose: bool = True,
) -> PipelineRunner:
    """``split`` + ``PipelineRunner`` in one call. ``virtual_stages`` defaults to 2 for the interleaved schedule,
    else 1; ``dp_group="mesh"`` averages gradients over the mesh's dp axis (pass None to leave that to ZeRO)."""
    name = normalize_schedule(schedule)
    if virtual_stages is None:
        virtual_stages = 2 if name == "interleaved_1f1b" else 1
    parts = split(model, mesh, by=by, boundaries=boundaries, virtual_stages=virtual_stages, sample=sample,
                  tp_plan=tp_plan, verbose=verbose)
    if isinstance(dp_group, str):
        if dp_group != "mesh":
            raise ValueError(f"dp_group={dp_group!r}: pass 'mesh', a group, or None")
        dp_group = parts.dp_group
    return PipelineRunner(parts, loss_fn, micro_batches=micro_batches, schedule=name, dp_group=dp_group,
                          track_memory=track_memory)


__all__ = [
    "PipelineRunner",
    "PipelineSplit",
    "PipelineStageError",
    "SCHEDULES",
    "StageInfo",
    "StageModule",
    "StepStats",
    "balanced_boundaries",
    "bubble_fraction",
    "build_pipeline",
    "split",
    "to_blocks",
    "zero_optimizer",
]
