"""The checkpoint protocol: what ``llmpar.checkpoint`` needs from an optimizer and from an engine, and nothing more.

``save.py`` / ``load.py`` see an engine only through :class:`Checkpointable` and its optimizer only through
:class:`CheckpointOptimizer`; they never read an attribute these classes do not list, so a change inside the
optimizer (its flat buffers, units, stage-3 runtime) or the pipeline runner cannot silently break a checkpoint: it
breaks the optimizer's (``llmpar.zero.checkpointing``) or the engine's (``llmpar.runtime``) implementation of a
method, where its own tests see it. Both sides speak in *named pieces*: a param is addressed by its optimizer name
and an element range ``[start, stop)`` of its flat (``reshape(-1)``) view, whatever the layout behind it.

    optimizer (ZeroOptimizer via ZeroCheckpointing)         engine (Engine, PipelineEngine via EngineBase)
      checkpoint_layout()   buffers as metadata.json lists    checkpoint_grid()        dp x tp (x pp) groups, ranks
      checkpoint_params()   (name, live tensor) per buffer    checkpoint_names()       optimizer name -> saved name
      checkpoint_shards()   this rank's partitions, CPU       checkpoint_targets()     {saved name: (tensor, is_param)}
      checkpoint_held()     (name, start, stop, at) held      checkpoint_duplicates()  tied copies not written
      checkpoint_reads()    (name, start, stop) load needs    checkpoint_modules()     modules (tp split specs)
      checkpoint_required() state keys it cannot derive       checkpoint_counters() / restore_counters()
      load_pieces(get, step, keep) own shards; keep: not in it optimizer, lr_scheduler, global_steps
      frozen_shapes() / gather_frozen() / load_frozen()       checkpoint_pending       its unpublished async save
      prepare_save() / after_load()
      checkpoint_facts(), checkpoint_device(), stage, dp, param_groups, skipped_steps, last_grad_norm
                                                              (optional, ``DescribesModel``) checkpoint_model():
                                                               HF config + generation config, buffers not saved
      (optional, ``ShardViews``) checkpoint_shard_views(): the partitions as views of the live buffers, no copy
      (optional, ``HoldsExperts``) checkpoint_experts(): the expert optimizer, ep rank, ep (``experts.py``)

The protocols are structural (``typing.Protocol``): an implementation needs no import of this module, and the data
crossing the seam is plain (str, int, tuples, dicts, CPU tensors).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from llmpar.distributed.collectives import Group, group_rank, group_size

Piece = tuple[str, int, int]
"""(optimizer param name, start, stop): elements ``[start, stop)`` of the param's flat view."""

HeldPiece = tuple[str, int, int, int]
"""(optimizer param name, start, stop, at): those elements sit at ``[at, at + stop - start)`` of this rank's
partition of a buffer (``CheckpointOptimizer.checkpoint_shards``)."""

Fetch = Callable[[str, str, int, int], torch.Tensor | None]
"""``get(name, key, start, stop)``: elements ``[start, stop)`` of param ``name``'s state ``key`` ("params",
"exp_avg", "master", ...) from the checkpoint, cut for this rank's layout, as a flat CPU tensor; None when the
checkpoint holds no such state (the optimizer derives it, or raises)."""

StepOf = Callable[[str], float]
"""``step(name)``: the optimizer step count saved for the unit that held param ``name``."""

FaultHook = Callable[[str], None]
"""A test hook called with a point name ("before_write", "shard_written", "before_publish", "old_moved_aside",
"before_latest", "before_cleanup") on every rank that reaches it; a hook that raises simulates a crash there."""


