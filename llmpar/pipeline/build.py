"""``build_pipeline``: :func:`~llmpar.pipeline.stages.split` and :class:`PipelineRunner` in one call."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from llmpar.pipeline.runner import PipelineRunner
from llmpar.pipeline.schedules import normalize_schedule
from llmpar.pipeline.stages import split


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
    parts = split(
        model,
        mesh,
        by=by,
        boundaries=boundaries,
        virtual_stages=virtual_stages,
        sample=sample,
        tp_plan=tp_plan,
        verbose=verbose,
    )
    if isinstance(dp_group, str):
        if dp_group != "mesh":
            raise ValueError(f"dp_group={dp_group!r}: pass 'mesh', a group, or None")
        dp_group = parts.dp_group
    return PipelineRunner(
        parts, loss_fn, micro_batches=micro_batches, schedule=name, dp_group=dp_group, track_memory=track_memory
    )


__all__ = ["build_pipeline"]
