"""Gathering stage-3 params for the user: a context for inspecting / modifying params, and the full 16-bit state dict.

    with llmpar.zero.GatheredParameters(model.lm_head.weight, engine.optimizer, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.mul_(0.5)       # rank 0's values are broadcast and written back into every shard
    state = engine.module_state_dict()         # full weights (the params' dtype) on rank 0, {} elsewhere

Outside stage 3 the params are whole on every rank: the context only broadcasts a modification (when asked) and
writes it into the optimizer's master copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Iterator

import torch

from llmpar.distributed.collectives import all_gather_flat, broadcast, group_rank, group_size
from llmpar.zero.experts import ETP_LAYOUT, merge_etp


def _as_list(params: torch.Tensor | Iterable[torch.Tensor] | None) -> list[torch.Tensor] | None:
    if params is None:
        return None
    if isinstance(params, torch.Tensor):
        return [params]
    out = list(params)
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
    return out


@contextmanager
def GatheredParameters(
    params: torch.Tensor | Iterable[torch.Tensor] | None,
    optimizer: "object",  # noqa: N802
    *,
    modifier_rank: int | None = None,
) -> Iterator[None]:
    """Within the block the given params (all when None) are whole on every dp rank. With ``modifier_rank`` the
    values that rank holds at exit are broadcast and become the params (shards and fp32 master) everywhere.
    Collective: every dp rank enters it with the same params."""
    from llmpar.zero.optimizer import ZeroOptimizer

    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"optimizer must be the ZeroOptimizer holding the params, got {type(optimizer).__name__}")
    if modifier_rank is not None and not 0 <= modifier_rank < optimizer.dp:
        raise ValueError(f"modifier_rank={modifier_rank} is not a dp rank (dp={optimizer.dp})")
    plist = _as_list(params)
    optimizer.wait_params()
    rt = optimizer.stage3
    keys = rt.keys_of(plist) if rt is not None else []
    if rt is not None:
        rt.hold(keys)
    try:
        with torch.no_grad():
            yield
    finally:
        if modifier_rank is not None:
            with torch.no_grad():
                if rt is not None:
                    for key in keys:
                        broadcast(rt.full[key], modifier_rank, optimizer.dp_group)
                else:
                    for p in plist if plist is not None else [p for b in optimizer.buffers for p in b.params]:
                        broadcast(p.data, modifier_rank, optimizer.dp_group)
        if rt is not None:
            rt.unhold(keys, write_back=modifier_rank is not None)
        if modifier_rank is not None:
            optimizer.refresh_master()


def consolidated_state_dict(module: torch.nn.Module, optimizer: "object", *, rank0_only: bool = True) -> dict:
    """The module's full state dict (params in their dtype, on the CPU; persistent buffers: the keys of
    ``module.state_dict()``, a tied weight under each of its names), gathered unit by unit so that no rank holds
    more than one gathered unit beyond its shards. ``rank0_only``: other dp ranks return {}. Experts spread over
    expert-parallel ranks (``optimizer.experts``) are all-gathered over ep: each packed expert tensor whole, the ep
    ranks' rows in order (global expert ids ``[0, E)``); a param holding one expert (``p.expert_index = (list
    name, local index i, experts per rank n)``: DeepSpeed's layer) is written under ep rank j's global index j n + i.
    Experts split over an expert-tensor-parallel group (``optimizer.etp_group``) are then merged over it
    (``experts.merge_etp``): every tensor under its global name has the whole model's shape."""
    from llmpar.zero.optimizer import ZeroOptimizer

    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"optimizer must be a ZeroOptimizer, got {type(optimizer).__name__}")
    optimizer.wait_params()
    keep = not rank0_only or group_rank(optimizer.dp_group) == 0
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out: dict[str, torch.Tensor] = {}

    experts = optimizer.experts
    spread = set() if experts is None else {id(p) for b in experts.buffers for p in b.params}
    ep_group = optimizer.ep_group if experts is not None else None
    etp_group = optimizer.etp_group if experts is not None else None

    def take(p: torch.Tensor) -> None:
        value = p.detach()
        if id(p) in spread and ep_group is not None and group_size(ep_group) > 1:  # every ep rank's rows, in order
            whole = value.new_empty((group_size(ep_group) * value.numel(),))
            all_gather_flat(whole, value.contiguous().reshape(-1), ep_group)
            index = getattr(p, "expert_index", None)  # one expert per tensor: (list name, local index, per rank)
            if index is not None:  # each ep rank's copy under its global index (DeepSpeed's layer: experts.<g>.*)
                seg, i, n_local = index
                parts = whole.view(group_size(ep_group), *value.shape)
                for j in range(parts.shape[0] if keep else 0):
                    for n in names.get(id(p), []):
                        out[n.replace(f".{seg}.{i}.", f".{seg}.{j * n_local + i}.")] = parts[j].to("cpu", copy=True)
                return
            value = whole.view(group_size(ep_group) * value.shape[0], *value.shape[1:])
        if id(p) in spread and etp_group is not None and getattr(p, ETP_LAYOUT, None) is not None:
            value = merge_etp(value, getattr(p, ETP_LAYOUT), etp_group)  # the etp shards rejoined: whole experts
        if keep:
            value = value.to("cpu", copy=True)
            for n in names.get(id(p), []):
                out[n] = value

    done: set[int] = set()
    for rt in (optimizer.stage3, experts.stage3 if experts is not None else None):
        if rt is None:
            continue
        for key in rt.keys_of(None):  # one unit gathered at a time
            b = rt.buffers[key[0]]
            rt.hold([key])
            for i in b.layout.units[key[1]].params:
                take(b.params[i])
                done.add(id(b.params[i]))
            rt.unhold([key], write_back=False)
    for p in module.parameters():
        if id(p) not in done:
            take(p)
    if not keep:
        return {}
    order = {n: i for i, n in enumerate(module.state_dict(keep_vars=True))}
    for prefix, m in module.named_modules():  # persistent buffers, under the names the params have (a state-dict
        for bname, buf in m._buffers.items():  # hook may rename them: a swapped MoE block's router bias)
            if buf is not None and bname not in m._non_persistent_buffers_set:
                out[f"{prefix}.{bname}" if prefix else bname] = buf.detach().to("cpu", copy=True)
    return {n: out[n] for n in sorted(out, key=lambda n: order.get(n, len(order)))}


def frozen_state_dict(optimizer: "object", *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Stage 3: the frozen params that are sharded (``ZeroOptimizer.frozen_buffers``), whole and on the CPU, by name,
    gathered one unit at a time. Collective over dp; ``rank0_only``: other dp ranks return {}. (A frozen stage-3
    param holds no memory between uses: read it through this, not through the param.)"""
    return optimizer.gather_frozen(rank0_only=rank0_only)  # type: ignore[attr-defined]


def load_frozen(optimizer: "object", tensors: dict[str, torch.Tensor]) -> list[str]:
    """Stage 3: the sharded frozen params named in ``tensors`` (whole values) take those values (this rank's slices
    into its shards, persistent params whole). Not collective. Returns the names taken; a shape mismatch is a
    ValueError naming the param."""
    return optimizer.load_frozen(tensors)  # type: ignore[attr-defined]
