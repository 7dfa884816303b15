"""``load_checkpoint`` of a DeepSpeed checkpoint (``deepspeed_read.py``) into an engine, through the checkpoint
protocol: the same named pieces as llmpar's own checkpoints, so any dp, ZeRO stage and tp load it.

Every rank opens the checkpoint (memory-mapped; each optimizer file when first read) and plans what it needs: each
param of this rank must be in the checkpoint with the same full shape (a tensor-parallel param is cut from the
full tensor along its split dim, padding re-added: ``reshard.py``'s rule), and each state its optimizer cannot
derive must be there; ``strict`` as in llmpar's load (a param or buffer the model has and the checkpoint lacks, or
one of the checkpoint no rank's model has, is an error naming it; False: kept / ignored, with a warning). The ranks
agree on the outcome before anything is modified. Then ``load_pieces`` fills this rank's params (from the fp32
masters), moments and step counts; module buffers and frozen params are copied; the param-group hyper-parameters,
engine counters (``global_steps``, ``global_samples``, ``skipped_steps``: what DeepSpeed restores), the fp16 loss
scaler and the LR scheduler follow, and the caller's client_state is returned. DeepSpeed saves no RNG states in these
files: this engine's stay as they are.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Callable

import torch

from llmpar.checkpoint import ds_check, files
from llmpar.checkpoint.deepspeed_read import DeepSpeedCheckpoint
from llmpar.checkpoint.ds_files import LAYER_RE, MODEL_RE, OPTIM_RE, detect, load_file
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.protocol import Checkpointable, DescribesModel
from llmpar.checkpoint.reshard import Cut, full_shape
from llmpar.checkpoint.shards import extras_names
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")

_HYPER = ("lr", "betas", "eps", "weight_decay")


def shown(names: list[str] | set[str], limit: int = 8, ck: DeepSpeedCheckpoint | None = None) -> str:
    """The first ``limit`` names, each with the file holding it in ``ck`` where it tells (a pipeline checkpoint)."""
    names = sorted(names)
    where = {n: ck.file_of(n) for n in names[:limit]} if ck is not None else {}
    shown = ", ".join(repr(n) + (f" ({where[n]})" if where.get(n) else "") for n in names[:limit])
    return f"[{shown}]" + (f" and {len(names) - limit} more" if len(names) > limit else "")


class Source:
    """The checkpoint's states cut for this rank: a replicated param's elements as saved, a tensor-parallel one's
    from its full tensor (one full tensor cached at a time)."""

    def __init__(self, ck: DeepSpeedCheckpoint, view: EngineView) -> None:
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


def plan(
    engine: Checkpointable, view: EngineView, ck: DeepSpeedCheckpoint, src: Source, strict: bool, sched: Any
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


def _needs_model(path: str) -> bool:
    """A checkpoint read with the loading model's names and full shapes: a tensor-parallel one (files of mp ranks >
    0, no layer files: ``ds_mp_read.py``) or a pipeline one saved without ZeRO, whose files name no params
    (``ds_pipe_names.py``)."""
    found = detect(path)
    if not any(LAYER_RE.match(f) for f in found):
        return any((m := MODEL_RE.match(f) or OPTIM_RE.match(f)) and int(m.groups()[-1]) > 0 for f in found)
    if "mp_rank_00_model_states.pt" not in found:
        return False
    try:
        m = load_file(os.path.join(path, "mp_rank_00_model_states.pt"))
    except CheckpointError:
        return False  # reported when the checkpoint opens
    return isinstance(m, dict) and m.get("module") is None and not isinstance(m.get("param_shapes"), list)


def _model_names(view: EngineView) -> dict[str, tuple[list[int], bool]]:
    """Collective: {checkpoint name: (full shape, trained)} of the whole model, every rank's params joined."""
    specs, shapes = view.specs(), view.shapes()
    mine = {view.saved_name[n]: (list(full_shape(s, specs[n])), True) for n, s in shapes.items()}
    frozen = {n: tuple(t.shape) for n, (t, is_param) in view.targets().items() if is_param and n not in mine}
    mine.update({n: (list(s), False) for n, s in {**frozen, **view.opt.frozen_shapes()}.items()})
    out: dict[str, tuple[list[int], bool]] = {}
    for text in files.gather_text(json.dumps(mine), view.grid, limit=1 << 22):
        out.update({k: (v[0], v[1]) for k, v in json.loads(text or "{}").items()})
    return out


def apply(
    engine: Checkpointable,
    view: EngineView,
    path: str,
    ck: DeepSpeedCheckpoint,
    src: Source,
    keep: set[str] | None,
    extras: dict,
    *,
    strict: bool,
    sched: Any,
    where: str,
    show: Callable[[list[str]], str],
) -> None:
    """Collective: what a DeepSpeed-shaped checkpoint ``ck`` (this reader's, or the universal reader's) holds, put
    into ``engine`` once :func:`plan` agreed: refuse (``strict``) or ignore names in no rank's model, load the states
    (``keep``: the optimizer names to load, None: all), buffers and frozen params, hyper-parameters, counters and
    the scheduler."""
    g, opt = view.grid, engine.optimizer
    stored = sorted(set(ck.names) | set(ck.aliases) | set(ck.buffers()) | set(ck.frozen()))  # the same on every rank
    view.unexpected(stored, strict=strict, where=where, show=show)
    with files.all_or_mixed(g, path):
        step = lambda local: ck.step(view.saved_name[local])  # noqa: E731
        if keep:
            opt.load_pieces(src.get, step, keep=frozenset(keep))
        else:
            opt.load_pieces(src.get, step)
        view.put_extras(extras)
    opt.after_load()
    groups = ck.param_groups()
    if len(groups) == len(opt.param_groups):
        for group, saved in zip(opt.param_groups, groups):
            group.update({k: (tuple(saved[k]) if k == "betas" else saved[k]) for k in _HYPER if k in saved})
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


def load(
    engine: Checkpointable, view: EngineView, path: str, *, strict: bool, scheduler: bool
) -> tuple[str, dict | None]:
    """Load DeepSpeed checkpoint directory ``path`` into ``engine`` (collective over its grid; ``load.py``'s
    ``load_checkpoint`` calls it once the ranks agreed they read the same checkpoint). Returns ``(path,
    client_state)``."""
    g, opt = view.grid, engine.optimizer
    sched = engine.lr_scheduler if scheduler else None
    model = _model_names(view) if _needs_model(path) else None  # collective: every rank sees the same files
    with files.agreed(g, "load_checkpoint"):
        ck = DeepSpeedCheckpoint(path, model=model) if model is not None else DeepSpeedCheckpoint(path)
        ds_check.validate(ck)  # every file opened and checked against the others before anything changes
        src = Source(ck, view)
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
        where=f"DeepSpeed checkpoint {path} ({ck.describe()})",
        show=lambda names: shown(names, ck=ck),
    )
    if g.rank0:
        logger.info(
            "loaded DeepSpeed checkpoint %s (%s; loaded at pp=%d dp=%d tp=%d stage %d); "
            "DeepSpeed saves no RNG states: this run's are kept",
            path,
            ck.describe(),
            g.pp,
            g.dp,
            g.tp,
            opt.stage,
        )
    return path, ck.client_state()


__all__ = ["Source", "apply", "load", "plan", "shown"]
