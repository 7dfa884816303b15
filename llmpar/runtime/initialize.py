"""``llmpar.initialize``: the one front door. A DeepSpeed config in, a training engine out.

    engine, optimizer, loader, scheduler = llmpar.initialize(model=model, config={...DeepSpeed JSON...} or "ds.json")

The config is read once (``read_config``, ``Blocks.parse``) and agreed between the ranks, its parallel blocks give the
degrees (``Blocks.degrees``), the degrees give the mesh (``llmpar.init_distributed``; or the caller's ``mesh=`` /
``dp_group=`` / ``tp_group=``), the mesh gives dp, and dp gives the typed :class:`Config`. Then one of two engines is
built on the same steps:

* no ``"pipeline"`` block (``build_engine.py``): :class:`Engine` with a ZeroOptimizer (stages 0-3, CPU offload).
  A ``"tensor_parallel": {"size": N}`` block without a mesh builds the dp x tp mesh and splits the model with
  ``llmpar.parallelize``.
* ``"context_parallel": {"size": N, "mode": ...}`` (or DeepSpeed's ``"sequence_parallel_size": N``): the
  ``[pp, dp, cp, tp]`` mesh (built here, or the caller's ``mesh=`` with a "cp" axis of N), a ``ContextParallel``
  over its cp axis (hybrid: Ulysses over the inner ``ulysses_size`` ranks, ring across), the model prepared by its
  adapter (``llmpar.context_parallel.adapters``), ZeRO over the dp x cp group; ``engine(...)`` shards each batch.
* a ``"pipeline"`` block (``build_pipeline_engine.py``): :class:`PipelineEngine`: the model cut into stages over
  the [pp, dp, tp] mesh, tensor parallel inside each, a ZeroOptimizer (stages 0-2) per stage.

bf16 puts the model in bfloat16 with fp32 master weights (and fp32 gradient accumulation when
gradient_accumulation_steps > 1); fp16 the same in float16, with loss scaling (``loss_scale.py``). An
``"activation_checkpointing"`` block recomputes the model's blocks in backward (``activations.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from llmpar.distributed.agree import check_same_on_ranks, raise_if_any_failed
from llmpar.distributed.collectives import CommCounter, Group
from llmpar.distributed.init import init_distributed
from llmpar.runtime.args import config_from_args, give_local_rank, take_local_rank
from llmpar.runtime.blocks import refuse_cp_with_pipeline
from llmpar.runtime.build_engine import build_engine
from llmpar.runtime.build_pipeline_engine import build_pipeline_engine
from llmpar.runtime.client import client_optimizer, client_scheduler
from llmpar.runtime.config import Blocks, Config, read_config
from llmpar.runtime.expert_block import refuse_ep_with_pipeline
from llmpar.runtime.logs import default_log_handler, log_initialized
from llmpar.runtime.params import canonical_names, named_groups
from llmpar.runtime.pipeline_engine import is_pipeline_module
from llmpar.runtime.resume import apply_auto_resume
from llmpar.zero import mark_owner

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
    apply_auto_resume(engine, blocks.checkpoint)  # "checkpoint": {"auto_resume": DIR}: load DIR's latest (resume.py)
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
    """The engine of ``blocks`` (agreed between the ranks) for ``model``: a pipeline engine
    (``build_pipeline_engine.py``) or the plain one (``build_engine.py``)."""
    pipe_module = is_pipeline_module(model)
    if blocks.pipeline is not None and blocks.pipeline.stages is None and not pipe_module:
        raise ValueError(
            '"pipeline.stages"="auto" takes the stage count of a llmpar.pipe.PipelineModule; this model '
            "is not one: give the number of stages"
        )
    if pipe_module:
        refuse_cp_with_pipeline(blocks.context_parallel, "a PipelineModule")
    if blocks.pipeline is not None or pipe_module:  # a PipelineModule: a pipeline engine, block or not
        refuse_ep_with_pipeline(blocks.expert_parallel, 'a "pipeline" block' if not pipe_module else "a PipelineModule")
        if dp_group is not None or tp_group is not None or unit_policy is not None:
            raise ValueError(
                'with a "pipeline" block llmpar.initialize splits the model itself: pass mesh= at '
                "most, not dp_group= / tp_group= / unit_policy="
            )
        return build_pipeline_engine(
            model,
            blocks,
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
    return build_engine(model, blocks, model_parameters, mesh, dp_group, tp_group, counter, unit_policy)


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
    fingerprint = blocks.fingerprint()
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


__all__ = ["initialize"]
