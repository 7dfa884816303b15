"""Any reader of the protocol (``source.py``) loaded into an engine through the checkpoint protocol, written once
for the foreign formats: DeepSpeed's (``deepspeed/load.py`` adds what its files need), universal, and the pieces
DCP's load uses (``dcp/load.py``). Any dp, ZeRO stage, offload and tp load them.

Every rank opens the checkpoint and plans what it needs (:func:`plan`): each param of this rank must be in the
checkpoint with the same full shape (a tensor-parallel param is cut from the full tensor along its split dim, padding
re-added: ``reshard.py``'s rule, :class:`Pieces`), and each state its optimizer cannot derive must be there;
``strict`` as in llmpar's load (a param or buffer the model has and the checkpoint lacks, or one of the checkpoint no
rank's model has, is an error naming it; False: kept / ignored, with a warning). The ranks agree on the outcome
before anything is modified. Then (:func:`apply`) ``load_pieces`` fills this rank's params (from the fp32 masters),
moments and step counts; module buffers and frozen params are copied; the param-group hyper-parameters, engine
counters (``global_steps``, ``global_samples``, ``skipped_steps``: what DeepSpeed restores), the fp16 loss scaler
and the LR scheduler follow, and the caller's client_state is returned. These formats hold no RNG states: this
engine's stay as they are.

An engine spreading its experts over expert-parallel ranks (``experts.expert_side``) also fills its expert optimizer
(sharded over the expert-data-parallel ranks) through ``load_pieces`` (:class:`ExpertPieces`): each expert param of
this rank is read by its global name (``experts.placement``: a one-expert param, as DeepSpeed's legacy layer holds
them, whole under its global index; a packed one as this ep rank's rows of the global tensor), so a checkpoint
written at any ep (DeepSpeed's MoE files name every expert globally) loads at any other. Its shapes, expert counts
and required states are checked with the dense ones, before anything is modified.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.experts import Where, expert_side, placement, refuse_expert_state
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.source import HYPER, Source
from llmpar.checkpoint.protocol import Checkpointable, DescribesModel
from llmpar.checkpoint.reshard import Cut, full_shape
from llmpar.checkpoint.shards import extras_names
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")


def shown(names: list[str] | set[str], limit: int = 8, ck: Source | None = None) -> str:
    """The first ``limit`` names, each with the file holding it in ``ck`` where it tells (a pipeline checkpoint)."""
    names = sorted(names)
    where = {n: ck.file_of(n) for n in names[:limit]} if ck is not None else {}
    shown = ", ".join(repr(n) + (f" ({where[n]})" if where.get(n) else "") for n in names[:limit])
    return f"[{shown}]" + (f" and {len(names) - limit} more" if len(names) > limit else "")


class Pieces:
    """The checkpoint's states cut for this rank, as ``load_pieces`` asks for them (:meth:`get`): a replicated param's
    elements as saved, a tensor-parallel one's from its full tensor (one full tensor cached at a time)."""

    def __init__(self, ck: Source, view: EngineView) -> None:
        self.ck, self.view = ck, view
        g, specs = view.grid, view.specs()
        self.cuts = {n: Cut(shape=s, spec=specs[n], tp=g.tp, rank=g.tp_rank) for n, s in view.shapes().items()}
        self._cache: tuple[tuple[str, str], torch.Tensor] | None = None

    def check(self, local: str) -> None:
        """A CheckpointError naming the param when the checkpoint's cannot be cut into this rank's."""
        name, cut = self.view.saved_name[local], self.cuts[local]
        here, there = full_shape(cut.shape, cut.spec), self.ck.shapes[self.ck.source(name)]
        if here != there:
            raise CheckpointError(
                f"param {name!r} has full shape {here} here (tp={cut.tp}) but {there} in {self.ck.path}"
            )

    def get(self, local: str, key: str, a: int, z: int) -> torch.Tensor | None:
        name, cut = self.view.saved_name[local], self.cuts[local]
        if not self.ck.has(name, key):
            return None
        if cut.spec is None:
            return self.ck.read(name, key, a, z)
        if self._cache is None or self._cache[0] != (local, key):
            whole = self.ck.read(name, key, 0, math.prod(self.ck.shapes[self.ck.source(name)]))
            full = whole.view(self.ck.shapes[self.ck.source(name)])
            dim, chunk = cut.spec["dim"], cut.spec["padded"] // cut.tp
            lo, hi = cut.rank * chunk, (cut.rank + 1) * chunk
            part = full.narrow(dim, min(lo, full.shape[dim]), max(0, min(hi, full.shape[dim]) - lo))
            if part.shape[dim] < chunk:  # this run's padding rows
                pad = list(part.shape)
                pad[dim] = chunk - part.shape[dim]
                part = torch.cat([part, torch.zeros(pad, dtype=part.dtype)], dim)
            self._cache = ((local, key), part.reshape(-1))
        return self._cache[1][a:z]


