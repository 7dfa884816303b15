"""ZeRO stage 3: every rank keeps only its shard of each parameter; modules gather their params just in time.

Sharding units are modules (:func:`unit_modules`, by default the model anatomy's ``shard_units``: the root, every
element of every ``nn.ModuleList`` / ``nn.Sequential`` -- the transformer blocks -- and every other direct child of
the root holding params: embeddings, final norm, head). A param belongs to the first unit module (registration
order) that holds it outside a nested unit, so a tied embedding / head weight is one param of the embedding's unit
that the head's unit also *needs*. In each flat buffer (``layout.py``) one module's params form one unit, so
"gather module m" is one all-gather per buffer.

Per unit the gathered ``[padded]`` tensor is allocated once, with one view per param; freeing it resizes its storage
to 0 bytes and re-gathering resizes it back (as FSDP1 does), so tensors autograd saved in forward (``weight.t()`` ...)
see the re-gathered values in backward and the memory really goes. A param is its view while its unit is gathered and
an empty tensor otherwise (``views.py``: real shape in ``param.ds_shape``, as DeepSpeed), so no read outside a gather
touches freed memory.

    forward pre-hook of module m:  gather every unit m needs (async all-gather of this rank's shard, the shard copied
                                   in from the host first under offload_param), prefetch the next units of the recorded
                                   forward order (``stage3_prefetch_bucket_size`` elements, never more than
                                   ``stage3_max_live_parameters`` gathered), wait for m's own
    forward post-hook:             wrap m's outputs in an identity autograd Function whose backward re-gathers m's
                                   units (prefetching along the recorded backward order); free m's units
    grad hooks (``grads.py``):     when a unit's grads are complete, reduce-scatter them (async) into the owner's
                                   partition and free the unit at once
    end of backward:               free whatever is still gathered
    (from the second step on, a unit stays gathered from its forward to its backward, instead of being freed and
    gathered again, when backward starts with it (within the prefetch budget, as FSDP2 keeps its root) or when
    fewer than ``stage3_max_reuse_distance`` elements are gathered between its uses in the recorded order
    (DeepSpeed's rule and default, 1e9: a model that small is gathered once per step; 0 keeps only the former);
    never more than ``stage3_max_live_parameters`` elements kept)
Params of at most ``stage3_param_persistence_threshold`` elements (biases, norms: DeepSpeed's per-param rule) leave
their module's unit for one *persistent* unit per flat buffer that stays gathered on every rank (re-gathered after each
step); a unit is persistent when all its params are that small. Frozen params (``requires_grad=False``) are sharded
the same way in flat buffers of their own (``ZeroOptimizer.frozen_buffers``): gathered for forward and backward, never
reduced or stepped.

offload_param: a unit's host shard is copied in by the gather that the prefetch issues (``offload.Copier``: a side CUDA
stream on CUDA), so the next unit's host->device copy overlaps the current unit's compute. ``log`` (a list, None by
default) records ("h2d" | "gather" | "wait" | "free", key) in issue order, for tests.
torch.compile never traces the hooks (``torch.compiler.disable``): a model compiled whole runs them eagerly between its
graphs, a graph break each; ``compile.py`` compiles each unit's forward as its own region between them instead.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from llmpar.distributed.collectives import CommCounter, Group, GroupRef, Handle, all_gather_flat, group_rank
from llmpar.zero.buffers import shard_params  # noqa: F401  (importable from here as before)
from llmpar.zero.compressed import WeightGather
from llmpar.zero.grads import FlatBuffer
from llmpar.zero.offload import Copier
from llmpar.zero.units import UnitPlan, is_persistent, kept_units, map_tensors
from llmpar.zero.views import ParamViews

__all__ = ["Key", "Stage3Runtime", "shard_params"]  # shard_params: buffers.py's, importable from here

Key = tuple[int, int]  # (flat buffer index, unit index in its layout)


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors whose backward calls ``runtime.<method>(module_index)``: on a module's outputs it runs
    before the module's backward ("before_backward": gather its units), on its inputs after it ("after_backward": free
    its frozen units, which no gradient reduction frees)."""

    @staticmethod
    def forward(ctx: Any, runtime: Any, module_index: int, method: str, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.runtime, ctx.module_index, ctx.method = runtime, module_index, method
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        rt = ctx.runtime()
        if rt is not None:
            getattr(rt, ctx.method)(ctx.module_index)
        return (None, None, None, *grads)


class Stage3Runtime:
    """Gathers, frees and prefetches the units of ``buffers`` (whose ``shard`` holds this rank's partition)."""

    def __init__(
        self,
        plan: UnitPlan,
        buffers: list[FlatBuffer],
        *,
        dp_group: Group | GroupRef,
        device: torch.device,
        prefetch_numel: int,
        max_live_numel: int,
        persist_numel: int,
        counter: CommCounter | None,
        reuse_numel: int = 0,
        copier: Copier | None = None,
        host_shards: bool = False,
        weights: WeightGather | None = None,
    ) -> None:
        self.plan, self.buffers, self.group, self.device = plan, buffers, dp_group, device
        self.weights = weights  # zero_quantized_weights / zero_hpz_partition_size (``compressed.py``)
        self.host_shards = host_shards  # offload_param: the shards live in the host pool
        self.prefetch_numel, self.max_live_numel, self.counter = prefetch_numel, max_live_numel, counter
        self.reuse_numel = reuse_numel
        self.copier = copier if copier is not None else Copier(device)
        self.log: list[tuple[str, Key]] | None = None
        self.full: dict[Key, torch.Tensor] = {}  # the gathered [padded] tensor of each unit (storage 0 when free)
        self.views = ParamViews()  # the params: views into ``full`` while gathered, empty tensors otherwise
        self.live: set[Key] = set()
        self.pending: dict[Key, Handle] = {}
        self.users: dict[Key, int] = {}
        self.persistent: set[Key] = set()
        self.live_numel = self.peak_live_numel = 0
        self.gathers = 0  # all-gathers launched (for tests and reports)
        self._bindex = {id(b): bi for bi, b in enumerate(buffers)}
        self._numels: dict[Key, int] = {}
        where: dict[int, Key] = {}
        for bi, b in enumerate(buffers):
            for u, unit in enumerate(b.layout.units):
                key = (bi, u)
                full = torch.empty(unit.padded, dtype=b.layout.dtype, device=device)
                self.full[key], self.users[key], self._numels[key] = full, 0, unit.padded
                for i in unit.params:
                    where[id(b.params[i])] = key
                    self.views.add(key, b.params[i], b.layout.param_in_unit(full, i))
                self.views.gathered(key)
                if is_persistent(b.layout, u, persist_numel):
                    self.persistent.add(key)
                else:
                    full.untyped_storage().resize_(0)
                    self.views.released(key)
        self.frozen_keys = {
            (bi, u) for bi, b in enumerate(buffers) if b.frozen for u in range(len(b.layout.units))
        } - self.persistent
        self.needs: list[list[Key]] = []  # per unit module: the non-persistent units its forward gathers
        for params in plan.needs:
            keys = []
            for p in params:
                k = where.get(id(p))
                if k is not None and k not in keys and k not in self.persistent:
                    keys.append(k)
            self.needs.append(keys)
        self.keep_for_bwd: set[Key] = set()  # the units backward begins with (as FSDP2 keeps the root's)
        self._forward_keeps = False
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
        return self._numels[key]

    def _shard(self, key: Key) -> torch.Tensor:
        """This rank's shard of unit ``key``: a view into its buffer's ``shard`` (the params pool)."""
        b = self.buffers[key[0]]
        assert b.shard is not None  # stage 3 builds every buffer with this rank's shard (buffers.shard_params)
        return b.layout.shard_of_partition(b.shard, key[1])

    def _note(self, what: str, key: Key) -> None:
        if self.log is not None:
            self.log.append((what, key))

    def _gather(self, key: Key, phase: str | None = None, exact: bool = False) -> None:
        """Launch the all-gather of unit ``key`` (``exact``: never quantized, for :meth:`hold`: what users read,
        save or write back must be the shards' own values)."""
        if key in self.live:
            if exact and self.weights is not None and self.weights.bits is not None and key not in self.persistent:
                self._wait(key)  # gathered quantized for compute: gathered again, exactly
                self.pending[key] = self._gather_exact(key)
            return
        full = self.full[key]
        if key not in self.persistent or full.untyped_storage().nbytes() == 0:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        self.views.gathered(key)
        src = self._shard(key)
        if self.host_shards:  # offload_param: the host shard is copied in first (side stream on CUDA)
            self._note("h2d", key)
            self.pending[key] = self.copier.gather_from_host(full, src, self.group, self.counter)
        elif self.weights is not None and key not in self.persistent and not exact:
            kept = self._forward_keeps and key in self.keep_for_bwd  # gathered until backward: no secondary shard
            self.pending[key] = self.weights.gather(
                key, full, src, phase=phase or "", grad=torch.is_grad_enabled() and not kept
            )
        else:
            self.pending[key] = self._gather_exact(key)
        self._note("gather", key)
        self.live.add(key)
        self.gathers += 1
        self.live_numel += self._numel(key)
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _gather_exact(self, key: Key) -> Handle:
        """The plain all-gather of this rank's shard of unit ``key`` into its gathered tensor."""
        handle = all_gather_flat(
            self.full[key],
            self._shard(key),
            self.group,
            async_op=True,
            counter=self.counter,
            what=f"all-gather of stage-3 params, buffer {key[0]} unit {key[1]}",
        )
        assert handle is not None
        return handle

    def _wait(self, key: Key) -> None:
        h = self.pending.pop(key, None)
        if h is not None:
            h.wait()
            if self.weights is not None:
                self.weights.landed(key, self.full[key])
            self._note("wait", key)

    def wait_all(self) -> None:
        for key in list(self.pending):
            self._wait(key)

    def release(self, key: Key) -> None:
        if key in self.persistent or key not in self.live or self.users[key] > 0:
            return
        if self._forward_keeps and key in self.keep_for_bwd:  # backward starts with it: not freed after forward
            return
        self._wait(key)
        self.views.released(key)
        self.full[key].untyped_storage().resize_(0)
        self._note("free", key)
        self.live.discard(key)
        self.live_numel -= self._numel(key)

    def release_all(self) -> None:
        for key in list(self.live):
            if self.users[key] == 0:
                self.release(key)

    def regather_persistent(self) -> None:
        """After a step: the persistent units' gathered copies take the updated shards."""
        if self.weights is not None:
            self.weights.clear()
        for key in sorted(self.persistent):
            self.live.discard(key)
            self.live_numel -= self._numel(key)
            self._gather(key)
        self.wait_all()

    def keys_of(self, params: list[torch.Tensor] | None) -> list[Key]:
        """The units holding ``params`` (all units when None), in buffer order."""
        if params is None:
            return sorted(self.full)
        where = {
            id(b.params[i]): (bi, b.layout.slot(i).unit)
            for bi, b in enumerate(self.buffers)
            for i in range(len(b.params))
        }
        return sorted({where[id(p)] for p in params if id(p) in where})

    def hold(self, keys: list[Key]) -> None:
        """Gather ``keys`` and keep them gathered until :meth:`unhold` (for inspection / modification)."""
        for key in keys:
            self.users[key] += 1
            self._gather(key, exact=True)
        for key in keys:
            self._wait(key)

    def unhold(self, keys: list[Key], *, write_back: bool) -> None:
        """Undo :meth:`hold`; with ``write_back`` this rank's shard takes the (possibly modified) gathered values."""
        r = group_rank(self.group)
        for key in keys:
            if write_back:
                mine = self._shard(key)
                n = mine.numel()
                mine.copy_(self.full[key][r * n : (r + 1) * n])
                if self.weights is not None:
                    self.weights.clear([key])
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
            self._gather(key, phase)
        if not self.recording[phase] and self.prefetch_numel > 0:  # the window: the next units, live or not,
            budget = self.prefetch_numel  # within stage3_prefetch_bucket_size elements
            for key in trace[self.pos[phase] + 1 :]:
                n = self._numel(key)
                if n > budget:
                    break
                budget -= n
                if key not in self.live:
                    if self.live_numel + n > self.max_live_numel:
                        break
                    self._gather(key, phase)
        for key in keys:
            self._wait(key)

    def pre_forward(self, mi: int, args: Any) -> Any:
        if mi == 0:
            self._forward_keeps = False
            self.release_all()  # leftovers of a backward that never reached a ZeRO param
            if self.weights is not None:
                self.weights.clear()  # secondaries of a forward whose backward never ran
            self._forward_keeps = torch.is_grad_enabled()
            self.pos["fwd"] = -1
        keys = self.needs[mi]
        for key in keys:
            self.users[key] += 1
        self._fetch(keys, "fwd")
        if torch.is_grad_enabled() and any(k in self.frozen_keys for k in keys):
            ref = weakref.ref(self)
            return map_tensors(args, lambda xs: list(_OnBackward.apply(ref, mi, "after_backward", *xs)))
        return None

    def post_forward(self, mi: int, output: Any) -> Any:
        keys = self.needs[mi]
        if keys and torch.is_grad_enabled():
            ref = weakref.ref(self)
            output = map_tensors(output, lambda xs: list(_OnBackward.apply(ref, mi, "before_backward", *xs)))
        for key in keys:
            self.users[key] -= 1
            self.release(key)
        if mi == 0:
            self.recording["fwd"] = False
            self.release_all()  # prefetches the forward did not use
            self._forward_keeps = False
        return output

    def before_backward(self, mi: int) -> None:
        self._fetch(self.needs[mi], "bwd")

    def after_backward(self, mi: int) -> None:
        for key in self.needs[mi]:
            if key in self.frozen_keys:
                self.release(key)

    def unit_reduced(self, b: FlatBuffer, u: int) -> None:
        self.release((self._bindex[id(b)], u))

    def end_backward(self) -> None:
        self.wait_all()
        self.release_all()
        if self.weights is not None:
            self.weights.clear()
        if self.trace["bwd"] and self.recording["bwd"]:
            self.recording["bwd"] = False
            self.keep_for_bwd = kept_units(
                self.trace["fwd"],
                self.trace["bwd"],
                self._numel,
                prefetch=min(self.prefetch_numel, self.max_live_numel),
                max_live=self.max_live_numel,
                reuse=self.reuse_numel,
            )
        self.pos["bwd"] = -1


class _WeakPre:
    def __init__(self, ref: "weakref.ref[Stage3Runtime]", mi: int) -> None:
        self.ref, self.mi = ref, mi

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any) -> Any:
        rt = self.ref()
        return None if rt is None else rt.pre_forward(self.mi, args)


class _WeakPost:
    def __init__(self, ref: "weakref.ref[Stage3Runtime]", mi: int) -> None:
        self.ref, self.mi = ref, mi

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        rt = self.ref()
        return output if rt is None else rt.post_forward(self.mi, output)
