"""ZeRO stage 3: every rank keeps only its shard of each parameter; modules gather their params just in time.

Sharding units are modules (:func:`unit_modules`: by default the root, every element of every ``nn.ModuleList`` /
``nn.Sequential`` -- the transformer blocks -- and every other direct child of the root holding params: embeddings,
final norm, head). A param belongs to the first unit module (registration order) that holds it outside a nested unit,
so a tied embedding / head weight is one param of the embedding's unit that the head's unit also *needs*. In each
flat buffer (``layout.py``) one module's params form one unit, so "gather module m" is one all-gather per buffer.

Per unit the gathered ``[padded]`` tensor is allocated once and the params are views into it, forever; freeing it
resizes its storage to 0 bytes and re-gathering resizes it back (as FSDP1 does), so tensors autograd saved in forward
(``weight.t()`` ...) see the re-gathered values in backward and the memory really goes.

    forward pre-hook of module m:  gather every unit m needs (async all-gather of this rank's shard, the shard copied
                                   in from the host first under offload_param), prefetch the next units of the recorded
                                   forward order (``stage3_prefetch_bucket_size`` elements, never more than
                                   ``stage3_max_live_parameters`` gathered), wait for m's own
    forward post-hook:             wrap m's outputs in an identity autograd Function whose backward re-gathers m's
                                   units (prefetching along the recorded backward order); free m's units
    grad hooks (``grads.py``):     when a unit's grads are complete, reduce-scatter them (async) into the owner's
                                   partition and free the unit at once
    end of backward:               free whatever is still gathered
Units of at most ``stage3_param_persistence_threshold`` elements stay gathered (re-gathered after each step).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from llmpar.distributed.collectives import CommCounter, Group, Handle, all_gather_flat, group_rank
from llmpar.zero.grads import FlatBuffer

UnitPolicy = Callable[[str, nn.Module], bool]
Key = tuple[int, int]  # (flat buffer index, unit index in its layout)


def unit_modules(model: nn.Module, policy: UnitPolicy | None = None) -> list[tuple[str, nn.Module]]:
    """The sharding units, root first then registration order. ``policy(name, module)`` replaces the default choice
    (the root is always a unit: it holds whatever no other unit does)."""
    out: list[tuple[str, nn.Module]] = [("", model)]
    if policy is not None:
        out += [(n, m) for n, m in model.named_modules() if n and policy(n, m)]
        return out
    chosen: set[int] = set()
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and m is not model:
            for child_name, child in m.named_children():
                if id(child) not in chosen and any(True for _ in child.parameters()):
                    chosen.add(id(child))
                    out.append((f"{name}.{child_name}" if name else child_name, child))
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) or id(child) in chosen:
            continue
        if any(True for _ in child.parameters()):
            chosen.add(id(child))
            out.append((name, child))
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    return [out[0]] + sorted(out[1:], key=lambda nm: order[id(nm[1])])


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
                raise ValueError(f"a param of shape {tuple(p.shape)} passed to ZeRO stage 3 is not in the module "
                                 "given as module=: stage 3 gathers params through the module's forward hooks")
            by_unit.setdefault(self.owner[id(p)], []).append(i)
        return [by_unit[u] for u in sorted(by_unit)]


def _map_tensors(out: Any, fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    """Apply ``fn`` to all grad-requiring tensors in ``out`` (a tensor, or tuples / lists / dicts of them) at once."""
    found: list[torch.Tensor] = []

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                collect(y)
        elif isinstance(x, dict):
            for y in x.values():
                collect(y)

    collect(out)
    if not found:
        return out
    new = dict(zip(map(id, found), fn(found)))

    def rebuild(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return new.get(id(x), x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(rebuild(y) for y in x))
        if isinstance(x, (tuple, list)):
            return type(x)(rebuild(y) for y in x)
        if isinstance(x, dict):
            return type(x)((k, rebuild(v)) for k, v in x.items())
        return x

    return rebuild(out)


class _RegatherForBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward runs before the module's and gathers the module's units."""

    @staticmethod
    def forward(ctx: Any, runtime: Any, module_index: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.runtime, ctx.module_index = runtime, module_index
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        rt = ctx.runtime()
        if rt is not None:
            rt.before_backward(ctx.module_index)
        return (None, None, *grads)


class Stage3Runtime:
    """Gathers, frees and prefetches the units of ``buffers`` (whose ``shard`` holds this rank's partition)."""

    def __init__(self, plan: UnitPlan, buffers: list[FlatBuffer], *, dp_group: Group, device: torch.device,
                 prefetch_numel: int, max_live_numel: int, persist_numel: int,
                 counter: CommCounter | None) -> None:
        self.plan, self.buffers, self.group, self.device = plan, buffers, dp_group, device
        self.prefetch_numel, self.max_live_numel, self.counter = prefetch_numel, max_live_numel, counter
        self.full: dict[Key, torch.Tensor] = {}  # the gathered [padded] tensor of each unit (storage 0 when free)
        self.live: set[Key] = set()
        self.pending: dict[Key, Handle] = {}
        self.users: dict[Key, int] = {}
        self.persistent: set[Key] = set()
        self.live_numel = self.peak_live_numel = 0
        self.gathers = 0  # all-gathers launched (for tests and reports)
        self._bindex = {id(b): bi for bi, b in enumerate(buffers)}
        where: dict[int, Key] = {}
        for bi, b in enumerate(buffers):
            for u, unit in enumerate(b.layout.units):
                key = (bi, u)
                full = torch.empty(unit.padded, dtype=b.flat.dtype, device=device)
                self.full[key] = full
                self.users[key] = 0
                for i in unit.params:
                    where[id(b.params[i])] = key
                    with torch.no_grad():
                        b.params[i].data = b.layout.param_in_unit(full, i)
                if unit.numel <= persist_numel:
                    self.persistent.add(key)
                else:
                    full.untyped_storage().resize_(0)
        self.needs: list[list[Key]] = []
        for params in plan.needs:
            keys = []
            for p in params:
                k = where.get(id(p))
                if k is not None and k not in keys:
                    keys.append(k)
            self.needs.append(keys)
        self.trace: dict[str, list[Key]] = {"fwd": [], "bwd": []}
        self.recording = {"fwd": True, "bwd": True}
        self.pos = {"fwd": -1, "bwd": -1}
        self._hooks = []
        ref = weakref.ref(self)
        for mi, (_, m) in enumerate(plan.units):
            if mi == 0 or self.needs[mi]:
                self._hooks.append(m.register_forward_pre_hook(_WeakPre(ref, mi)))
                self._hooks.append(m.register_forward_hook(_WeakPost(ref, mi)))
        for key in sorted(self.persistent):
            self._gather(key)
        self.wait_all()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---------------------------------------------------------- gather/free
    def _numel(self, key: Key) -> int:
        return self.buffers[key[0]].layout.units[key[1]].padded

    def _gather(self, key: Key) -> None:
        if key in self.live:
            return
        b, u = self.buffers[key[0]], key[1]
        full = self.full[key]
        if key not in self.persistent or full.untyped_storage().nbytes() == 0:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        src = b.layout.shard_of_partition(b.shard, u)
        if src.device != full.device:  # offload_param: copy the host shard in first
            src = src.to(full.device, non_blocking=True)
        self.pending[key] = all_gather_flat(full, src, self.group, async_op=True, counter=self.counter)
        self.live.add(key)
        self.gathers += 1
        self.live_numel += self._numel(key)
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _wait(self, key: Key) -> None:
        h = self.pending.pop(key, None)
        if h is not None:
            h.wait()

    def wait_all(self) -> None:
        for key in list(self.pending):
            self._wait(key)

    def release(self, key: Key) -> None:
        if key in self.persistent or key not in self.live or self.users[key] > 0:
            return
        self._wait(key)
        self.full[key].untyped_storage().resize_(0)
        self.live.discard(key)
        self.live_numel -= self._numel(key)

    def release_all(self) -> None:
        for key in list(self.live):
            if self.users[key] == 0:
                self.release(key)

    def regather_persistent(self) -> None:
        """After a step: the persistent units' gathered copies take the updated shards."""
        for key in sorted(self.persistent):
            self.live.discard(key)
            self.live_numel -= self._numel(key)
            self._gather(key)
        self.wait_all()

    def keys_of(self, params: list[torch.Tensor] | None) -> list[Key]:
        """The units holding ``params`` (all units when None), in buffer order."""
        if params is None:
            return sorted(self.full)
        where = {id(b.params[i]): (bi, b.layout.slot(i).unit) for bi, b in enumerate(self.buffers)
                 for i in range(len(b.params))}
        return sorted({where[id(p)] for p in params if id(p) in where})

    def hold(self, keys: list[Key]) -> None:
        """Gather ``keys`` and keep them gathered until :meth:`unhold` (for inspection / modification)."""
        for key in keys:
            self.users[key] += 1
            self._gather(key)
        for key in keys:
            self._wait(key)

    def unhold(self, keys: list[Key], *, write_back: bool) -> None:
        """Undo :meth:`hold`; with ``write_back`` this rank's shard takes the (possibly modified) gathered values."""
        r = group_rank(self.group)
        for key in keys:
            if write_back:
                b, u = self.buffers[key[0]], key[1]
                mine = b.layout.shard_of_partition(b.shard, u)
                n = mine.numel()
                mine.copy_(self.full[key][r * n:(r + 1) * n])
            self.users[key] -= 1
            self.release(key)

    # ------------------------------------------------------------- fetching
    def _fetch(self, keys: list[Key], phase: str) -> None:
        trace = self.trace[phase]
        for key in keys:
            if self.recording[phase]:
                trace.append(key)
                self.pos[phase] = len(trace) - 1
            else:
                try:
                    self.pos[phase] = trace.index(key, self.pos[phase] + 1)
                except ValueError:
                    pass  # off the recorded path: no prefetch hint, still correct
            self._gather(key)
        if not self.recording[phase] and self.prefetch_numel > 0:  # the window: the next units, live or not,
            budget = self.prefetch_numel                            # within stage3_prefetch_bucket_size elements
            for key in trace[self.pos[phase] + 1:]:
                n = self._numel(key)
                if n > budget:
                    break
                budget -= n
                if key not in self.live:
                    if self.live_numel + n > self.max_live_numel:
                        break
                    self._gather(key)
        for key in keys:
            self._wait(key)

    def pre_forward(self, mi: int) -> None:
        if mi == 0:
            self.release_all()  # leftovers of a backward that never reached a ZeRO param
            self.pos["fwd"] = -1
        keys = self.needs[mi]
        for key in keys:
            self.users[key] += 1
        self._fetch(keys, "fwd")

    def post_forward(self, mi: int, output: Any) -> Any:
        keys = self.needs[mi]
        if keys and torch.is_grad_enabled():
            output = _map_tensors(output, lambda xs: list(_RegatherForBackward.apply(weakref.ref(self), mi, *xs)))
        for key in keys:
            self.users[key] -= 1
            self.release(key)
        if mi == 0:
            self.recording["fwd"] = False
            self.release_all()  # prefetches the forward did not use
        return output

    def before_backward(self, mi: int) -> None:
        self._fetch(self.needs[mi], "bwd")

    def unit_reduced(self, b: FlatBuffer, u: int) -> None:
        self.release((self._bindex[id(b)], u))

    def end_backward(self) -> None:
        self.wait_all()
        self.release_all()
        if self.trace["bwd"]:
            self.recording["bwd"] = False
        self.pos["bwd"] = -1


class _WeakPre:
    def __init__(self, ref: "weakref.ref[Stage3Runtime]", mi: int) -> None:
        self.ref, self.mi = ref, mi

    def __call__(self, module: nn.Module, args: Any) -> None:
        rt = self.ref()
        if rt is not None:
            rt.pre_forward(self.mi)


class _WeakPost:
    def __init__(self, ref: "weakref.ref[Stage3Runtime]", mi: int) -> None:
        self.ref, self.mi = ref, mi

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        rt = self.ref()
        return output if rt is None else rt.post_forward(self.mi, output)