def every_expert(engine: Checkpointable) -> list[str]:
    """The global names of the experts of every ep rank of ``engine`` (the whole model's; none without experts
    spread over ranks). Not collective: each rank names the others' from its own."""
    side = expert_side(engine.optimizer)
    if side is None:
        return []
    return sorted({n for w in placement(engine, *side).values() for n in (w.every or (w.name,))})


class ExpertPieces:
    """This rank's experts (``engine.optimizer``'s expert optimizer) read from ``ck`` by their global names (module
    docstring): ``get`` / ``step`` as ``load_pieces`` asks for them; ``missing``: the expert optimizer names the
    checkpoint lacks. Checked at construction (a ``CheckpointError`` naming the param)."""

    def __init__(self, engine: Checkpointable, ck: Source, strict: bool) -> None:
        side = expert_side(engine.optimizer)
        assert side is not None
        self.xopt, ep_rank, self.ep = side
        refuse_expert_state(engine, self.xopt, self.ep, "load_checkpoint")
        self.ck = ck
        self.where: dict[str, Where] = placement(engine, self.xopt, ep_rank, self.ep)
        self.missing: set[str] = set()
        for local, w in self.where.items():
            saved = ck.shapes.get(ck.aliases.get(w.name, w.name))
            if saved is None:
                self.missing.add(local)
                continue
            if w.packed and saved[0] % self.ep:
                raise CheckpointError(
                    f"{ck.path}: {w.name!r} holds {saved[0]} experts, which do not split over ep={self.ep} "
                    "expert-parallel ranks: load it at an ep dividing them"
                )
            if tuple(saved) != w.shape:
                raise CheckpointError(
                    f"expert param {w.name!r} has full shape {w.shape} here (ep={self.ep}) but {tuple(saved)} in "
                    f"{ck.path}"
                )
        for b, required in zip(self.xopt.checkpoint_layout(), self.xopt.checkpoint_required()):
            present = [self.where[p["name"]].name for p in b["params"] if p["name"] not in self.missing]
            for key in required:
                if present and not ck.has(present[0], key):
                    raise CheckpointError(
                        f"checkpoint {ck.path} ({ck.describe()}) has no {key!r} state for the experts, which this "
                        f"expert optimizer (mode {b['mode']!r}) needs"
                    )
        if self.missing and strict:
            raise CheckpointError(
                f"{len(self.missing)} expert params of this model are not in checkpoint {ck.path} "
                f"({ck.describe()}): {shown({self.where[n].name for n in self.missing})} "
                "(load_checkpoint(..., strict=False) keeps their current values)"
            )
        if self.missing:
            logger.warning(
                "load_checkpoint(strict=False): %d expert params of this model are not in %s, they keep their "
                "current values: %s",
                len(self.missing),
                ck.path,
                shown({self.where[n].name for n in self.missing}),
            )

    def names(self) -> set[str]:
        """The global names of this rank's experts."""
        return {w.name for w in self.where.values()}

    def prepare(self) -> None:
        for w in self.where.values():
            if w.name in self.ck.shapes or w.name in self.ck.aliases:
                self.ck.prepare(w.name, w.shape)

    def get(self, local: str, key: str, a: int, z: int) -> torch.Tensor | None:
        w = self.where[local]
        if not self.ck.has(w.name, key):
            return None
        return self.ck.read(w.name, key, a + w.offset, z + w.offset)

    def step(self, local: str) -> float:
        return self.ck.step(self.where[local].name)

    def load(self) -> None:
        """Fill the expert optimizer (not collective; its ``after_load`` follows on every rank)."""
        if self.missing:
            self.xopt.load_pieces(self.get, self.step, keep=frozenset(self.missing))
        else:
            self.xopt.load_pieces(self.get, self.step)


