"""``llmpar.initialize``: the one front door. A DeepSpeed config in, a training engine out.

    engine, optimizer, loader, scheduler = llmpar.initialize(model=model, config={...DeepSpeed JSON...} or "ds.json")

The config is read once (``read_config``), its parallel blocks give the degrees (``parallel_degrees``), the degrees
give the mesh (``llmpar.init_distributed``; or the caller's ``mesh=`` / ``dp_group=`` / ``tp_group=``), the mesh
gives dp, and dp gives the typed :class:`Config`. Then one of two engines is built on the same steps:

* no ``"pipeline"`` block: :class:`Engine` with a ZeroOptimizer (stages 0-3, CPU offload). A ``"tensor_parallel":
  {"size": N}`` block without a mesh builds the dp x tp mesh and splits the model with ``llmpar.parallelize``.
* ``"context_parallel": {"size": N, "mode": ...}`` (or DeepSpeed's ``"sequence_parallel_size": N``): the
  ``[pp, dp, cp, tp]`` mesh (built here, or the caller's ``mesh=`` with a "cp" axis of N), a ``ContextParallel``
  over its cp axis (hybrid: Ulysses over the inner ``ulysses_size`` ranks, ring across), the model prepared by its
  adapter (``llmpar.context_parallel.adapters``), ZeRO over the dp x cp group; ``engine(...)`` shards each batch.
* a ``"pipeline"`` block: :class:`PipelineEngine`: the model cut into stages over the [pp, dp, tp] mesh, tensor
  parallel inside each, a ZeroOptimizer (stages 0-2) per stage.

bf16 puts the model in bfloat16 with fp32 master weights (and fp32 gradient accumulation when
gradient_accumulation_steps > 1); fp16 the same in float16, with loss scaling (``loss_scale.py``). An
``"activation_checkpointing"`` block recomputes the model's blocks in backward (``activations.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.agree import check_same_on_ranks, raise_if_any_failed
from llmpar.distributed.collectives import CommCounter, Group, as_group, group_size
from llmpar.distributed.init import init_distributed
from llmpar.runtime.activations import apply_activation_checkpointing
from llmpar.runtime.args import config_from_args, give_local_rank, take_local_rank
from llmpar.runtime.client import client_optimizer, client_scheduler
from llmpar.runtime.config import Blocks, Config, read_config
from llmpar.runtime.engine import Engine
from llmpar.runtime.logs import default_log_handler, log_initialized
from llmpar.runtime.params import canonical_names, named_groups, stage_groups, unsplit_names
from llmpar.runtime.pipeline_engine import PipelineEngine, is_pipeline_module, pipeline_loader
from llmpar.runtime.precision import build_loss_scaler, model_dtype
from llmpar.runtime.resume import apply_auto_resume
from llmpar.runtime.schedules import WarmupSchedule
from llmpar.tensor_parallel.parallelize import parallelize
from llmpar.zero import mark_owner
from llmpar.zero.init import recording
from llmpar.zero.optimizer import ZeroOptimizer

logger = logging.getLogger("llmpar")


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: dict | str | Config | None = None,
    mesh_param: Any = None,
    config_params: Any = None,
    *,
    mesh: Any = None,
    dp_group: Group | None = None,
    tp_group: Group | None = None,
    counter: CommCounter | None = None,
    unit_policy: Any = None,
    loss_fn: Callable | None = None,
    timeout_s: float | None = None,
    **unsupported: Any,
):
    """Build the engine from a DeepSpeed config. Returns ``(engine, optimizer, training_dataloader or None,
    lr_scheduler or None)``. DeepSpeed's signature (its positional order too), plus llmpar's keywords.

    config: a dict or the path of a JSON file (``config_params=``: its old name), or ``args.deepspeed_config``
    (``llmpar.add_config_arguments``). args: also ``args.local_rank`` (``--local_rank``, checked against
    ``LOCAL_RANK`` and set to the local rank afterwards). model_parameters: params, (name, param) pairs or param-group
    dicts (default: all of the model's, weight decay on all, as DeepSpeed); bare params keep their names in the model.
    Under a pipeline the groups follow each param to its stage by its name in the unsplit model.
    optimizer / lr_scheduler: client objects (or callables) mapped onto the ZeRO optimizer (``client.py``; they
    replace the config's "optimizer" / "scheduler" blocks, with a warning when both are given).
    training_data (+ collate_fn): the engine's ``training_dataloader`` (DeepSpeed's sampler semantics,
    ``engine.deepspeed_io``). dist_init_required=False: torch.distributed must be initialized already.
    distributed_port: accepted (torchrun / the launcher set ``MASTER_PORT``). mpu / mesh_param: not taken (errors
    naming mesh= / dp_group= / tp_group=).
    mesh / dp_group / tp_group: where ZeRO and tensor parallelism run (default: ``mesh["dp"]`` / ``mesh["tp"]``, else
    the whole job). unit_policy: stage 3 sharding units, ``policy(name, module) -> bool`` (default: transformer
    blocks, embeddings, head; see ``llmpar.zero.stage3.unit_modules``). loss_fn: ``(output, target) -> mean loss`` of
    a pipeline engine (default ``model.loss``). timeout_s: how long a collective waits for its peers before failing
    with a ``CollectiveError`` naming the operation and the engine's step (when initialize starts torch.distributed;
    default ``LLMPAR_TIMEOUT_S`` or 600).
    """
    if unsupported:
        raise TypeError(f"llmpar.initialize got unsupported arguments {sorted(unsupported)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise ValueError(
            "mpu= (a Megatron model-parallel unit) is not taken: pass its groups, dp_group="
            "mpu.get_data_parallel_group(), tp_group=mpu.get_model_parallel_group(), or mesh="
        )
    if mesh_param is not None:
        raise ValueError(
            "mesh_param= is not taken: pass mesh= (llmpar.init_distributed(tp=, pp=).mesh) or the "
            'config\'s "tensor_parallel" / "pipeline" blocks'
        )
    config = config_from_args(args, config, config_params)
    take_local_rank(args)
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialized: initialize it first "
            "(llmpar.init_distributed()) or leave dist_init_required unset"
        )
    init_distributed(timeout_s=timeout_s)  # the default group (a world of one without torchrun)
    default_log_handler(dist.get_rank())
    blocks = _agreed_blocks(config, [mesh] if mesh is not None else [g for g in (dp_group, tp_group) if g is not None])
    torch_opt = None
    if optimizer is not None:
        torch_opt, model_parameters, opt_cfg = client_optimizer(
            model, optimizer, model_parameters, blocks.gradient_clipping
        )
        if blocks.optimizer_given and dist.get_rank() == 0:
            logger.warning(
                'llmpar.initialize: optimizer=%s replaces the config\'s "optimizer" block', type(torch_opt).__name__
            )
        blocks = dataclasses.replace(blocks, optimizer=opt_cfg, optimizer_given=True)
    if lr_scheduler is not None and blocks.scheduler is not None:
        if dist.get_rank() == 0:
            logger.warning('llmpar.initialize: lr_scheduler= replaces the config\'s "scheduler" block')
        blocks = dataclasses.replace(blocks, scheduler=None)
    engine, opt, loader, sched = _build(
        model,
        blocks,
        model_parameters,
        training_data,
        collate_fn,
        mesh,
        dp_group,
        tp_group,
        counter,
        unit_policy,
        loss_fn,
    )
    mark_owner(opt)  # zero.GatheredParameters(params) finds it
    if torch_opt is not None:
        engine.client_optimizer_name = type(torch_opt).__name__
    if lr_scheduler is not None:
        engine.lr_scheduler, engine.client_optimizer = client_scheduler(lr_scheduler, torch_opt, opt)
        engine.mirror_lrs_from_client()
    engine.collate_fn = collate_fn
    if training_data is not None and engine.training_dataloader is None:
        engine.training_dataloader = engine.deepspeed_io(training_data)
    apply_auto_resume(engine, blocks.raw)  # "checkpoint": {"auto_resume": DIR}: load DIR's latest (resume.py)
    give_local_rank(args, engine.local_rank)
    log_initialized(engine)
    return engine, opt, engine.training_dataloader, engine.lr_scheduler


def _build(
    model: nn.Module,
    blocks: Blocks,
    model_parameters: Any,
    training_data: Any,
    collate_fn: Any,
    mesh: Any,
    dp_group: Group | None,
    tp_group: Group | None,
    counter: CommCounter | None,
    unit_policy: Any,
    loss_fn: Callable | None,
):
    """The engine of ``blocks`` (agreed between the ranks) for ``model``: the body of :func:`initialize`."""
    raw = blocks.raw
    pp, tp = blocks.degrees
    if blocks.pipeline is not None and blocks.pipeline.stages is None and not is_pipeline_module(model):
        raise ValueError(
            '"pipeline.stages"="auto" takes the stage count of a llmpar.pipe.PipelineModule; this model '
            "is not one: give the number of stages"
        )
    if blocks.context_parallel.size > 1 and is_pipeline_module(model):
        raise ValueError(
            f'"context_parallel.size"={blocks.context_parallel.size} with a PipelineModule: context '
            "parallelism is not supported with pipeline parallelism; use one of them"
        )
    if "pipeline" in raw or is_pipeline_module(model):  # a PipelineModule: a pipeline engine, block or not
        if dp_group is not None or tp_group is not None or unit_policy is not None:
            raise ValueError(
                'with a "pipeline" block llmpar.initialize splits the model itself: pass mesh= at '
                "most, not dp_group= / tp_group= / unit_policy="
            )
        return _initialize_pipeline(
            model,
            blocks,
            pp,
            tp,
            mesh,
            loss_fn,
            counter,
            training_data,
            collate_fn,
            named_groups(model, model_parameters),
            canonical_names(model),
        )
    if loss_fn is not None:
        raise ValueError('loss_fn= is used by pipeline engines only (a config with a "pipeline" block)')
    split_here = False
    cpc = blocks.context_parallel
    if cpc.size > 1:
        mesh = _cp_mesh(cpc.size, tp, mesh, dp_group, tp_group)
        if tp > 1 and not any(getattr(p, "tensor_model_parallel", False) for p in model.parameters()):
            with recording(model):  # a model built in llmpar.zero.Init: each rank records its slices
                parallelize(model, mesh["tp"])
            split_here = True
    elif tp > 1 and mesh is None and dp_group is None and tp_group is None:
        mesh = init_distributed(tp=tp).mesh  # the dp x tp mesh; the model is split over its tp axis below
        if not any(getattr(p, "tensor_model_parallel", False) for p in model.parameters()):
            with recording(model):  # a model built in llmpar.zero.Init: each rank records its slices
                parallelize(model, mesh["tp"])
            split_here = True
    dp_group, tp_group = _resolve_groups(mesh, dp_group, tp_group)
    cfg = _typed(blocks, group_size(dp_group))
    cp, adapter, zero_group = None, None, dp_group
    if cpc.size > 1:
        cp, adapter, zero_group = _context_parallel(model, cpc, mesh)
    tp_now = group_size(tp_group) if tp_group is not None else 1
    if "tensor_parallel" in raw and tp != tp_now:
        raise ValueError(
            f'"tensor_parallel.size"={tp} but tp_group has {tp_now} ranks: pass the mesh of '
            f"llmpar.init_distributed(tp={tp}) (or leave out mesh= and let initialize build it)"
        )
    if next(model.parameters()).device.type == "meta" and cfg.zero.stage != 3:  # built under llmpar.zero.Init
        raise ValueError(
            f"the model is on the meta device (llmpar.zero.Init) but zero_optimization.stage is "
            f"{cfg.zero.stage}: only stage 3 materialises a meta model"
        )
    dtype = model_dtype(cfg.bf16, cfg.fp16)
    if dtype is not None:
        model.to(dtype)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, tp_group)
    opt = ZeroOptimizer(
        named_groups(model, model_parameters, strict=split_here),
        cfg.optimizer,
        zero_group,
        zero_config=cfg.zero,
        tp_group=tp_group,
        max_grad_norm=cfg.gradient_clipping or None,
        counter=counter,
        grad_accum_dtype=_accum_dtype(cfg),
        module=model,
        unit_policy=unit_policy,
        loss_scaler=build_loss_scaler(cfg.fp16),
    )
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = Engine(
        model, cfg, opt, sched, dp_group=dp_group, tp_group=tp_group, mesh=mesh, context_parallel=cp, adapter=adapter
    )
    return engine, opt, None, sched


def _cp_mesh(size: int, tp: int, mesh: Any, dp_group: Group | None, tp_group: Group | None) -> Any:
    """The ``[pp, dp, cp, tp]`` mesh of a context-parallel run: built here, or the caller's (checked)."""
    if dp_group is not None or tp_group is not None:
        raise ValueError(
            '"context_parallel" takes its groups from the [pp, dp, cp, tp] mesh: pass mesh='
            f"llmpar.init_distributed(cp={size}, tp={tp}).mesh (or nothing), not dp_group= / tp_group="
        )
    if mesh is None:
        world = dist.get_world_size()
        if world % (size * tp):
            what = f'"context_parallel.size"={size}' + (f' x "tensor_parallel.size"={tp}' if tp > 1 else "")
            raise ValueError(
                f"{what} does not divide the world size {world}: the cp (x tp) ranks of each "
                "data-parallel group split one sequence; choose sizes whose product divides it"
            )
        return init_distributed(cp=size, tp=tp).mesh
    names = mesh.mesh_dim_names or ()
    if "cp" not in names or mesh["cp"].size() != size:
        got = f"cp={mesh['cp'].size()}" if "cp" in names else f"axes {names}"
        raise ValueError(
            f'"context_parallel.size"={size} but mesh= has {got}: pass llmpar.init_distributed(cp={size}, tp={tp}).mesh'
        )
    return mesh


