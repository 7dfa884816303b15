"""The flat buffers of a :class:`~llmpar.zero.optimizer.ZeroOptimizer` (``grads.FlatBuffer``): which trained params
share one (param group, dtype, device, tensor-parallel kind), its layout (``layout.py``: units, shards, alignment), and
the tensors it holds on this rank: the flat params (stages 0-2: the params become views into it) or this rank's shard
of them (stage 3, :func:`shard_params`), the gradient accumulator (stages 0/1) or partition (2/3), the optimizer state
of this rank's partition in its pool (``offload.Placement``: fp32 master and moments on the host under
offload_optimizer; low-bit codes and scales, ``lowbit_state.py``), and one step count per unit. Under stage 3 the
frozen params are sharded the same way in buffers of their own (:func:`frozen_buffers`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from llmpar.ops.bucket import pack_bucket
from llmpar.optim.adamw import state_dtypes
from llmpar.zero import lowbit_state
from llmpar.zero.config import OptimizerConfig, ZeroConfig
from llmpar.zero.grads import FlatBuffer
from llmpar.zero.layout import FlatLayout
from llmpar.zero.offload import Placement, master_dtype
from llmpar.zero.units import UnitPlan, split_persistent


def layout_of(
    named: Sequence[tuple[str, torch.Tensor]], shards: int, align: int, zero_config: ZeroConfig, plan: UnitPlan | None
) -> FlatLayout:
    """The flat layout of ``named`` params over ``shards`` ranks: units of at most ``reduce_bucket_size`` elements, or
    with a stage-3 ``plan`` one unit per module and the params of at most ``stage3_param_persistence_threshold``
    elements in one persistent unit."""
    params = [p for _, p in named]
    groups = None
    if plan is not None:  # stage 3: one unit per module, small params in one persistent unit
        groups = split_persistent(plan.groups(params), params, zero_config.stage3_param_persistence_threshold)
    return FlatLayout(
        params,
        [n for n, _ in named],
        shards=shards,
        unit_numel=zero_config.reduce_bucket_size,
        align=align,
        groups=groups,
    )


def build_buffers(
    param_groups: list[dict[str, Any]],
    cfg: OptimizerConfig,
    zero_config: ZeroConfig,
    *,
    stage: int,
    dp: int,
    rank: int,
    placement: Placement,
    plan: UnitPlan | None,
    deferred: set[int],
    grad_accum_dtype: torch.dtype | None,
    align: int,
) -> list[FlatBuffer]:
    """One flat buffer per (param group, dtype, device, tensor-parallel kind) of the trained params (module
    docstring); ``rank``: this rank's shard (0 at stage 0, which shards nothing); ``deferred``: ids of meta-built
    params (stage 3), left zero in the shard until ``init.materialize_sharded`` fills it."""
    shards = 1 if stage == 0 else dp
    keyed: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}
    for gi, g in enumerate(param_groups):
        for name, p in zip(g["names"], g["params"]):
            if not p.requires_grad:
                continue
            if not p.is_floating_point():
                raise TypeError(f"param {name!r} has dtype {p.dtype}; ZeRO trains floating-point params")
            tp_split = bool(getattr(p, "tensor_model_parallel", False))
            keyed.setdefault((gi, p.dtype, p.device, tp_split), []).append((name, p))
    if not keyed:
        raise ValueError("no parameter requires grad: nothing for ZeroOptimizer to train")
    buffers = []
    pool = placement
    for key, named in keyed.items():
        gi, dtype, device, tp_split = key
        mode = lowbit_state.buffer_mode(cfg.precision, cfg.state_precision, dtype, f"param {named[0][0]!r}")
        bits = lowbit_state.bits_of(mode)
        params = [p for _, p in named]
        layout = layout_of(named, shards, lowbit_state.block_align(align, mode), zero_config, plan)
        shard = None
        if stage == 3:  # only this rank's shard is kept; Stage3Runtime re-points the params
            flat = torch.empty(0, dtype=dtype, device=device)
            shard = shard_params(layout, params, pool, rank, deferred)  # meta-built: materialize_sharded
            mine_of = lambda u: layout.shard_of_partition(shard, u)  # noqa: E731
        else:
            flat = torch.zeros(layout.total, dtype=dtype, device=device)
            with torch.no_grad():
                for u, unit in enumerate(layout.units):
                    pack_bucket([params[i].detach() for i in unit.params], out=layout.unit_view(flat, u))
                for i, p in enumerate(params):
                    p.data = layout.param_view(flat, i)
            mine_of = lambda u: layout.shard_of_full(flat, u, rank)  # noqa: E731
        acc_dtype = grad_accum_dtype or dtype
        sdtypes = state_dtypes(mode, dtype)
        host_grad = None
        if pool.offload_optimizer:  # the host steps in fp32 (float64 for float64 params) on a master copy
            host = master_dtype(dtype)
            sdtypes = {"exp_avg": host, "exp_avg_sq": host, "master": host}
            if bits is not None:
                sdtypes = {**state_dtypes(mode, torch.float32), "master": host}
            if stage == 1:  # the accumulator stays on the device; the reduced partition goes to the host
                host_grad = pool.zeros("grads", layout.partition, host)
            else:
                acc_dtype = host
        if stage < 2:
            grad = torch.zeros(layout.total, dtype=acc_dtype, device=device)
        else:
            grad = pool.zeros("grads", layout.partition, acc_dtype)
        state = {}
        for name, sdtype in sdtypes.items():
            numel = layout.partition if bits is None else lowbit_state.state_numel(name, layout.partition, bits)
            state[name] = pool.zeros("master" if name == "master" else "optimizer_state", numel, sdtype)
            if name == "master":
                for u in range(len(layout.units)):
                    layout.shard_of_partition(state[name], u).copy_(mine_of(u))
        if bits is not None:
            lowbit_state.zero_fill_(state, bits)
        step_device = pool.host if pool.offload_optimizer else device
        steps = [torch.zeros((), dtype=torch.float32, device=step_device) for _ in layout.units]
        buffers.append(
            FlatBuffer(
                key=key,
                group_index=gi,
                tp_split=tp_split,
                layout=layout,
                params=params,
                mode=mode,
                flat=flat,
                grad=grad,
                state=state,
                steps=steps,
                shard=shard,
                host_grad=host_grad,
            )
        )
    return buffers


@torch.no_grad()
def shard_params(
    layout: FlatLayout, params: Sequence[torch.Tensor], pool: Placement, rank: int, skip: set[int]
) -> torch.Tensor:
    """This rank's ``[partition]`` of ``params`` in the params pool (params whose id is in ``skip``: left zero)."""
    shard = pool.zeros("params", layout.partition, layout.dtype)
    for u in range(len(layout.units)):
        mine = layout.shard_of_partition(shard, u)
        for i, a, z, at in layout.param_slices(u, rank):
            if id(params[i]) not in skip:
                mine[at : at + z - a].copy_(params[i].detach().reshape(-1)[a:z])
    return shard


