"""The plain engine (no pipeline) that ``llmpar.initialize`` builds: ZeRO stages 0-3 over the data-parallel ranks,
the model split for tensor parallelism when the config asks and the caller did not, context parallelism over the
mesh's cp axis (ZeRO then runs over the dp x cp group), mixture-of-experts layers spread over the expert-parallel
ranks of the ``"expert_parallel"`` block (``experts.py``; ZeRO shards their experts over the expert-data-parallel
group).

    engine, optimizer, _, scheduler = build_engine(model, blocks, model_parameters, mesh, dp_group, tp_group, ...)

``blocks`` are the agreed config blocks (``initialize.py``); the batch sizes follow once the mesh gives dp
(:func:`typed_config`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.collectives import CommCounter, Group, as_group, group_size
from llmpar.distributed.init import init_distributed
from llmpar.models.anatomy import family, name_matches
from llmpar.runtime.activations import apply_activation_checkpointing
from llmpar.runtime.blocks import ContextParallelConfig
from llmpar.runtime.config import Blocks, Config
from llmpar.runtime.engine import Engine
from llmpar.runtime.expert_block import apply_grouped_mm_impl
from llmpar.runtime.experts import setup_experts
from llmpar.runtime.params import named_groups
from llmpar.runtime.precision import build_loss_scaler, model_dtype
from llmpar.runtime.schedules import WarmupSchedule
from llmpar.tensor_parallel.parallelize import DEFAULT_PLANS, parallelize
from llmpar.zero.init import recording
from llmpar.zero.optimizer import ZeroOptimizer


def _tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan ``"tensor_parallel"`` splits the model by: parallelize's default (None), except for a model with MoE
    layers (a module named ``experts``), whose MLP entries that match no module are left out: the MoE layers stay
    whole on each tp rank (replicated over tp, spread over the ep ranks of their tp coordinate), the attention, the
    embeddings and any dense MLP are split (was: "plan entries ['mlp.fc', 'mlp.proj'] match no module")."""
    fam = family(model)
    names = [n for n, _ in model.named_modules() if n]
    if fam is None or not any(name_matches(n, "experts") for n in names):
        return None
    plan = DEFAULT_PLANS[fam]
    return {k: v for k, v in plan.items() if not k.startswith("mlp.") or any(name_matches(n, k) for n in names)}


def build_engine(
    model: nn.Module,
    blocks: Blocks | Config,
    model_parameters: Any,
    mesh: Any,
    dp_group: Group | None,
    tp_group: Group | None,
    counter: CommCounter | None,
    unit_policy: Any,
) -> tuple[Engine, ZeroOptimizer, None, WarmupSchedule | None]:
    """``(engine, optimizer, None, scheduler)`` of ``blocks`` for ``model`` (module docstring)."""
    _, tp = blocks.degrees
    split_here = False
    cpc = blocks.context_parallel
    if cpc.size > 1:
        mesh = _cp_mesh(cpc.size, tp, mesh, dp_group, tp_group)
        if tp > 1 and not any(getattr(p, "tensor_model_parallel", False) for p in model.parameters()):
            with recording(model):  # a model built in llmpar.zero.Init: each rank records its slices
                parallelize(model, mesh["tp"], _tp_plan(model))
            split_here = True
    elif tp > 1 and mesh is None and dp_group is None and tp_group is None:
        mesh = init_distributed(tp=tp).mesh  # the dp x tp mesh; the model is split over its tp axis below
        if not any(getattr(p, "tensor_model_parallel", False) for p in model.parameters()):
            with recording(model):  # a model built in llmpar.zero.Init: each rank records its slices
                parallelize(model, mesh["tp"], _tp_plan(model))
            split_here = True
    dp_group, tp_group = _resolve_groups(mesh, dp_group, tp_group)
    cfg = typed_config(blocks, group_size(dp_group))
    cp, adapter, zero_group = None, None, dp_group
    if cpc.size > 1:
        cp, adapter, zero_group = _context_parallel(model, cpc, mesh)
    tp_now = group_size(tp_group) if tp_group is not None else 1
    if blocks.tensor_parallel_given and tp != tp_now:
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
    moe = setup_experts(model, blocks.expert_parallel, mesh, zero_group)  # before the optimizer sees the experts
    apply_grouped_mm_impl(model, blocks.expert_parallel)  # the swapped blocks' grouped GEMM backends
    spread = moe is not None and (moe.ep > 1 or moe.etp > 1)  # expert params: their own optimizer
    opt = ZeroOptimizer(
        named_groups(model, model_parameters, strict=split_here),
        cfg.optimizer,
        zero_group,
        zero_config=cfg.zero,
        tp_group=tp_group,
        max_grad_norm=cfg.gradient_clipping or None,
        counter=counter,
        grad_accum_dtype=accum_dtype(cfg),
        module=model,
        unit_policy=unit_policy,
        loss_scaler=build_loss_scaler(cfg.fp16),
        expert_group=moe.edp_group if spread else None,
        ep_group=moe.ep_group if spread else None,
        etp_group=moe.etp_group if spread else None,
    )
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = Engine(
        model,
        cfg,
        opt,
        sched,
        dp_group=dp_group,
        tp_group=tp_group,
        mesh=mesh,
        context_parallel=cp,
        adapter=adapter,
        moe=moe,
    )
    return engine, opt, None, sched


def _cp_mesh(size: int, tp: int, mesh: Any, dp_group: Group | None, tp_group: Group | None) -> Any:
    """The ``[pp, dp, cp, tp]`` mesh of a context-parallel run: built here, or the caller's (checked)."""
    if dp_group is not None or tp_group is not None:
        raise ValueError(
            '"context_parallel" takes its groups from the [pp, dp, cp, tp] mesh: pass mesh='
            f"llmpar.distributed.init_distributed(cp={size}, tp={tp}).mesh (or nothing), not dp_group= / tp_group="
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
            f'"context_parallel.size"={size} but mesh= has {got}: pass '
            f"llmpar.distributed.init_distributed(cp={size}, tp={tp}).mesh"
        )
    return mesh


def _context_parallel(model: nn.Module, cpc: ContextParallelConfig, mesh: Any) -> tuple[Any, Any, dist.ProcessGroup]:
    """(ContextParallel over the mesh's cp axis, the model's adapter (model prepared), ZeRO's dp x cp group)."""
    from llmpar.context_parallel.adapters import adapter_for
    from llmpar.context_parallel.core import ContextParallel
    from llmpar.distributed.dims import ParallelDims

    adapter = adapter_for(model)  # a TypeError for a model no adapter runs: on every rank alike
    zero_group = ParallelDims.from_mesh(mesh).group("dp_cp")
    cp = ContextParallel.from_mesh(mesh, cpc.mode, cpc.ulysses_size)
    adapter.prepare(model, cp)
    return cp, adapter, zero_group


def typed_config(blocks: Blocks | Config, dp: int) -> Config:
    """The config for ``dp`` ranks (a Config given by the caller must have been parsed for that dp)."""
    if isinstance(blocks, Config):
        if blocks.dp != dp:
            raise ValueError(f"the config was parsed for dp={blocks.dp} but there are {dp} data-parallel ranks")
        cfg = blocks
    else:
        cfg = Config.from_blocks(blocks, dp=dp)
    return cfg


def accum_dtype(cfg: Config) -> torch.dtype | None:
    """fp32 gradient accumulation for bf16 / fp16 params over several micro-batches (None: the params' dtype)."""
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


__all__ = ["accum_dtype", "build_engine", "typed_config"]
