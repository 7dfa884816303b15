"""The pipeline engine that ``llmpar.initialize`` builds for a config with a ``"pipeline"`` block or a
``llmpar.pipe.PipelineModule``: the model cut into stages over the ``[pp, dp, tp]`` mesh
(``llmpar.pipeline.build``), tensor parallel inside each stage, a ZeroOptimizer (stages 0-2) per stage, DeepSpeed's
in-order repeating loader for ``train_batch()``. A PipelineModule brings its stage count, mesh and loss. With
``"expert_parallel"`` at ep > 1 the experts fold over each stage's dp ranks (:func:`_spread_experts`); the MoE
layers' aux losses join the backward where they are computed (:func:`_attach_aux_losses`, ``"add_aux_loss"``) and
the engine moves their expert biases after each step (``PipelineEngine``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.collectives import all_reduce, group_size
from llmpar.distributed.dims import ParallelDims
from llmpar.distributed.init import init_distributed
from llmpar.moe.block import MoEBlock
from llmpar.moe.hf import swap_moe_blocks
from llmpar.runtime.activations import apply_activation_checkpointing
from llmpar.runtime.build_engine import accum_dtype, typed_config
from llmpar.runtime.config import Blocks, Config
from llmpar.runtime.expert_block import ExpertParallelConfig, apply_grouped_mm_impl
from llmpar.runtime.params import stage_groups, unsplit_names
from llmpar.runtime.pipeline_engine import PipelineEngine, is_pipeline_module, pipeline_loader
from llmpar.runtime.schedules import WarmupSchedule

logger = logging.getLogger("llmpar")


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
    layers = _prepare_experts(model, blocks.expert_parallel, tp)  # before anything collective: refused alike
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
    experts = _spread_experts(layers, blocks.expert_parallel.ep, pp=pp, tp=tp, dp=group_size(dp_group))
    apply_activation_checkpointing(model, cfg.activation_checkpointing, mesh["tp"].get_group() if tp > 1 else None)
    p, m = cfg.pipeline, cfg.gradient_accumulation_steps
    if blocks.expert_parallel.add_aux_loss:
        _attach_aux_losses(layers, 1.0 / m)
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
    if experts is not None:
        _check_every_stage_has_experts(runner)
    opt = zero_optimizer(
        runner,
        cfg.optimizer,
        zero_config=cfg.zero,
        param_groups=stage_groups(groups, stage_named, unsplit_names(model, stage_named), canonical),
        max_grad_norm=cfg.gradient_clipping or None,
        counter=counter,
        grad_accum_dtype=accum_dtype(cfg),
        **({} if experts is None else {"expert_group": experts[1], "ep_group": experts[0]}),
    )
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = PipelineEngine(model, cfg, runner, opt, sched, mesh)
    if training_data is not None:  # DeepSpeed's PipelineEngine loader: in order, repeating; train_batch() pulls it
        engine.set_dataloader(pipeline_loader(training_data, collate_fn, cfg.train_micro_batch_size_per_gpu, dp_group))
    return engine, opt, engine.training_dataloader, sched


def _prepare_experts(model: nn.Module, ep_cfg: ExpertParallelConfig, tp: int) -> list[tuple[str, MoEBlock]]:
    """The model's MoE layers, made ready for a pipeline (no collective; the same on every rank). With the block
    enabled, transformers' MoE blocks are swapped first; every ``llmpar.moe.Experts`` takes the block's grouped GEMM
    backends. Refused naming it: a layer split over an etp group; at ep > 1, no MoE layer, tp > 1, a layer built over
    its own group."""
    if ep_cfg.enabled and swap_moe_blocks(model):
        logger.info("expert_parallel: transformers MoE blocks run as llmpar MoE blocks in the pipeline")
    apply_grouped_mm_impl(model, ep_cfg)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MoEBlock)]
    for name, b in layers:  # the stages' optimizers would average the shards over dp and clip them once per etp rank
        if b.etp_size > 1:
            raise ValueError(
                f"MoE layer {name} splits its experts over an expert-tensor-parallel group of {b.etp_size} ranks: "
                'not supported with a "pipeline" block; build it with etp_group=None or train without a pipeline'
            )
    ep = ep_cfg.ep
    if ep == 1:
        return layers
    where = f'"expert_parallel.autoep_size"={ep} with a "pipeline" block'
    if not layers:
        raise ValueError(f"{where}: the model has no llmpar.moe.MoEBlock layer to spread over the ep ranks")
    if tp > 1:
        raise ValueError(f'{where} and "tensor_parallel.size"={tp}: not supported yet; use tp=1 or no pipeline')
    for name, b in layers:
        if b.ep_size != 1:
            raise ValueError(f"{where}: MoE layer {name} was built over its own group; build it with ep_group=None")
    return layers


class _AttachAux(torch.autograd.Function):
    """``output`` unchanged; its backward also sends ``scale`` as the gradient of ``aux`` (the layer's weighted aux
    losses), as if ``scale * aux`` had been added to the loss: the pipeline's loss lives on the last stage, so an
    earlier stage's router cannot be reached through it."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def _attach_aux_losses(layers: list[tuple[str, MoEBlock]], scale: float) -> None:
    """Every MoE layer's weighted aux losses of a training forward join the backward with weight ``scale`` (1 /
    micro-batches: the plain engine's ``(loss + aux) / gradient_accumulation_steps``), through a forward hook."""

    def hook(module: MoEBlock, _inputs: Any, output: Any) -> Any:
        aux = getattr(module, "aux_loss", None)
        if not (module.training and torch.is_grad_enabled() and isinstance(aux, torch.Tensor) and aux.requires_grad):
            return None
        if isinstance(output, torch.Tensor):
            return _AttachAux.apply(output, aux, scale)
        return (_AttachAux.apply(output[0], aux, scale), *output[1:])  # a block returning (hidden, ...)

    for _, b in layers:
        b.register_forward_hook(hook)