def frozen_buffers(
    module: nn.Module,
    trained: list[FlatBuffer],
    layout_of: Callable[[list], FlatLayout],
    pool: Placement,
    rank: int,
    deferred: set[int],
) -> list[FlatBuffer]:
    """The module's frozen floating-point params, sharded like the trained ones in buffers of their own (one per
    dtype / device / tensor-parallel kind): gathered for forward and backward, never reduced or stepped."""
    done = {id(p) for b in trained for p in b.params}
    keyed: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for name, p in module.named_parameters():
        if id(p) not in done and not p.requires_grad and p.is_floating_point():
            keyed.setdefault((p.dtype, p.device, bool(getattr(p, "tensor_model_parallel", False))), []).append(
                (name, p)
            )
    out = []
    for (dtype, device, tp_split), named in keyed.items():
        layout, params = layout_of(named), [p for _, p in named]
        empty = torch.empty(0, dtype=dtype, device=device)
        out.append(
            FlatBuffer(
                key=("frozen", dtype, device, tp_split),
                group_index=-1,
                tp_split=tp_split,
                layout=layout,
                params=params,
                mode="frozen",
                flat=empty,
                grad=empty,
                frozen=True,
                shard=shard_params(layout, params, pool, rank, deferred),
            )
        )
    return out
