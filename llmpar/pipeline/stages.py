"""``split(model, mesh, ...)``: cut a model into pipeline stages and keep this rank's (:class:`PipelineSplit`).

The model is read as a sequence of blocks (:func:`llmpar.pipeline.blocks.to_blocks`). ``pp * virtual_stages``
stages are cut contiguously, balanced by parameter count (``by="params"``), by measured forward+backward time of
each block on a sample micro-batch (``by="time"``), or at explicit ``boundaries``. Stage ``s`` lives on pp rank
``s % pp`` (the looped layout ``torch.distributed.pipelining``'s interleaved schedule expects), so with
``virtual_stages = v`` rank r holds stages ``r, r + pp, ..., r + (v - 1) pp``.

Every rank builds the whole model with the same seed and keeps only its stages' blocks (drop your reference to the
full model afterwards to free the rest). With a ``"tp"`` axis of size > 1 in ``mesh``, each kept stage is split
with :func:`llmpar.tensor_parallel.parallelize` (the plan filtered to the modules that stage holds).

A model with a ``pipeline_split(mesh, verbose=)`` method cuts itself: :class:`~llmpar.pipeline.module.PipelineModule`
(DeepSpeed's), whose ranks build only their own stage's layers.

Parameters shared between stages (tied embeddings: ``tok_emb`` on the first stage, ``lm_head`` on the last) are
recorded in ``PipelineSplit.tied``; the runner sums their gradients over the pp group so the copies stay equal.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llmpar.distributed.collectives import as_group, broadcast, group_rank, group_size
from llmpar.models.anatomy import family, name_matches
from llmpar.pipeline.blocks import StageModule, stage_key, to_blocks
from llmpar.pipeline.partition import balanced_boundaries, check_boundaries, stage_ranges

logger = logging.getLogger("llmpar")
SPLIT_BY = ("params", "time")


@dataclass(kw_only=True)
class StageInfo:
    """One stage of the layout (the same on every rank)."""

    index: int
    pp_rank: int
    blocks: list[str]
    params: int
    param_bytes: int
    cost: float


@dataclass(kw_only=True)
class PipelineSplit:
    """The layout of all stages plus the modules of this rank's stages (in stage order)."""

    pp: int
    virtual_stages: int
    by: str
    boundaries: list[int]
    stages: list[StageInfo]
    modules: list[StageModule]
    stage_indices: list[int]
    pp_group: dist.ProcessGroup
    pp_rank: int
    tp: int = 1
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    tied: list[dict[int, str]] = field(default_factory=list)  # per shared parameter: {stage index: name in stage}

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def format(self) -> str:
        """The layout as a table: blocks, parameters and memory per stage."""
        lines = [
            f"pipeline layout: {sum(len(s.blocks) for s in self.stages)} blocks -> {self.num_stages} stages "
            f"(pp={self.pp}, virtual={self.virtual_stages}, tp={self.tp}), split by {self.by}",
            f"{'stage':>5} {'rank':>4}  {'blocks':<28} {'params':>12} {'weights MiB':>11} {'train MiB/rank':>14}",
        ]
        for s in self.stages:
            elem = s.param_bytes / max(1, s.params)
            train = s.params * (2 * elem + 8) / self.tp / 2**20  # weights + grads + 2 fp32 AdamW moments, / tp
            lines.append(
                f"{s.index:>5} {s.pp_rank:>4}  {_names(s.blocks):<28} {s.params:>12,} "
                f"{s.param_bytes / 2**20:>11.2f} {train:>14.2f}"
            )
        if self.tied:
            lines.append(
                "tied across stages: "
                + "; ".join(" = ".join(f"stage {i}:{n}" for i, n in sorted(t.items())) for t in self.tied)
            )
        return "\n".join(lines)


def _names(blocks: list[str]) -> str:
    return ", ".join(blocks) if len(blocks) <= 3 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"


def _unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters())  # named_parameters() already lists a shared tensor once


def _resolve_mesh(
    mesh: Any,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """(pp group, tp group, dp group, every axis group in mesh order)."""
    if isinstance(mesh, DeviceMesh) and mesh.ndim > 1:
        names = mesh.mesh_dim_names or ()
        if "pp" not in names:
            raise ValueError(
                f"mesh has axes {names}, none named 'pp': pass the [pp, dp, tp] mesh of "
                "llmpar.init_distributed(pp=...) or the pp group itself"
            )
        groups = {n: as_group(mesh[n]) for n in names}
        return groups["pp"], groups.get("tp"), groups.get("dp"), [groups[n] for n in names]
    try:
        pg = as_group(mesh)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"mesh must be a DeviceMesh with a 'pp' axis, a 1-D DeviceMesh or a ProcessGroup: {err}"
        ) from None
    return pg, None, None, [pg]


def _measure_costs(blocks: list[tuple[str, nn.Module]], sample: Any, reps: int) -> list[float]:
    """Median forward+backward seconds of each block, feeding each block the previous block's output."""
    costs: list[list[float]] = [[] for _ in blocks]
    for _ in range(reps + 1):  # the first round warms up
        x = sample
        for i, (_, block) in enumerate(blocks):
            inp = x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
            t0 = time.perf_counter()
            out = block(inp)
            out.float().square().mean().backward()
            costs[i].append(time.perf_counter() - t0)
            x = out.detach()
    for _, block in blocks:
        for p in block.parameters():
            p.grad = None
    return [statistics.median(c[1:]) for c in costs]


