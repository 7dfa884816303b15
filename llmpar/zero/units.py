"""Sharding units of ZeRO stage 3 (see ``stage3.py``): which modules are units, which unit owns each param and which
params each unit module needs, which units stay gathered from forward to backward, and a helper mapping a module's
tensor outputs."""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

import torch
from torch import nn

from llmpar.models.anatomy import shard_units
from llmpar.zero.layout import FlatLayout

UnitPolicy = Callable[[str, nn.Module], bool]
K = TypeVar("K", bound=Hashable)


def unit_modules(model: nn.Module, policy: UnitPolicy | None = None) -> list[tuple[str, nn.Module]]:
    """The sharding units, root first then registration order. ``policy(name, module)`` replaces the default choice
    (:func:`llmpar.models.anatomy.shard_units`; the root is always a unit: it holds whatever no other unit does)."""
    if policy is not None:
        return [("", model)] + [(n, m) for n, m in model.named_modules() if n and policy(n, m)]
    return shard_units(model)


class UnitPlan:
    """Which unit module owns each param and which params each unit module needs in its forward."""

    def __init__(self, model: nn.Module, policy: UnitPolicy | None = None) -> None:
        self.units = unit_modules(model, policy)
        index = {id(m): i for i, (_, m) in enumerate(self.units)}
        self.owner: dict[int, int] = {}  # id(param) -> unit module index
        self.needs: list[list[nn.Parameter]] = [[] for _ in self.units]

        def walk(mod: nn.Module, unit: int) -> None:
            unit = index.get(id(mod), unit)
            for p in mod._parameters.values():
                if p is None:
                    continue
                self.owner.setdefault(id(p), unit)
                if all(q is not p for q in self.needs[unit]):
                    self.needs[unit].append(p)
            for child in mod._modules.values():
                if child is not None:
                    walk(child, unit)

        walk(model, 0)

    def groups(self, params: list[torch.Tensor]) -> list[list[int]]:
        """Layout units for one flat buffer's params: one per unit module holding any of them, in module order."""
        by_unit: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if id(p) not in self.owner:
                raise ValueError(
                    f"a param of shape {tuple(p.shape)} passed to ZeRO stage 3 is not in the module "
                    "given as module=: stage 3 gathers params through the module's forward hooks"
                )
            by_unit.setdefault(self.owner[id(p)], []).append(i)
        return [by_unit[u] for u in sorted(by_unit)]


def split_persistent(groups: list[list[int]], params: list[torch.Tensor], persist_numel: int) -> list[list[int]]:
    """Per-param persistence: params of at most ``persist_numel`` elements leave their module's unit for one persistent
    unit (last); module units left empty disappear."""
    small = [i for g in groups for i in g if params[i].numel() <= persist_numel]
    out = [big for big in ([i for i in g if params[i].numel() > persist_numel] for g in groups) if big]
    return out + [small] if small else out


def is_persistent(layout: FlatLayout, unit: int, persist_numel: int) -> bool:
    """Whether unit ``unit`` of ``layout`` stays gathered: all its params have at most ``persist_numel`` elements."""
    return all(layout.slot(i).numel <= persist_numel for i in layout.units[unit].params)


def kept_units(
    fwd: list[K], bwd: list[K], numel: Callable[[K], int], *, prefetch: int, max_live: int, reuse: int
) -> set[K]:
    """The units to keep gathered from forward to backward, from the recorded gather orders ``fwd`` and ``bwd``:
    those backward starts with, within ``prefetch`` elements (as FSDP2 keeps its root), then, in backward order,
    those with fewer than ``reuse`` elements gathered between any two of their uses (DeepSpeed's
    ``stage3_max_reuse_distance``; a use: each forward gather, the first backward one), while the kept elements stay
    within ``max_live``."""
    kept: set[K] = set()
    budget = prefetch
    for key in bwd:
        budget -= numel(key)
        if budget < 0:
            break
        kept.add(key)
    if reuse <= 0:
        return kept
    order = list(fwd) + list(dict.fromkeys(bwd))
    before = [0]  # elements gathered before each position of ``order``
    for key in order:
        before.append(before[-1] + numel(key))
    last: dict[K, int] = {}
    gap: dict[K, int] = {}
    for i, key in enumerate(order):
        if key in last:
            gap[key] = max(gap.get(key, 0), before[i] - before[last[key] + 1])
        last[key] = i
    held = sum(numel(k) for k in kept)
    for key in dict.fromkeys(bwd):
        if key not in kept and gap.get(key, reuse) < reuse:
            if held + numel(key) > max_live:
                break
            kept.add(key)
            held += numel(key)
    return kept


def _collect(x: Any, found: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            found.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, found)


def _rebuild(x: Any, new: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return new.get(id(x), x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_rebuild(y, new) for y in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_rebuild(y, new) for y in x)
    if isinstance(x, dict):
        return type(x)((k, _rebuild(v, new)) for k, v in x.items())
    return x


def map_tensors(out: Any, fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    """Apply ``fn`` to all grad-requiring tensors in ``out`` (a tensor, or tuples / lists / dicts of them) at once.
    Module-level recursion on purpose: nested recursive closures form a reference cycle that would keep the
    tensors (a block's activations) alive until Python's cyclic GC runs."""
    found: list[torch.Tensor] = []
    _collect(out, found)
    if not found:
        return out
    return _rebuild(out, dict(zip(map(id, found), fn(found))))
