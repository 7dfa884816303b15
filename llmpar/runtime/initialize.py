"""``llmpar.initialize``: the one front door. A DeepSpeed config in, a training engine out.

    engine, optimizer, loader, scheduler = llmpar.initialize(model=model, config={...DeepSpeed JSON...} or "ds.json")

The config is read once (``read_config``), its parallel blocks give the degrees (``parallel_degrees``), the degrees
give the mesh (``llmpar.init_distributed``; or the caller's ``mesh=`` / ``dp_group=`` / ``tp_group=``), the mesh
gives dp, and dp gives the typed :class:`Config`. Then one of two engines is built on the same steps:

* no ``"pipeline"`` block: :class:`Engine` with a ZeroOptimizer (stages 0-3, CPU offload). A ``"tensor_parallel":
  {"size": N}`` block without a mesh builds the dp x tp mesh and splits the model with ``llmpar.parallelize``.
* a ``"pipeline"`` block: :class:`PipelineEngine`: the model cut into stages over the [pp, dp, tp] mesh, tensor
  parallel inside each, a ZeroOptimizer (stages 0-2) per stage.

bf16 puts the model in bfloat16 with fp32 master weights (and fp32 gradient accumulation when
gradient_accumulation_steps > 1).
"""
from __future__ import annotations

import json
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.agree import check_same_on_ranks, raise_if_any_failed
from llmpar.distributed.collectives import CommCounter, Group, as_group, group_rank, group_size
from llmpar.distributed.init import init_distributed
from llmpar.runtime.config import Blocks, Config, read_config
from llmpar.runtime.engine import Engine
from llmpar.runtime.params import canonical_names, named_groups, stage_groups, unsplit_names
from llmpar.runtime.pipeline_engine import PipelineEngine
from llmpar.runtime.schedules import WarmupSchedule
from llmpar.tensor_parallel.parallelize import parallelize
from llmpar.zero.optimizer import ZeroOptimizer