def _context_parallel(model: nn.Module, cpc: Any, mesh: Any) -> tuple[Any, Any, dist.ProcessGroup]:
    """(ContextParallel over the mesh's cp axis, the model's adapter (model prepared), ZeRO's dp x cp group)."""
    from llmpar.context_parallel.adapters import adapter_for
    from llmpar.context_parallel.core import ContextParallel
    from llmpar.distributed.dims import ParallelDims

    adapter = adapter_for(model)  # a TypeError for a model no adapter runs: on every rank alike
    names = mesh.mesh_dim_names
    dims = ParallelDims(
        **{n: mesh[n].size() for n in ("pp", "dp", "cp", "tp") if n in names}, world_size=dist.get_world_size()
    )
    u = cpc.ulysses_size

    def coords(r: int, *axes: str) -> tuple:
        c = dims.coordinates(r)
        return tuple(c[a] for a in axes)

    zero_group = (
        mesh["cp"].get_group()
        if dims.dp == 1 and dims.pp == 1 and dims.tp == 1
        else dims.new_group(lambda r: coords(r, "pp", "tp"))
    )
    if cpc.mode == "ulysses":
        cp = ContextParallel("ulysses", ulysses_group=mesh["cp"].get_group())
    elif cpc.mode == "ring":
        cp = ContextParallel("ring", ring_group=mesh["cp"].get_group())
    else:  # cp rank = ring rank * u + ulysses rank: Ulysses over adjacent cp ranks, ring across
        uly = dims.new_group(lambda r: (*coords(r, "pp", "dp", "tp"), coords(r, "cp")[0] // u))
        ring = dims.new_group(lambda r: (*coords(r, "pp", "dp", "tp"), coords(r, "cp")[0] % u))
        cp = ContextParallel("hybrid", ulysses_group=uly, ring_group=ring)
    adapter.prepare(model, cp)
    return cp, adapter, zero_group


def _initialize_pipeline(
    model: nn.Module,
    blocks: Blocks | Config,
    pp: int,
    tp: int,
    mesh: Any,
    loss_fn: Any,
    counter: Any,
    training_data: Any,
    collate_fn: Any,
    groups: list[dict],
    canonical: dict[str, str],
):
    from llmpar.pipeline.build import build_pipeline  # loads torch.distributed.pipelining: only when needed
    from llmpar.pipeline.zero import zero_optimizer

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
    cfg = _typed(blocks, group_size(dp_group))
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
    chosen = p is not None and (not pipe_module or "schedule" in blocks.raw.get("pipeline", {}))
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
        grad_accum_dtype=_accum_dtype(cfg),
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


def _agreed_blocks(config: dict | str | Config, groups: list) -> Blocks | Config:
    """Read and check the config on every rank before the first collective of the run, then agree on it: a config
    one rank cannot read or parse fails on every rank with that rank's message, and configs that differ between
    ranks fail everywhere (instead of a hang, or a peer's "connection closed", on the ranks that were fine).
    ``groups``: the caller's mesh or groups (default: the whole job)."""
    blocks, error = None, None
    try:
        blocks = config if isinstance(config, Blocks) else Blocks.parse(read_config(config))
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
            check_same_on_ranks(
                fingerprint,
                group,
                what="the DeepSpeed config differs between ranks",
                hint="give every rank the same config",
            )
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
    return cfg


def _refuse_unwired(cfg: Config) -> None:
    """Blocks the pipeline engine does not act on yet: an error, never a silent fp32 run."""
    if cfg.fp16.enabled:
        raise ValueError(
            '"fp16.enabled"=true: not supported yet with "pipeline" (the loss scale would have to run '
            'inside the pipeline schedule): use "bf16", or fp16 without "pipeline"'
        )


def _accum_dtype(cfg: Config) -> torch.dtype | None:
    return torch.float32 if (cfg.bf16 or cfg.fp16.enabled) and cfg.gradient_accumulation_steps > 1 else None


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
            raise ValueError(
                "tp_group given without dp_group or mesh: pass mesh=env.mesh (or dp_group=) so ZeRO "
                "knows its data-parallel ranks"
            )
    return as_group(dp_group), (as_group(tp_group) if tp_group is not None else None)


__all__ = ["initialize"]
