"""The optimizer's side of the checkpoint protocol (``llmpar.checkpoint.protocol.CheckpointOptimizer``) on ZeRO's flat
buffers: ``ZeroOptimizer`` derives from :class:`ZeroCheckpointing`, so ``llmpar.checkpoint`` never reads a buffer, a
layout or the stage-3 runtime itself and a change of the flat layout only has to keep these methods true.

Everything crossing the seam is named: a param by its optimizer name, a piece of it by ``[start, stop)`` of its flat
view. What a rank holds of buffer ``b`` (``layout.py``): its *partition*, the concat over units of its shard of each
unit (stage 0: rank 0's "partition" is the whole buffer; other ranks hold nothing unique). ``checkpoint_held`` lists
which pieces of which params sit where in it, which is all a reader needs besides ``checkpoint_layout``.

Loading (``load_pieces``): stages 0-2 fill the whole param buffer (params are whole on every rank) and their own
partition of each state; stage 3 its own param shard and states. A state the checkpoint lacks is derived
(:data:`STATE_FALLBACK`: ``master`` from the params, ``kahan_comp`` zero); any other missing state is an error, which
``checkpoint_required`` lets the loader raise before anything is modified.

Low-bit states (``lowbit_state.py``): the seam shows float32 ``exp_avg`` / ``exp_avg_sq`` (dequantized) instead of the
codes and scales, and loading quantizes them again, which restores the codes and scales exactly at the same units.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from llmpar.distributed.collectives import group_rank, group_size
from llmpar.zero import lowbit_state

if TYPE_CHECKING:
    from llmpar.zero.config import ZeroConfig
    from llmpar.zero.grads import FlatBuffer, GradReducer
    from llmpar.zero.offload import Placement
    from llmpar.zero.stage3 import Stage3Runtime

STATE_FALLBACK: dict[str, str | None] = {"master": "params", "kahan_comp": None}  # missing from a checkpoint: derive

Fetch = Callable[[str, str, int, int], torch.Tensor | None]  # (name, state key, start, stop) -> elements or None


class ZeroCheckpointing:
    """Mixin for ``ZeroOptimizer``: the methods of ``CheckpointOptimizer`` (``stage``, ``dp``, ``param_groups``,
    ``skipped_steps`` and ``last_grad_norm`` are the optimizer's own)."""

    # set by ZeroOptimizer.__init__
    buffers: list[FlatBuffer]
    frozen_buffers: list[FlatBuffer]
    stage: int
    dp: int
    rank: int
    reducer: GradReducer
    stage3: Stage3Runtime | None
    placement: Placement
    zero_config: ZeroConfig
    _save_mid_accumulation: bool = False  # inside saving_mid_accumulation()

    if TYPE_CHECKING:

        def describe(self) -> dict: ...

        def wait_params(self) -> None: ...

    def _ckpt_rank(self) -> int:
        """The shard this rank owns in every unit (stage 0: one shard, rank 0's)."""
        return self.rank if self.stage > 0 else 0

    # ------------------------------------------------------------------ what is saved
    def checkpoint_experts(self) -> tuple[Any, int, int] | None:
        """``(self.experts, ep rank, ep)`` when the model's experts are spread over expert-parallel ranks (this ep
        rank's rows of the global expert tensors, ``llmpar.checkpoint.experts``), else None."""
        experts, group = getattr(self, "experts", None), getattr(self, "ep_group", None)
        if experts is None:
            return None
        return experts, group_rank(group) if group is not None else 0, group_size(group) if group is not None else 1

    def checkpoint_facts(self) -> dict[str, bool | int]:
        """``{"offload_optimizer", "offload_param", "reduce_bucket_size"}`` for metadata.json."""
        return {
            "offload_optimizer": bool(self.placement.offload_optimizer),
            "offload_param": bool(self.placement.offload_param),
            "reduce_bucket_size": self.zero_config.reduce_bucket_size,
        }

    def checkpoint_device(self) -> torch.device:
        """Where the params live (and a checkpoint's agreement collectives run)."""
        return self.buffers[0].flat.device

    def checkpoint_layout(self) -> list[dict]:
        """``describe()["buffers"]`` (fresh dicts), each with ``"state_keys"`` (``["params", *states]``) and
        ``"steps"`` (one float per unit) added."""
        out = self.describe()["buffers"]
        for desc, b in zip(out, self.buffers):
            desc.update(state_keys=["params", *lowbit_state.seam_keys(b)], steps=[float(s) for s in b.steps])
        return out

    def checkpoint_params(self) -> list[list[tuple[str, torch.Tensor]]]:
        """Per trained buffer, ``(name, live param)`` in layout order."""
        return [[(b.layout.slot(i).name, p) for i, p in enumerate(b.params)] for b in self.buffers]

    def checkpoint_shards(self) -> list[dict[str, torch.Tensor]] | None:
        """Per buffer: this rank's partition of the params and of every state (``[partition]``) and the unit steps
        (``[units]`` float32), fresh CPU tensors; None on a stage-0 rank other than 0 (it holds what rank 0 does)."""
        views = self.checkpoint_shard_views()
        if views is None:
            return None
        return [
            {
                key: pieces[0].to("cpu", copy=True) if len(pieces) == 1 else torch.cat([p.cpu() for p in pieces])
                for key, pieces in entry.items()
            }
            for entry in views
        ]

    def checkpoint_shard_views(self) -> list[dict[str, list[torch.Tensor]]] | None:
        """:meth:`checkpoint_shards` without copies: each key as the list of views of the live buffers (on their
        device) whose concatenation it is (the params of stages 0-2: this rank's shard of each unit); "steps" fresh."""
        if self.stage == 0 and self.rank != 0:
            return None
        rank, out = self._ckpt_rank(), []
        for b in self.buffers:
            if b.shard is not None:
                params = [b.shard.detach()]
            else:
                params = [b.layout.shard_of_full(b.flat, u, rank).detach() for u in range(len(b.layout.units))]
            entry = {"params": params, **{key: [self._seam_state(b, key)] for key in lowbit_state.seam_keys(b)}}
            entry["steps"] = [torch.stack([s.detach().float().cpu() for s in b.steps])]
            out.append(entry)
        return out

    @staticmethod
    def _seam_state(b: FlatBuffer, key: str) -> torch.Tensor:
        """State ``key`` of ``b`` as the seam shows it: the live tensor, or a low-bit moment dequantized."""
        if key in b.state:
            return b.state[key].detach()
        return lowbit_state.dequantized(b, key)

    def checkpoint_held(self) -> list[list[tuple[str, int, int, int]]]:
        """Per buffer, ``(name, start, stop, at)``: elements ``[start, stop)`` of param ``name`` sit at ``at`` in this
        rank's partition (padding holds no param and is not listed)."""
        rank = self._ckpt_rank()
        return [
            [
                (b.layout.slot(i).name, a, z, b.layout.units[u].shard_offset + at)
                for u in range(len(b.layout.units))
                for i, a, z, at in b.layout.param_slices(u, rank)
            ]
            for b in self.buffers
        ]

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: full shape} of the frozen params stage 3 shards (``frozen_buffers``; none below stage 3)."""
        return {
            b.layout.slot(i).name: tuple(b.layout.slot(i).shape)
            for b in self.frozen_buffers
            for i in range(len(b.params))
        }

    def gather_frozen(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The sharded frozen params whole, on the CPU, by name, gathered one unit at a time (a frozen stage-3 param
        holds no memory between uses: read it through this). Collective over dp; ``rank0_only``: {} on other ranks."""
        rt, keep = self.stage3, self.rank == 0 or not rank0_only
        out: dict[str, torch.Tensor] = {}
        if rt is None:
            return out
        for key in rt.keys_of(None):
            b = rt.buffers[key[0]]
            if not b.frozen:
                continue
            rt.hold([key])
            if keep:
                for i in b.layout.units[key[1]].params:
                    out[b.layout.slot(i).name] = b.params[i].detach().to("cpu", copy=True)
            rt.unhold([key], write_back=False)
        return out

    @contextlib.contextmanager
    def saving_mid_accumulation(self) -> Iterator[None]:
        """Within it a save between micro-steps writes what DeepSpeed writes there instead of raising: the gradients
        accumulated so far are not part of a checkpoint (accelerate's ``save_state``, which scripts call there)."""
        self._save_mid_accumulation = True
        try:
            yield
        finally:
            self._save_mid_accumulation = False

    def prepare_save(self) -> None:
        """Raise ``ValueError`` in the middle of a gradient accumulation (the grads are not part of a checkpoint)
        unless inside :meth:`saving_mid_accumulation`; wait for gathers in flight (stage 3's, and a deferred
        all-gather of updated params: ``wait_params``)."""
        self.wait_params()
        if self.reducer.micro_steps != 0 and not self._save_mid_accumulation:
            raise ValueError(
                f"save_checkpoint in the middle of a gradient accumulation ({self.reducer.micro_steps} "
                f"micro-steps since the last optimizer step): save after engine.step() at a boundary"
            )
        if self.stage3 is not None:
            self.stage3.wait_all()

    # ------------------------------------------------------------------ what is loaded
    def checkpoint_reads(self) -> list[tuple[str, int, int]]:
        """``(name, start, stop)`` of every range :meth:`load_pieces` reads: whole params (stages 0-2), else this
        rank's pieces (the states' pieces are within those)."""
        rank, out = self._ckpt_rank(), []
        for b in self.buffers:
            for u, unit in enumerate(b.layout.units):
                if b.shard is None:
                    out += [(b.layout.slot(i).name, 0, b.layout.slot(i).numel) for i in unit.params]
                else:
                    out += [(b.layout.slot(i).name, a, z) for i, a, z, _ in b.layout.param_slices(u, rank)]
        return out

    def checkpoint_required(self) -> list[list[str]]:
        """Per buffer, the states a checkpoint must hold (the others are derived, :data:`STATE_FALLBACK`)."""
        return [["params", *(k for k in lowbit_state.seam_keys(b) if k not in STATE_FALLBACK)] for b in self.buffers]

    @torch.no_grad()
    def load_pieces(self, get: Fetch, step: Callable[[str], float], keep: frozenset[str] = frozenset()) -> None:
        """Fill this rank's params, states and unit steps from ``get(name, key, start, stop)`` (None: not in the
        checkpoint) and ``step(name)``; params named in ``keep`` (not in the checkpoint, a non-strict load) keep
        their values and states, a unit's step comes from its first param not kept (none: the step stays). Not
        collective; call :meth:`after_load` on every rank afterwards."""
        self.wait_params()  # a deferred all-gather still in flight would land over the loaded params
        rank = self._ckpt_rank()

        def need(name: str, key: str, a: int, z: int) -> torch.Tensor:
            value = get(name, key, a, z)
            if value is None:
                raise KeyError(f"the checkpoint has no {key!r} state for param {name!r}")
            return value

        for b in self.buffers:
            lay = b.layout
            # low-bit moments arrive as float32 (the seam's exp_avg / exp_avg_sq): into a partition-sized scratch,
            # starting from the live values (params in ``keep`` keep theirs), quantized per unit shard at the end
            seam = {
                k: b.state[k] if k in b.state else lowbit_state.dequantized(b, k) for k in lowbit_state.seam_keys(b)
            }
            if b.shard is None:  # stages 0-2: the whole params on every rank
                for i in range(len(b.params)):
                    s = lay.slot(i)
                    if s.name not in keep:
                        lay.param_view(b.flat, i).copy_(need(s.name, "params", 0, s.numel).view(s.shape))
            for u in range(len(lay.units)):
                pieces = [
                    (lay.slot(i).name, a, z, at)
                    for i, a, z, at in lay.param_slices(u, rank)
                    if lay.slot(i).name not in keep
                ]
                if b.shard is not None:
                    mine = lay.shard_of_partition(b.shard, u)
                    for name, a, z, at in pieces:
                        mine[at : at + z - a].copy_(need(name, "params", a, z))
                for key, t in seam.items():
                    mine = lay.shard_of_partition(t, u)
                    for name, a, z, at in pieces:
                        value = get(name, key, a, z)
                        if value is None and key not in STATE_FALLBACK:
                            raise KeyError(f"the checkpoint has no {key!r} state for param {name!r}")
                        fallback = STATE_FALLBACK.get(key)
                        if value is None and fallback is not None:
                            value = need(name, fallback, a, z)
                        if value is None:
                            mine[at : at + z - a].zero_()
                        else:
                            mine[at : at + z - a].copy_(value)
                loaded = [lay.slot(i).name for i in lay.units[u].params if lay.slot(i).name not in keep]
                if loaded:
                    b.steps[u].fill_(step(loaded[0]))
            for key, t in seam.items():
                if key not in b.state:
                    lowbit_state.quantize_into(b, key, t)

    @torch.no_grad()
    def load_frozen(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Stage 3: the sharded frozen params named in ``tensors`` (whole values) take them: this rank's slices into
        its shards, persistent (always gathered) params whole. Not collective; returns the names taken; a shape
        mismatch is a ValueError naming the param."""
        rt, offset, taken = self.stage3, len(self.buffers), []
        for bi, b in enumerate(self.frozen_buffers):
            assert b.shard is not None
            for i, p in enumerate(b.params):
                slot = b.layout.slot(i)
                if slot.name not in tensors:
                    continue
                value = tensors[slot.name]
                if tuple(value.shape) != slot.shape:
                    raise ValueError(
                        f"load_frozen: {slot.name!r} has shape {tuple(value.shape)}, the param {slot.shape}"
                    )
                flat = value.reshape(-1)
                mine = b.layout.shard_of_partition(b.shard, slot.unit)
                for j, a, z, at in b.layout.param_slices(slot.unit, self.rank):
                    if j == i:
                        mine[at : at + z - a].copy_(flat[a:z])
                if rt is not None and (offset + bi, slot.unit) in rt.persistent:
                    p.copy_(value)
                taken.append(slot.name)
        return taken

    def after_load(self) -> None:
        """Stage 3: re-gather the persistent units from the loaded shards (collective over dp). Error feedback of
        quantized gradients: the residuals belong to the trajectory before the load and are not in checkpoints:
        they restart from zero (said once in the log)."""
        if self.stage3 is not None:
            self.stage3.regather_persistent()
        q = self.reducer.quantizer
        if q is not None and q.error_feedback:
            q.residual.clear()
            q.residual2.clear()
            if self.rank == 0:
                logging.getLogger("llmpar").warning(
                    "zero_quantized_gradients_error_feedback: the compression residuals are not saved in checkpoints; "
                    "after this load they restart from zero"
                )


__all__ = ["STATE_FALLBACK", "ZeroCheckpointing"]
