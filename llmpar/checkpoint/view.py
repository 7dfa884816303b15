"""What a checkpoint needs to know about an engine, for the plain :class:`llmpar.engine.Engine` and the pipeline
:class:`llmpar.pipeline.engine.PipelineEngine` alike.

    view = EngineView(engine)
    view.grid                  # groups spanning dp x tp (x pp), this rank's dp / tp / pp rank and the degrees
    view.saved_name[slot]      # optimizer param name -> name in the checkpoint (the original, unsplit model's)
    view.duplicates            # optimizer param names not written (tied copies also held by a lower stage)
    view.targets()             # {checkpoint name: (live tensor, is_param)} of the modules this rank holds
    view.specs()               # {optimizer param name: tp split spec or None}

A pipeline engine's optimizer names its params ``stage{s}.{name in the stage module}`` (``blocks_3.attn.qkv.weight``,
``head.lm_head.weight``). The checkpoint records them under the unsplit model's names (``blocks.3.attn.qkv.weight``,
``lm_head.weight``): the blocks of :func:`llmpar.pipeline.blocks.to_blocks` hold the model's own submodules, so each
stage-local name maps through the block's param to its name in the model. A weight tied between stages (embedding
= lm_head) maps to one name (the model's first) and is written once, by the lowest stage holding it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmpar.checkpoint.reshard import tp_specs
from llmpar.distributed.collectives import group_rank, group_size


@dataclass(kw_only=True)
class Grid:
    """Where this rank sits: ``groups`` span the whole grid (an agreement takes the max over each in turn)."""

    groups: list
    dp_rank: int
    dp: int
    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    device: torch.device

    @property
    def rank0(self) -> bool:
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == 0

    def file(self, dp_rank: int | None = None) -> str:
        from llmpar.checkpoint.files import rank_file

        return rank_file(self.dp_rank if dp_rank is None else dp_rank, self.tp_rank, self.pp_rank, self.pp)


class EngineView:
    """The checkpoint's view of ``engine`` (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.runner = getattr(engine, "runner", None)
        dp_group = self.opt.dp_group
        if self.runner is not None:
            split = self.runner.split
            tp_group, pp_group = split.tp_group, (split.pp_group if split.pp > 1 else None)
            self.modules: list[nn.Module] = list(split.modules)
        else:
            tp_group, pp_group = engine.tp_group, None
            self.modules = [engine.module]
        groups = [g for g in (dp_group, tp_group, pp_group) if g is not None]
        self.grid = Grid(groups=groups, dp_rank=group_rank(dp_group), dp=group_size(dp_group),
                         tp_rank=group_rank(tp_group) if tp_group is not None else 0,
                         tp=group_size(tp_group) if tp_group is not None else 1,
                         pp_rank=group_rank(pp_group) if pp_group is not None else 0,
                         pp=group_size(pp_group) if pp_group is not None else 1,
                         device=self.opt.buffers[0].flat.device)
        self._local = self._local_names()  # optimizer / module-local name -> checkpoint name
        self.saved_name = {b.layout.slot(i).name: self._local.get(b.layout.slot(i).name, b.layout.slot(i).name)
                           for b in self.opt.buffers for i in range(len(b.params))}
        dup = {id(p) for p in getattr(self.runner, "_tied_duplicates", [])}
        self.duplicates = {b.layout.slot(i).name for b in self.opt.buffers for i, p in enumerate(b.params)
                           if id(p) in dup}

    def _named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        """(optimizer-style name, tensor) of this rank's module params / buffers, tied ones under every name."""
        out = []
        if self.runner is None:
            return list(getattr(self.modules[0], kind)(remove_duplicate=False))
        for m, s in zip(self.runner.split.modules, self.runner.split.stage_indices):
            out += [(f"stage{s}.{n}", t) for n, t in getattr(m, kind)(remove_duplicate=False)]
        return out

    def _local_names(self) -> dict[str, str]:
        if self.runner is None:
            return {}
        from llmpar.pipeline.blocks import stage_key, to_blocks

        model = self.engine.module
        by_id: dict[int, str] = {}
        for kind in ("named_parameters", "named_buffers"):
            for n, t in getattr(model, kind)(remove_duplicate=False):
                by_id.setdefault(id(t), n)
        block_names: dict[str, str] = {}  # "blocks_3.attn.qkv.weight" -> "blocks.3.attn.qkv.weight"
        for bname, block in to_blocks(model):
            for kind in ("named_parameters", "named_buffers"):
                for n, t in getattr(block, kind)(remove_duplicate=False):
                    block_names[f"{stage_key(bname)}.{n}"] = by_id.get(id(t), f"{bname}.{n}")
        out = {}
        for kind in ("named_parameters", "named_buffers"):
            for name, _ in self._named(kind):
                local = name.split(".", 1)[1]
                out[name] = block_names.get(local, local)
        return out

    def targets(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """{checkpoint name: (live tensor, is_param)} of this rank's modules (the first holder of a shared one)."""
        out: dict[str, tuple[torch.Tensor, bool]] = {}
        for kind, is_param in (("named_parameters", True), ("named_buffers", False)):
            for name, t in self._named(kind):
                if t is not None:
                    out.setdefault(self._local.get(name, name), (t, is_param))
        return out

    def specs(self) -> dict[str, dict | None]:
        """{optimizer param name: how it is split over tp (``reshard.tp_specs``), None when replicated}."""
        by_id: dict[int, dict | None] = {}
        for m in self.modules:
            by_id.update(tp_specs(m, self.grid.tp))
        out = {}
        for b in self.opt.buffers:
            for i, p in enumerate(b.params):
                slot = b.layout.slot(i)
                spec = by_id.get(id(p))
                if spec is not None and spec.get("padded") is None:  # no owner told the padding: none
                    spec = {**spec, "full": slot.shape[spec["dim"]] * self.grid.tp,
                            "padded": slot.shape[spec["dim"]] * self.grid.tp}
                out[slot.name] = spec
        return out