def plan(
    engine: Checkpointable, view: EngineView, ck: Source, src: Pieces, strict: bool, sched: Any
) -> tuple[set[str], dict[str, torch.Tensor]]:
    """The optimizer names this rank keeps (not in the checkpoint) and the buffers / frozen params it takes; raises
    on what cannot be loaded."""
    missing: set[str] = set()
    for b, required in zip(view.layout, view.opt.checkpoint_required()):
        present = []
        for slot in b["params"]:
            name = view.saved_name[slot["name"]]
            if ck.aliases.get(name, name) not in ck.shapes:
                missing.add(slot["name"])
                continue
            src.check(slot["name"])
            present.append(name)
        for key in required:
            if present and not ck.has(present[0], key):
                raise CheckpointError(
                    f"DeepSpeed checkpoint {ck.path} (ZeRO-{ck.stage}) has no {key!r} state, "
                    f"which this optimizer (mode {b['mode']!r}) needs"
                )
    targets, frozen = view.targets(), view.opt.frozen_shapes()
    trained = set(view.saved_name.values())
    unsaved = set(engine.checkpoint_model().get("unsaved_buffers", ())) if isinstance(engine, DescribesModel) else set()
    saved = {**ck.buffers(), **ck.frozen()}
    extras, lacking = {}, {view.saved_name[n] for n in missing}
    for name in set(extras_names(targets, trained | set(frozen))) | set(frozen):
        if name in unsaved:
            continue
        if name not in saved:
            lacking.add(name)
            continue
        shape = frozen.get(name, tuple(targets[name][0].shape) if name in targets else None)
        if tuple(saved[name].shape) != tuple(shape or ()):
            raise CheckpointError(f"{name!r} has shape {tuple(saved[name].shape)} in {ck.path} and {shape} here")
        extras[name] = saved[name]
    if lacking and strict:
        raise CheckpointError(
            f"{len(lacking)} params / buffers of this model are not in DeepSpeed checkpoint "
            f"{ck.path} ({ck.describe()}): {shown(lacking)} (load_checkpoint(..., strict=False) "
            "keeps their current values)"
        )
    if lacking:
        logger.warning(
            "load_checkpoint(strict=False): %d params / buffers of this model are not in %s, they keep "
            "their current values: %s",
            len(lacking),
            ck.path,
            shown(lacking),
        )
    saved_sched = ck.scheduler()
    if sched is not None and isinstance(saved_sched, dict):
        mine = sched.state_dict()
        if set(mine) != set(saved_sched):
            raise CheckpointError(
                f"the LR scheduler in {ck.path} has state {sorted(saved_sched)}, this engine's "
                f"{type(sched).__name__} {sorted(mine)} (load_lr_scheduler_states=False keeps "
                "this engine's)"
            )
    return missing, extras