def initialize(*, model: nn.Module, config: dict | str | Config, model_parameters: Any = None,
               optimizer: Any = None, lr_scheduler: Any = None, training_data: Any = None, collate_fn: Any = None,
               mesh: Any = None, dp_group: Group | None = None, tp_group: Group | None = None,
               counter: CommCounter | None = None, args: Any = None, unit_policy: Any = None,
               loss_fn: Callable | None = None, timeout_s: float | None = None, **unsupported: Any):
    """Build the engine from a DeepSpeed config. Returns ``(engine, optimizer, dataloader or None, scheduler)``.

    model_parameters: params, (name, param) pairs or param-group dicts (default: all of the model's, weight decay on
    all, as DeepSpeed); bare params keep their names in the model. Under a pipeline the groups follow each param to
    its stage by its name in the unsplit model.
    mesh / dp_group / tp_group: where ZeRO and tensor parallelism run (default: ``mesh["dp"]`` / ``mesh["tp"]``, else
    the whole job). unit_policy: stage 3 sharding units, ``policy(name, module) -> bool`` (default: transformer
    blocks, embeddings, head; see ``llmpar.zero.stage3.unit_modules``). optimizer / lr_scheduler objects are not
    taken: describe them in the config. loss_fn: ``(output, target) -> mean loss`` of a pipeline engine (default
    ``model.loss``). training_data: a dataset; the loader gives this dp rank's micro-batches (DistributedSampler).
    timeout_s: how long a collective waits for its peers before failing with a ``CollectiveError`` naming the
    operation and the engine's step (when initialize starts torch.distributed; default ``LLMPAR_TIMEOUT_S`` or 600).
    """
    if unsupported:
        raise TypeError(f"llmpar.initialize got unsupported arguments {sorted(unsupported)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None or lr_scheduler is not None:
        raise ValueError("llmpar.initialize takes the optimizer and scheduler from the config (\"optimizer\", "
                         "\"scheduler\" blocks); passing optimizer= / lr_scheduler= objects is not supported")
    init_distributed(timeout_s=timeout_s)  # the default group (a world of one without torchrun)
    blocks = _agreed_blocks(config, [mesh] if mesh is not None else [g for g in (dp_group, tp_group) if g is not None])
    raw = blocks.raw
    pp, tp = blocks.degrees
    if "pipeline" in raw:
        if dp_group is not None or tp_group is not None or unit_policy is not None:
            raise ValueError("with a \"pipeline\" block llmpar.initialize splits the model itself: pass mesh= at "
                             "most, not dp_group= / tp_group= / unit_policy=")
        return _initialize_pipeline(model, blocks, pp, tp, mesh, loss_fn, counter, training_data, collate_fn,
                                    named_groups(model, model_parameters), canonical_names(model))
    if loss_fn is not None:
        raise ValueError("loss_fn= is used by pipeline engines only (a config with a \"pipeline\" block)")
    split_here = False
    if tp > 1 and mesh is None and dp_group is None and tp_group is None:
        mesh = init_distributed(tp=tp).mesh  # the dp x tp mesh; the model is split over its tp axis below
        if not any(getattr(p, "tensor_model_parallel", False) for p in model.parameters()):
            parallelize(model, mesh["tp"])
            split_here = True
    dp_group, tp_group = _resolve_groups(mesh, dp_group, tp_group)
    cfg = _typed(blocks, group_size(dp_group))
    tp_now = group_size(tp_group) if tp_group is not None else 1
    if "tensor_parallel" in raw and tp != tp_now:
        raise ValueError(f'"tensor_parallel.size"={tp} but tp_group has {tp_now} ranks: pass the mesh of '
                         f"llmpar.init_distributed(tp={tp}) (or leave out mesh= and let initialize build it)")
    if next(model.parameters()).device.type == "meta" and cfg.zero.stage != 3:  # built under llmpar.zero.Init
        raise ValueError(f"the model is on the meta device (llmpar.zero.Init) but zero_optimization.stage is "
                         f"{cfg.zero.stage}: only stage 3 materialises a meta model")
    if cfg.bf16:
        model.to(torch.bfloat16)
    opt = ZeroOptimizer(named_groups(model, model_parameters, strict=split_here), cfg.optimizer, dp_group,
                        stage=cfg.zero.stage, zero_config=cfg.zero,
                        tp_group=tp_group, max_grad_norm=cfg.gradient_clipping or None, counter=counter,
                        grad_accum_dtype=_accum_dtype(cfg), module=model, unit_policy=unit_policy)
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = Engine(model, cfg, opt, sched, dp_group=dp_group, tp_group=tp_group, mesh=mesh)
    return engine, opt, _loader(training_data, collate_fn, cfg, dp_group), sched


def _initialize_pipeline(model: nn.Module, blocks: Blocks | Config, pp: int, tp: int, mesh: Any, loss_fn: Any,
                         counter: Any, training_data: Any, collate_fn: Any, groups: list[dict],
                         canonical: dict[str, str]):
    from llmpar.pipeline.build import build_pipeline  # loads torch.distributed.pipelining: only when needed
    from llmpar.pipeline.zero import zero_optimizer

    loss_fn = loss_fn if loss_fn is not None else getattr(model, "loss", None)
    if not callable(loss_fn):
        raise TypeError("a pipeline engine needs loss_fn=(output, target) -> mean loss (or a model with a .loss "
                        "attribute, as llmpar.models.GPT)")
    if mesh is None:
        mesh = init_distributed(pp=pp, tp=tp).mesh
    names = mesh.mesh_dim_names or ()
    if not {"pp", "dp", "tp"} <= set(names):
        raise ValueError(f"mesh has axes {names}; a pipeline engine needs the [pp, dp, tp] mesh of "
                         "llmpar.init_distributed(pp=, tp=)")
    if (mesh["pp"].size(), mesh["tp"].size()) != (pp, tp):
        raise ValueError(f"mesh has pp={mesh['pp'].size()}, tp={mesh['tp'].size()} but the config asks for "
                         f"pipeline.stages={pp}, tensor_parallel.size={tp}")
    dp_group = mesh["dp"].get_group()
    cfg = _typed(blocks, group_size(dp_group))
    if cfg.zero.stage == 3:
        raise ValueError('"zero_optimization.stage"=3 is not supported with "pipeline": use stage 0, 1 or 2 (ZeRO '
                         "shards each stage's params over dp)")
    if cfg.bf16:
        model.to(torch.bfloat16)
    p = cfg.pipeline
    runner = build_pipeline(model, mesh, loss_fn, micro_batches=cfg.gradient_accumulation_steps, schedule=p.schedule,
                            virtual_stages=p.virtual_stages, boundaries=p.boundaries, dp_group=None, verbose=True)
    runner.batch_rows = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    split = runner.split
    stage_named = [(f"stage{s}.{n}", p) for m, s in zip(split.modules, split.stage_indices)
                   for n, p in m.named_parameters()]
    opt = zero_optimizer(runner, cfg.optimizer, stage=cfg.zero.stage, zero_config=cfg.zero,
                         param_groups=stage_groups(groups, stage_named, unsplit_names(model, stage_named), canonical),
                         max_grad_norm=cfg.gradient_clipping or None, counter=counter,
                         grad_accum_dtype=_accum_dtype(cfg))
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = PipelineEngine(model, cfg, runner, opt, sched, mesh)
    return engine, opt, _loader(training_data, collate_fn, cfg, dp_group), sched


def _agreed_blocks(config: dict | str | Config, groups: list) -> Blocks | Config:
    """Read and check the config on every rank before the first collective of the run, then agree on it: a config
    one rank cannot read or parse fails on every rank with that rank's message, and configs that differ between
    ranks fail everywhere (instead of a hang, or a peer's "connection closed", on the ranks that were fine).
    ``groups``: the caller's mesh or groups (default: the whole job)."""
    blocks, error = None, None
    try:
        blocks = config if isinstance(config, Config) else Blocks.parse(read_config(config))
    except (ValueError, TypeError) as e:
        error = e
    if not groups:
        groups = [dist.group.WORLD]
    elif hasattr(groups[0], "mesh_dim_names"):  # a mesh: its axes, in turn
        groups = [groups[0][name].get_group() for name in groups[0].mesh_dim_names]
    raise_if_any_failed(error, groups, what="llmpar.initialize: the config is invalid on one rank")
    assert blocks is not None
    fingerprint = json.dumps(blocks.raw, sort_keys=True, default=str)
    same = None
    for group in groups:
        try:
            check_same_on_ranks(fingerprint, group, what="the DeepSpeed config differs between ranks",
                                hint="give every rank the same config")
        except ValueError as e:
            same = same or e
    raise_if_any_failed(same, groups, what="the DeepSpeed config differs between ranks")
    return blocks


def _typed(blocks: Blocks | Config, dp: int) -> Config:
    """The config for ``dp`` ranks (a Config given by the caller must have been parsed for that dp)."""
    if isinstance(blocks, Config):
        if blocks.dp != dp:
            raise ValueError(f"the config was parsed for dp={blocks.dp} but there are {dp} data-parallel ranks")
        cfg = blocks
    else:
        cfg = Config.from_blocks(blocks, dp=dp)
    _refuse_unwired(cfg)
    return cfg


def _refuse_unwired(cfg: Config) -> None:
    """Blocks the config parses but no engine acts on yet: an error, never a silent fp32 / no-recompute run."""
    if cfg.fp16.enabled:
        raise ValueError('"fp16.enabled"=true: not supported yet by the engines: use "bf16"')
    if cfg.activation_checkpointing.enabled:
        raise ValueError('"activation_checkpointing": not supported yet by the engines: use torch.utils.checkpoint '
                         "in the model")


def _accum_dtype(cfg: Config) -> torch.dtype | None:
    return torch.float32 if cfg.bf16 and cfg.gradient_accumulation_steps > 1 else None


def _resolve_groups(mesh: Any, dp_group: Group | None, tp_group: Group | None) -> tuple[Group, Group | None]:
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if dp_group is None and "dp" in names:
            dp_group = mesh["dp"]
        if tp_group is None and "tp" in names and mesh["tp"].size() > 1:
            tp_group = mesh["tp"]
    if dp_group is None:
        init_distributed()  # adopts an existing group, or a world of one without torchrun
        dp_group = dist.group.WORLD
        if dist.get_world_size() > 1 and tp_group is not None:
            raise ValueError("tp_group given without dp_group or mesh: pass mesh=env.mesh (or dp_group=) so ZeRO "
                             "knows its data-parallel ranks")
    return as_group(dp_group), (as_group(tp_group) if tp_group is not None else None)


def _loader(training_data: Any, collate_fn: Any, cfg: Config, dp_group: Group) -> Any:
    """This dp rank's loader of micro-batches (shuffled by a DistributedSampler), or None without data."""
    if training_data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(training_data, num_replicas=group_size(dp_group), rank=group_rank(dp_group),
                                 shuffle=True)
    return DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn)


__all__ = ["initialize"]