@dataclass(kw_only=True)
class Grid:
    """Where this rank sits: ``groups`` span the whole grid (an agreement takes the max over each in turn);
    ``device``: where the agreement collectives run (cuda under NCCL)."""

    groups: list[Group]
    dp_rank: int
    dp: int
    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    device: torch.device

    @classmethod
    def of(cls, dp_group: Group, tp_group: Group | None, pp_group: Group | None, device: torch.device) -> "Grid":
        """The grid of a dp group and optional tp / pp groups (None: degree 1)."""
        return cls(
            groups=[g for g in (dp_group, tp_group, pp_group) if g is not None],
            dp_rank=group_rank(dp_group),
            dp=group_size(dp_group),
            tp_rank=group_rank(tp_group) if tp_group is not None else 0,
            tp=group_size(tp_group) if tp_group is not None else 1,
            pp_rank=group_rank(pp_group) if pp_group is not None else 0,
            pp=group_size(pp_group) if pp_group is not None else 1,
            device=device,
        )

    @property
    def rank0(self) -> bool:
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == 0


@runtime_checkable
class CheckpointOptimizer(Protocol):
    """The optimizer's side: its layout, its named shards, and loading them back. Names are the optimizer's param
    names; buffers are listed in one fixed order, the same in every per-buffer method."""

    stage: int  # ZeRO stage 0-3 (recorded in metadata.json)
    dp: int  # data-parallel degree the optimizer shards over
    param_groups: list[dict[str, Any]]  # "lr", "betas", "eps", "weight_decay" are saved and restored
    skipped_steps: int
    last_grad_norm: float | None

    def checkpoint_facts(self) -> dict[str, bool | int]:
        """Run facts for metadata.json: ``{"offload_optimizer", "offload_param", "reduce_bucket_size"}``."""
        ...

    def checkpoint_device(self) -> torch.device:
        """The device the optimizer's params live on (where the checkpoint's agreement collectives run)."""
        ...

    def checkpoint_layout(self) -> list[dict]:
        """One fresh dict per buffer, as metadata.json records it: at least ``"mode"``, ``"units"`` (each with
        ``"padded"`` and ``"shard_offset"``), ``"params"`` (each ``{"name", "shape", "unit", "offset"}``, in buffer
        order), ``"state_keys"`` (``["params", *states]``) and ``"steps"`` (one float per unit). Element e of a
        param is at unit-relative position ``offset + e``, in shard ``pos // (padded // shards)``."""
        ...

    def checkpoint_params(self) -> list[list[tuple[str, torch.Tensor]]]:
        """Per buffer, ``(name, live param)`` in buffer order (the tensors identify params: tp split, tied copies)."""
        ...

    def checkpoint_shards(self) -> list[dict[str, torch.Tensor]] | None:
        """Per buffer, this rank's partition of each state as a fresh CPU tensor: ``"params"`` and every state key
        of the buffer (``[partition]``), and ``"steps"`` (``[units]`` float32). None when this rank holds no shard
        that another rank does not hold too (stage 0, dp rank > 0)."""
        ...

    def checkpoint_held(self) -> list[list[HeldPiece]]:
        """Per buffer, the pieces of params in this rank's partition (see :data:`HeldPiece`)."""
        ...

    def checkpoint_reads(self) -> list[Piece]:
        """Every element range :meth:`load_pieces` will ask for (any state key): what a load must be able to read."""
        ...

    def checkpoint_required(self) -> list[list[str]]:
        """Per buffer, the state keys :meth:`load_pieces` cannot derive when the checkpoint lacks them."""
        ...

    def load_pieces(self, get: Fetch, step: StepOf, keep: frozenset[str] = frozenset()) -> None:
        """Fill this rank's params, states and step counts from ``get`` / ``step`` (not collective). Params named in
        ``keep`` are not in the checkpoint (``load_checkpoint(strict=False)``): they keep their values and states,
        and a unit's step comes from a param not kept (no param of the unit loaded: its step stays). The loader
        passes ``keep`` only when it is not empty."""
        ...

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: full shape} of frozen params the optimizer shards (they are not whole in the module)."""
        ...

    def gather_frozen(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Those frozen params whole, on the CPU, on dp rank 0 ({} elsewhere unless not ``rank0_only``). Collective
        over dp."""
        ...

    def load_frozen(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Those frozen params named in ``tensors`` (whole values) take them, into this rank's shards; returns the
        names taken."""
        ...

    def prepare_save(self) -> None:
        """Before a snapshot: raise ``ValueError`` in the middle of a gradient accumulation, finish in-flight work."""
        ...

    def after_load(self) -> None:
        """After :meth:`load_pieces` on every rank (collective over dp): re-derive what depends on the shards."""
        ...


class SchedulerState(Protocol):
    """An LR scheduler as a checkpoint saves it."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


class PendingSave(Protocol):
    """An async save between its snapshot and its publish (``save.py``)."""

    done: threading.Event  # set once its files are written (or failed)

    def finish(self) -> str:
        """Publish it (collective); returns its path."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """The engine's side: where the rank sits, what the modules hold and under which names, the run counters."""

    optimizer: CheckpointOptimizer
    lr_scheduler: SchedulerState | None
    global_steps: int  # names the default tag ``global_step{N}``
    checkpoint_pending: PendingSave | None  # this engine's async save not published yet

    def checkpoint_grid(self) -> Grid:
        """This rank's place in the dp x tp (x pp) grid."""
        ...

    def checkpoint_names(self) -> dict[str, str]:
        """{optimizer / module-local name: name in the checkpoint (the unsplit model's)}; absent names map to
        themselves."""
        ...

    def checkpoint_targets(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """{checkpoint name: (live tensor, is_param)} of every param and buffer of the modules this rank holds (the
        first holder of a shared one; a buffer the module does not keep in its ``state_dict`` may be left out)."""
        ...

    def checkpoint_duplicates(self) -> set[str]:
        """Optimizer param names not to write: tied copies that another (lower) pipeline stage writes."""
        ...

    def checkpoint_modules(self) -> list[nn.Module]:
        """The modules this rank holds (their tensor-parallel layers tell how each param is split)."""
        ...

    def checkpoint_counters(self) -> dict[str, Any]:
        """Run counters to save (``micro_steps``, ``global_steps``, ``global_samples``, ``skipped_steps``)."""
        ...

    def restore_counters(self, counters: dict[str, Any]) -> None:
        """Take the saved counters back."""
        ...


@runtime_checkable
class ShardViews(Protocol):
    """Optional for an optimizer: :meth:`CheckpointOptimizer.checkpoint_shards` without the copies, for a save that
    writes them before the state changes (a synchronous save) or copies them itself (an async save's snapshot)."""

    def checkpoint_shard_views(self) -> list[dict[str, list[torch.Tensor]]] | None:
        """Per buffer, each key of :meth:`CheckpointOptimizer.checkpoint_shards` as the list of tensors whose
        concatenation (flattened) it is: views of the live state, on its device; None where ``checkpoint_shards``
        is None."""
        ...


@runtime_checkable
class HoldsExperts(Protocol):
    """Optional for an optimizer whose model's experts are spread over expert-parallel ranks (``experts.py``)."""

    def checkpoint_experts(self) -> tuple[CheckpointOptimizer, int, int] | None:
        """``(the optimizer of the expert params, this rank's ep rank, ep)``: the expert params are this ep rank's
        rows ``[ep_rank E_local, (ep_rank + 1) E_local)`` of global tensors ``[E_local ep, ...]``; None when the
        optimizer holds none."""
        ...


@runtime_checkable
class DescribesModel(Protocol):
    """Optional for an engine: what a checkpoint records about the model beyond its tensors (an engine without it
    saves checkpoints without them: ``consolidate`` then writes no ``config.json``)."""

    def checkpoint_model(self) -> dict[str, Any]:
        """``{"hf_config": dict | None, "hf_generation_config": dict | None, "unsaved_buffers": [names]}``: the model's
        HuggingFace config and generation config as JSON-able dicts (``metadata.json`` records them under
        ``"model"``), and the checkpoint names of its module buffers that :meth:`Checkpointable.checkpoint_targets`
        leaves out (non-persistent: recomputed by the module, not in its ``state_dict``), which a load ignores
        when a checkpoint written before they were left out holds them."""
        ...


__all__ = [
    "CheckpointOptimizer",
    "Checkpointable",
    "DescribesModel",
    "FaultHook",
    "Fetch",
    "Grid",
    "HeldPiece",
    "HoldsExperts",
    "PendingSave",
    "Piece",
    "SchedulerState",
    "ShardViews",
    "StepOf",
]
