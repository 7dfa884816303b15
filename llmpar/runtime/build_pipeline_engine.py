"""The pipeline engine that ``llmpar.initialize`` builds for a config with a ``"pipeline"`` block or a
``llmpar.pipe.PipelineModule``: the model cut into stages over the ``[pp, dp, tp]`` mesh
(``llmpar.pipeline.build``), tensor parallel inside each stage, a ZeroOptimizer (stages 0-2) per stage, DeepSpeed's
in-order repeating loader for ``train_batch()``. A PipelineModule brings its stage count, mesh and loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpar.distributed.collectives import group_size
from llmpar.distributed.init import init_distributed
from llmpar.runtime.activations import apply_activation_checkpointing
from llmpar.runtime.build_engine import accum_dtype, typed_config
from llmpar.runtime.config import Blocks, Config
from llmpar.runtime.params import stage_groups, unsplit_names
from llmpar.runtime.pipeline_engine import PipelineEngine, is_pipeline_module, pipeline_loader
from llmpar.runtime.schedules import WarmupSchedule


def build_pipeline_engine(
    model: nn.Module,
    blocks: Blocks | Config,
    mesh: Any,
    loss_fn: Any,
    counter: Any,
    training_data: Any,
    collate_fn: Any,
    groups: list[dict],
    canonical: dict[str, str],
) -> tuple[PipelineEngine, Any, Any, WarmupSchedule | None]:
    """``(engine, optimizer, training_dataloader or None, scheduler)`` of ``blocks`` for ``model`` (module
    docstring). ``groups``: the param groups by name in the unsplit model; ``canonical``: its canonical names."""
    from llmpar.pipeline.build import build_pipeline  # loads torch.distributed.pipelining: only when needed
    from llmpar.pipeline.zero import zero_optimizer

    pp, tp = blocks.degrees
    pipe_module = is_pipeline_module(model)
    if pipe_module:  # DeepSpeed's PipelineModule: stages, mesh and loss come from it
        pp, mesh = _pipe_module_mesh(model, blocks, tp, mesh)
    loss_fn = loss_fn if loss_fn is not None else getattr(model, "loss_fn" if pipe_module else "loss", None)
    if pipe_module and loss_fn is None:  # DeepSpeed: without a loss_fn the last layer's output is the loss
        loss_fn = _output_is_loss
    if not callable(loss_fn):
        raise TypeError(
            "a pipeline engine needs loss_fn=(output, target) -> mean loss (or a model with a .loss "
            "attribute, as llmpar.models.GPT; a PipelineModule's loss_fn=)"
        )
    if mesh is None:
        mesh = init_distributed(pp=pp, tp=tp).mesh
    names = mesh.mesh_dim_names or ()
    if not {"pp", "dp", "tp"} <= set(names):
        raise ValueError(
            f"mesh has axes {names}; a pipeline engine needs the [pp, dp, tp] mesh of llmpar.init_distributed(pp=, tp=)"
        )
    if (mesh["pp"].size(), mesh["tp"].size()) != (pp, tp):
        raise ValueError(
            f"mesh has pp={mesh['pp'].size()}, tp={mesh['tp'].size()} but the config asks for "
            f"pipeline.stages={pp}, tensor_parallel.size={tp}"
        )
    dp_group = mesh["dp"].get_group()
    cfg = typed_config(blocks, group_size(dp_group))
    _refuse_unwired(cfg)
    if cfg.zero.stage == 3:
        raise ValueError(
            '"zero_optimization.stage"=3 is not supported with "pipeline": use stage 0, 1 or 2 (ZeRO '
            "shards each stage's params over dp)"
        )
    if cfg.bf16:
        model.to(torch.bfloat16)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, mesh["tp"].get_group() if tp > 1 else None)
    p, m = cfg.pipeline, cfg.gradient_accumulation_steps
    # a PipelineModule's config (DeepSpeed's, no llmpar block) runs any micro-batch count: 1F1B, else GPipe
    chosen = p is not None and (not pipe_module or p.schedule_given)
    schedule = p.schedule if chosen else "1f1b" if m >= pp else "gpipe"
    runner = build_pipeline(
        model,
        mesh,
        loss_fn,
        micro_batches=m,
        schedule=schedule,
        virtual_stages=p.virtual_stages if p is not None else 1,
        boundaries=p.boundaries if p is not None else None,
        dp_group=None,
        verbose=True,
    )
    runner.batch_rows = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    split = runner.split
    stage_named = [
        (f"stage{s}.{n}", p) for m, s in zip(split.modules, split.stage_indices) for n, p in m.named_parameters()
    ]
    opt = zero_optimizer(
        runner,
        cfg.optimizer,
        zero_config=cfg.zero,
        param_groups=stage_groups(groups, stage_named, unsplit_names(model, stage_named), canonical),
        max_grad_norm=cfg.gradient_clipping or None,
        counter=counter,
        grad_accum_dtype=accum_dtype(cfg),
    )
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = PipelineEngine(model, cfg, runner, opt, sched, mesh)
    if training_data is not None:  # DeepSpeed's PipelineEngine loader: in order, repeating; train_batch() pulls it
        engine.set_dataloader(pipeline_loader(training_data, collate_fn, cfg.train_micro_batch_size_per_gpu, dp_group))
    return engine, opt, engine.training_dataloader, sched


def _output_is_loss(output: torch.Tensor, labels: Any) -> torch.Tensor:
    return output


def _pipe_module_mesh(model: Any, blocks: Blocks | Config, tp: int, mesh: Any) -> tuple[int, Any]:
    """(pp, mesh) for a PipelineModule: its stages and mesh (a config's "pipeline.stages" / mesh= must agree)."""
    stages = blocks.pipeline.stages if blocks.pipeline is not None else None  # None: "auto" or no block
    if stages is not None and stages != model.num_stages:
        raise ValueError(f'"pipeline.stages"={stages} but the PipelineModule has num_stages={model.num_stages}')
    if tp != 1:
        raise ValueError(f'"tensor_parallel.size"={tp}: a PipelineModule runs without tensor parallelism')
    if mesh is not None and mesh is not model.mesh:
        raise ValueError("mesh= differs from the PipelineModule's own mesh: build the module with mesh= instead")
    return model.num_stages, model.mesh


def _refuse_unwired(cfg: Config) -> None:
    """Blocks the pipeline engine does not act on yet: an error, never a silent fp32 run."""
    if cfg.fp16.enabled:
        raise ValueError(
            '"fp16.enabled"=true: not supported yet with "pipeline" (the loss scale would have to run '
            'inside the pipeline schedule): use "bf16", or fp16 without "pipeline"'
        )


__all__ = ["build_pipeline_engine"]
