"""What one save or load sees of an engine, computed once from the protocol (``protocol.py``) for the plain
:class:`llmpar.runtime.Engine` and the :class:`llmpar.runtime.PipelineEngine` alike.

    view = EngineView(engine)
    view.grid                  # groups spanning dp x tp (x pp), this rank's dp / tp / pp rank and the degrees
    view.layout                # the optimizer's buffers as metadata.json lists them (optimizer param names)
    view.saved_name[name]      # optimizer param name -> name in the checkpoint (the original, unsplit model's)
    view.duplicates            # optimizer param names not written (tied copies also held by a lower stage)
    view.targets()             # {checkpoint name: (live tensor, is_param)} of the modules this rank holds
    view.specs()               # {optimizer param name: tp split spec or None}
    view.put_extras(values)    # buffers and frozen params written by name
    view.unexpected(stored, strict=..., where=..., show=...)  # names of a checkpoint in no rank's model (collective)

How a pipeline engine's stage-local names (``stage1.blocks_3.attn.qkv.weight``) map to the unsplit model's
(``blocks.3.attn.qkv.weight``) is the engine's business (``checkpoint_names``); a weight tied between stages maps to
one name and is written once, by the lowest stage holding it (``checkpoint_duplicates``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from llmpar.checkpoint.files import CheckpointError, agree_all
from llmpar.checkpoint.protocol import Checkpointable, CheckpointOptimizer, Grid
from llmpar.checkpoint.reshard import tp_specs

__all__ = ["EngineView", "Grid"]


class EngineView:
    """The checkpoint's view of ``engine`` (see the module docstring)."""

    def __init__(self, engine: Checkpointable) -> None:
        self.engine = engine
        self.opt: CheckpointOptimizer = engine.optimizer
        self.grid: Grid = engine.checkpoint_grid()
        self.layout: list[dict] = self.opt.checkpoint_layout()
        self.params: list[list[tuple[str, torch.Tensor]]] = self.opt.checkpoint_params()
        local = engine.checkpoint_names()
        self.saved_name = {name: local.get(name, name) for buf in self.params for name, _ in buf}
        self.duplicates: set[str] = set(engine.checkpoint_duplicates())

    def targets(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """{checkpoint name: (live tensor, is_param)} of this rank's modules (the first holder of a shared one)."""
        return self.engine.checkpoint_targets()

    def unexpected(
        self,
        stored: list[str],
        *,
        strict: bool,
        where: str,
        show: Callable[[list[str]], str],
        noun: str = "params / buffers",
        call: str = "load_checkpoint",
    ) -> list[str]:
        """Collective: the names of ``stored`` (the same list on every rank) that no rank's model holds. With
        ``strict`` they fail every rank (``where``: what the checkpoint is, ``show``: how the names are listed);
        otherwise rank 0 warns that they are ignored."""
        g = self.grid
        mine = set(self.saved_name.values()) | set(self.targets())
        held = agree_all([int(n in mine) for n in stored], g.groups, g.device)
        out = [n for n, h in zip(stored, held) if not h]
        if out and strict:
            raise CheckpointError(
                f"{len(out)} {noun} in {where} are in no rank's model: {show(out)} "
                f"({call}(..., strict=False) ignores them)"
            )
        if out and g.rank0:
            logging.getLogger("llmpar").warning(
                "%s(strict=False): %d %s in %s are in no rank's model, ignored: %s",
                call,
                len(out),
                noun,
                where,
                show(out),
            )
        return out

    def put_extras(self, values: dict[str, torch.Tensor]) -> None:
        """Write buffers and frozen params by checkpoint name: a frozen param into the optimizer's shards (it may be
        partitioned), anything else into the live tensor."""
        targets, frozen, to_shards = self.targets(), self.opt.frozen_shapes(), {}
        with torch.no_grad():
            for name, value in values.items():
                if name in frozen:
                    to_shards[name] = value
                else:
                    targets[name][0].copy_(value)
        if to_shards:
            self.opt.load_frozen(to_shards)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{optimizer param name: its local shape}."""
        return {p["name"]: tuple(p["shape"]) for b in self.layout for p in b["params"]}

    def specs(self) -> dict[str, dict | None]:
        """{optimizer param name: how it is split over tp (``reshard.tp_specs``), None when replicated}."""
        by_id: dict[int, dict | None] = {}
        for m in self.engine.checkpoint_modules():
            by_id.update(tp_specs(m, self.grid.tp))
        shapes, out = self.shapes(), {}
        for buf in self.params:
            for name, p in buf:
                spec = by_id.get(id(p))
                if spec is not None and spec.get("padded") is None:  # no owner told the padding: none
                    spec = {
                        **spec,
                        "full": shapes[name][spec["dim"]] * self.grid.tp,
                        "padded": shapes[name][spec["dim"]] * self.grid.tp,
                    }
                out[name] = spec
        return out