def _default_plan(model: nn.Module) -> dict[str, str]:
    """The default plan of the model's layout family (GPT, Llama), chosen as ``llmpar.parallelize`` chooses it."""
    from llmpar.tensor_parallel.parallelize import DEFAULT_PLANS

    fam = family(model)
    if fam is None:
        raise ValueError(f"no default tensor-parallel plan fits {type(model).__name__}; pass tp_plan={{pattern: kind}}")
    return dict(DEFAULT_PLANS[fam])


def split(
    model: nn.Module,
    mesh: Any,
    *,
    by: str = "params",
    boundaries: Sequence[int] | None = None,
    virtual_stages: int = 1,
    sample: Any = None,
    time_reps: int = 3,
    tp_plan: Mapping[str, str] | None = None,
    verbose: bool = True,
) -> PipelineSplit:
    """Cut ``model`` into ``pp * virtual_stages`` stages and return this rank's (see the module docstring).

    Args:
        mesh: the ``[pp, dp, tp]`` DeviceMesh (``llmpar.init_distributed(pp=...).mesh``), or the pp group alone.
        by: ``"params"`` (balance parameter counts) or ``"time"`` (balance measured time; needs ``sample``, the
            first block's input for one micro-batch; rank 0's timings are broadcast so every rank cuts alike).
        boundaries: explicit cuts, the first block index of stages 1..S-1 (overrides ``by``).
        virtual_stages: stages per pp rank (> 1 for the interleaved 1F1B schedule).
        tp_plan: tensor-parallel plan for the stages when the mesh has tp > 1 (default: picked from module names).
        verbose: log the layout table on global rank 0.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if callable(getattr(model, "pipeline_split", None)):  # a model that cut itself (llmpar.pipeline.PipelineModule)
        if boundaries is not None or virtual_stages != 1 or tp_plan is not None or by != "params":
            raise ValueError(
                f"{type(model).__name__} cuts itself into stages (one per pp rank, its partition_method):"
                " boundaries=, virtual_stages > 1 (interleaved schedules), tp_plan= and by= do not apply"
            )
        return model.pipeline_split(mesh, verbose=verbose)
    if by not in SPLIT_BY:
        raise ValueError(f"by={by!r} is not one of {SPLIT_BY}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} must be a positive int")
    pp_group, tp_group, dp_group, axis_groups = _resolve_mesh(mesh)
    pp, pp_rank = group_size(pp_group), group_rank(pp_group)
    tp = group_size(tp_group) if tp_group is not None else 1
    blocks = to_blocks(model)
    n_stages = pp * virtual_stages
    if len(blocks) < n_stages:
        raise ValueError(
            f"model has {len(blocks)} blocks ({', '.join(n for n, _ in blocks)}), fewer than "
            f"pp * virtual_stages = {pp} * {virtual_stages} = {n_stages} stages"
        )
    params = [sum(p.numel() for _, p in _unique_params(b)) for _, b in blocks]
    if boundaries is not None:
        cuts = check_boundaries(boundaries, len(blocks), n_stages)
        costs = [float(c) for c in params]
        by = "boundaries"
    elif by == "params":
        costs = [float(c) for c in params]
        cuts = balanced_boundaries(costs, n_stages)
    else:
        if sample is None:
            raise ValueError("by='time' needs sample=, the first block's input for one micro-batch")
        local = torch.tensor(_measure_costs(blocks, sample, time_reps), dtype=torch.float64)
        for g in axis_groups:  # everyone takes global rank 0's timings: identical cuts on every rank
            broadcast(local, 0, g)
        costs = local.tolist()
        cuts = balanced_boundaries(costs, n_stages)

    ranges = stage_ranges(cuts, len(blocks))
    stages = []
    owners: dict[int, dict[int, str]] = {}  # id(param) -> {stage: name in the stage module}
    for s, r in enumerate(ranges):
        nbytes = 0
        seen: set[int] = set()
        for i in r:
            key = stage_key(blocks[i][0])
            for pname, p in _unique_params(blocks[i][1]):
                owners.setdefault(id(p), {}).setdefault(s, f"{key}.{pname}")
                if id(p) not in seen:
                    seen.add(id(p))
                    nbytes += p.numel() * p.element_size()
        stages.append(
            StageInfo(
                index=s,
                pp_rank=s % pp,
                blocks=[blocks[i][0] for i in r],
                params=sum(params[i] for i in r),
                param_bytes=nbytes,
                cost=sum(costs[i] for i in r),
            )
        )
    tied = [where for where in owners.values() if len(where) > 1]

    mine = [s for s in range(n_stages) if s % pp == pp_rank]
    plan = None
    if tp > 1:
        plan = dict(tp_plan) if tp_plan is not None else _default_plan(model)
    modules = []
    for s in mine:
        mod = StageModule([blocks[i] for i in ranges[s]], stage_index=s, block_names=stages[s].blocks)
        if plan is not None:
            names = [n for n, _ in mod.named_modules() if n]
            local_plan = {p: k for p, k in plan.items() if any(name_matches(n, p) for n in names)}
            if local_plan:
                from llmpar.tensor_parallel.parallelize import parallelize

                parallelize(mod, tp_group, local_plan)
        modules.append(mod)
    result = PipelineSplit(
        pp=pp,
        virtual_stages=virtual_stages,
        by=by,
        boundaries=cuts,
        stages=stages,
        modules=modules,
        stage_indices=mine,
        pp_group=pp_group,
        pp_rank=pp_rank,
        tp=tp,
        tp_group=tp_group if tp > 1 else None,
        dp_group=dp_group,
        tied=tied,
    )
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info(result.format())
    return result


__all__ = ["PipelineSplit", "SPLIT_BY", "StageInfo", "split"]