def apply(
    engine: Checkpointable,
    view: EngineView,
    path: str,
    ck: Source,
    src: Pieces,
    keep: set[str] | None,
    extras: dict,
    *,
    strict: bool,
    sched: Any,
    where: str,
    show: Callable[[list[str]], str],
    experts: ExpertPieces | None = None,
) -> None:
    """Collective: what checkpoint ``ck`` holds, put into ``engine`` once :func:`plan` agreed: refuse (``strict``) or
    ignore names in no rank's model, load the states (``keep``: the optimizer names to load, None: all; ``experts``:
    the expert optimizer's), buffers and frozen params, hyper-parameters, counters and the scheduler."""
    g, opt = view.grid, engine.optimizer
    stored = sorted(set(ck.names) | set(ck.aliases) | set(ck.buffers()) | set(ck.frozen()))  # the same on every rank
    if expert_side(opt) is not None:
        # experts go by their global names, which no module holds: those some rank's experts take are not unexpected
        mine = experts.names() if experts is not None else set()
        held = files.agree_all([int(n in mine) for n in stored], g.groups, g.device)
        stored = [n for n, h in zip(stored, held) if not h]
    view.unexpected(stored, strict=strict, where=where, show=show)
    with files.all_or_mixed(g, path):
        step = lambda local: ck.step(view.saved_name[local])  # noqa: E731
        if keep:
            opt.load_pieces(src.get, step, keep=frozenset(keep))
        else:
            opt.load_pieces(src.get, step)
        if experts is not None:
            experts.load()
        view.put_extras(extras)
    opt.after_load()
    if experts is not None:
        experts.xopt.after_load()
    groups = ck.hyper()
    if len(groups) == len(opt.param_groups):
        for group, saved in zip(opt.param_groups, groups):
            group.update({k: (tuple(saved[k]) if k == "betas" else saved[k]) for k in HYPER if k in saved})
    elif g.rank0:
        logger.warning(
            "load_checkpoint: %s has %d param groups, this optimizer %d: their hyper-parameters (lr, "
            "betas, eps, weight_decay) stay as configured",
            path,
            len(groups),
            len(opt.param_groups),
        )
    engine.restore_counters(ck.counters())
    if sched is not None and ck.scheduler() is not None:
        sched.load_state_dict(ck.scheduler())


def load_source(
    engine: Checkpointable,
    view: EngineView,
    path: str,
    open_reader: Callable[[], Source],
    *,
    strict: bool,
    scheduler: bool,
    what: str,
) -> tuple[str, dict | None]:
    """Load the checkpoint ``open_reader()`` opens (directory ``path``) into ``engine`` (collective over its grid;
    ``load.py``'s ``load_checkpoint`` calls it, through the format's loader, once the ranks agreed they read the same
    checkpoint): opened, this rank's params prepared (``Source.prepare``: their files opened and checked) and
    planned on every rank, agreed, then applied (module docstring). ``what``: the format, in messages. Returns
    ``(path, client_state)``."""
    g, opt = view.grid, engine.optimizer
    sched = engine.lr_scheduler if scheduler else None
    xsrc: ExpertPieces | None = None
    with files.agreed(g, "load_checkpoint"):
        ck = open_reader()
        src = Pieces(ck, view)
        for local, cut in src.cuts.items():
            name = view.saved_name[local]
            if ck.aliases.get(name, name) in ck.shapes:
                ck.prepare(name, full_shape(cut.shape, cut.spec))
        if expert_side(opt) is not None:  # this rank's experts, by their global names
            xsrc = ExpertPieces(engine, ck, strict)
            xsrc.prepare()
        keep, extras = plan(engine, view, ck, src, strict, sched)
    apply(
        engine,
        view,
        path,
        ck,
        src,
        keep,
        extras,
        strict=strict,
        sched=sched,
        where=f"{what} checkpoint {path} ({ck.describe()})",
        show=lambda names: shown(names, ck=ck),
        experts=xsrc,
    )
    if g.rank0:
        logger.info(
            "loaded %s checkpoint %s (%s; loaded at pp=%d dp=%d tp=%d stage %d); it holds no RNG states: this run's "
            "are kept",
            what,
            path,
            ck.describe(),
            g.pp,
            g.dp,
            g.tp,
            opt.stage,
        )
    return path, ck.client_state()


__all__ = ["ExpertPieces", "Pieces", "apply", "every_expert", "load_source", "plan", "shown"]