def _spread_experts(layers: list[tuple[str, MoEBlock]], ep: int, *, pp: int, tp: int, dp: int) -> Any:
    """Expert parallelism inside each pipeline stage: ``(ep_group, edp_group)``, or None at ep = 1. The ep ranks
    fold over each stage's dp ranks (``ParallelDims(pp, dp, tp, ep)``: ep inner, the same layout as without a
    pipeline); every ``MoEBlock`` is spread over its stage's ep group before the split, and the stage's
    ZeroOptimizer reduces and shards the experts over the edp ranks (``llmpar.zero.experts``)."""
    if ep == 1:
        return None
    if dp % ep:
        raise ValueError(
            f'"expert_parallel.autoep_size"={ep} with a "pipeline" block: ep={ep} does not divide the {dp} '
            "data-parallel ranks of each stage"
        )
    dims = ParallelDims(pp=pp, dp=dp, tp=tp, ep=ep, world_size=pp * dp * tp)
    ep_group, edp_group = dims.group("ep"), dims.group("edp")
    for _, b in layers:
        b.set_ep_group(ep_group)
    return ep_group, edp_group


def _check_every_stage_has_experts(runner: Any) -> None:
    """Every pp rank must hold an MoE layer: the experts' optimizer reduces its norm over pp (a stage without
    experts would leave it waiting). One all-reduce over the job, so every rank raises alike."""
    mine = sum(isinstance(m, MoEBlock) for sm in runner.split.modules for m in sm.modules())
    least = torch.tensor([mine], dtype=torch.int64)
    all_reduce(least, dist.group.WORLD, op="min", what="MoE layers per pipeline stage")
    if int(least) == 0:
        raise ValueError(
            '"expert_parallel.autoep_size" > 1 with a "pipeline" block: a pipeline stage holds no MoE layer; '
            'cut the stages ("pipeline.partition") so that each holds one'
        )


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
