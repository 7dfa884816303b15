"""Experts of an expert-parallel engine in llmpar's checkpoints: saved under their global index, loaded at any ep.

An engine whose MoE layers are spread over ``ep`` ranks holds on ep rank ``r`` the rows ``[r E_local, (r + 1)
E_local)`` of each packed expert tensor (``gate_up_proj: [E, 2I, H]``, ``down_proj: [E, H, I]``), whose optimizer
(``opt.experts``, a ZeroOptimizer over the expert-data-parallel ranks) shards them over ``edp``. Those rows are the
contiguous element range ``[r E_local R, (r + 1) E_local R)`` of the global tensor's flat view (``R``: elements per
expert), so every piece a rank holds is written under the *global* name and the *global* element range: the same
``(name, start, stop)`` pieces the rest of the format is made of. Chosen over per-expert entries because nothing has
to be cut per expert: a load at another ep, edp or ZeRO stage asks element ranges of the global tensor and gets
them from whichever saved pieces overlap (any layout to any other), and the global tensor is the one an ep=1 run
saves in its dense buffers and the one HuggingFace's packed layout holds (``consolidate`` writes it as it is).

    save    each rank's file gains ``"experts": {"ep", "ep_rank", "params": [{"name", "shape", "group"}],
            "buffers": [{"pieces": [[name, start, stop, at, unit]], "steps": [units], "params": [partition],
            "exp_avg": ...}]}`` (``"group"``: the dense param group whose hyper-parameters the param's expert group
            follows; the buffers: its partition of the expert optimizer's buffers, fp32 master, moments, low-bit
            moments dequantized as the dense ones), and its entry in ``metadata.json``'s ``"files"`` an
            ``"experts"`` mark; a stage-0 rank other than edp rank 0 writes the names and no shards
    read    :class:`ExpertIndex`: the pieces of every marked file, by global name (``reshard.CheckpointReader``
            serves them beside the dense params: an ep=1 engine, ``consolidate`` and the converters see whole
            tensors)
    load    :class:`ExpertLoad`: this rank's expert optimizer filled through ``load_pieces`` from the global ranges
            of its rows; a saved expert count that ``ep`` does not divide, or that differs from the model's, is a
            ``CheckpointError`` naming the param on every rank before anything is modified

A param holding *one* expert (DeepSpeed's legacy layer, ``llmpar.moe.layer.MoE``: a module per expert, named
``...deepspeed_experts.<i>.*``, tagged ``expert_index = (list name, i, experts per rank)`` where it is) is not rows
of a packed tensor: local expert ``i`` of ep rank ``r`` with ``n`` experts per rank is written whole under its global
name ``...deepspeed_experts.<r n + i>.*`` (the name an ep=1 model gives it), element offset 0, so it loads at any ep
as the packed ones do; its saved shape must equal the model's (a CheckpointError naming it otherwise). Such a
module's persistent buffers and frozen params are refused at ep > 1 (:func:`refuse_expert_state`): module state
outside the optimizer is written from dp rank 0 under its local names.

Experts split over an etp group too (``MoEBlock(etp_group=...)``): written as shards, read whole (``expert_tp.py``).

The optimizer shows its experts through ``checkpoint_experts()`` (``protocol.HoldsExperts``): the expert optimizer
(itself a ``CheckpointOptimizer``), this rank's ep rank and ``ep``.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import torch

from llmpar.checkpoint import expert_tp as etp_io
from llmpar.checkpoint.blockfile import elements
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.protocol import Checkpointable, CheckpointOptimizer, HoldsExperts
from llmpar.checkpoint.shards import RankFiles, local_buffers

KEY = "experts"


def expert_side(opt: Any) -> tuple[CheckpointOptimizer, int, int] | None:
    """``(expert optimizer, ep rank, ep)`` of ``opt``, None when it holds no experts spread over ranks."""
    if not isinstance(opt, HoldsExperts):
        return None
    return opt.checkpoint_experts()


def _rows(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


class Where(NamedTuple):
    """Where an expert optimizer param sits in the checkpoint."""

    name: str  # the global checkpoint name
    shape: tuple[int, ...]  # the global tensor's shape
    offset: int  # element offset of this rank's part in the global tensor's flat view
    packed: bool  # rows of a packed [E, ...] tensor (False: one expert's whole tensor)
    every: tuple[str, ...] = ()  # one expert: its names at every ep rank (the same local index), in ep rank order
    etp: tuple[str, int, int] | None = None  # split over etp too: (layout, etp rank, etp) (``expert_tp.py``)


LIST = "deepspeed_experts"  # the ModuleList of DeepSpeed's legacy layer, when a param carries no expert_index tag


def one_expert(name: str, p: Any) -> tuple[str, int, str, int | None] | None:
    """``(name up to the expert's index, local index, rest of the name, experts per rank or None)`` of a param
    holding one expert (module docstring); None for a packed one."""
    index = getattr(p, "expert_index", None)
    seg = str(index[0]) if index is not None else LIST
    m = re.match(rf"^((?:.*\.)?{re.escape(seg)}\.)(\d+)(\..+)$", name)
    if m is None:
        return None
    return m.group(1), int(m.group(2)), m.group(3), int(index[2]) if index is not None else None


def refuse_expert_state(engine: Checkpointable, xopt: CheckpointOptimizer, ep: int, what: str) -> None:
    """A CheckpointError naming the persistent buffers and frozen params of one-expert modules spread over ep > 1
    ranks: module state outside the optimizer is written from dp rank 0 under its local names, so the experts of the
    other ep ranks would be lost and take ep rank 0's on load. Raised alike on every rank (the same modules)."""
    if ep == 1:
        return
    names = engine.checkpoint_names()
    lists = set()
    for buf in xopt.checkpoint_params():
        for n, p in buf:
            found = one_expert(names.get(n, n), p)
            if found is not None:
                lists.add(found[0])
    bad = sorted(
        n
        for n, (t, is_param) in engine.checkpoint_targets().items()
        if not (is_param and t.requires_grad)
        and any(n.startswith(pre) and n[len(pre) :].split(".")[0].isdigit() for pre in lists)
    )
    if bad:
        raise CheckpointError(
            f"{what}: {bad[:4]}{' ...' if len(bad) > 4 else ''} are buffers / frozen params of experts spread over "
            f"ep={ep} ranks (a module per expert): llmpar's checkpoints write module state outside the optimizer "
            "from dp rank 0 under its local names, so the other ep ranks' experts would lose theirs or take ep rank "
            "0's; refused (hold such state in trained params, or save and load at ep=1)"
        )


def placement(engine: Checkpointable, xopt: CheckpointOptimizer, ep_rank: int, ep: int) -> dict[str, Where]:
    """{expert optimizer name: where it sits in the checkpoint}: a packed param's rows at this rank's offset of the
    global tensor, a one-expert param whole under its global index."""
    names = engine.checkpoint_names()
    live = {n: p for buf in xopt.checkpoint_params() for n, p in buf}
    single = {}
    for b in xopt.checkpoint_layout():
        for slot in b["params"]:
            found = one_expert(names.get(slot["name"], slot["name"]), live.get(slot["name"]))
            if found is not None:
                single[slot["name"]] = found
    per_rank: dict[str, int] = {}  # list prefix -> experts per ep rank (counted where untagged)
    for prefix, i, _, n in single.values():
        per_rank[prefix] = max(per_rank.get(prefix, 0), n if n is not None else i + 1)
    etp_rank, etp = etp_io.etp_side(engine.optimizer)
    out = {}
    for b in xopt.checkpoint_layout():
        for slot in b["params"]:
            shape = tuple(int(s) for s in slot["shape"])
            layout = etp_io.layout_of(live.get(slot["name"])) if etp > 1 else None
            if slot["name"] in single:
                prefix, i, rest, _ = single[slot["name"]]
                every = tuple(f"{prefix}{r * per_rank[prefix] + i}{rest}" for r in range(ep))
                out[slot["name"]] = Where(every[ep_rank], shape, 0, False, every)
                continue
            out[slot["name"]] = Where(
                names.get(slot["name"], slot["name"]),
                (shape[0] * ep, *shape[1:]) if layout is None else etp_io.whole_shape(shape, layout, ep, etp),
                ep_rank * shape[0] * _rows(shape),
                True,
                etp=None if layout is None else (layout, etp_rank, etp),
            )
    return out


def snapshot(engine: Checkpointable, *, copy: bool) -> tuple[dict | None, dict | None]:
    """(this rank file's ``"experts"`` part, its mark for ``metadata.json``), or (None, None) without experts.
    ``copy``: fresh CPU tensors (an async save), else views of the live shards."""
    side = expert_side(engine.optimizer)
    if side is None:
        return None, None
    xopt, ep_rank, ep = side
    refuse_expert_state(engine, xopt, ep, "save_checkpoint")
    xopt.prepare_save()
    where = placement(engine, xopt, ep_rank, ep)
    units = {s["name"]: int(s["unit"]) for b in xopt.checkpoint_layout() for s in b["params"]}
    bufs = None if etp_io.replica(engine, xopt) else local_buffers(xopt, copy=copy)
    out_bufs = []
    for entry, held in zip(bufs or [], xopt.checkpoint_held()):
        pieces = []
        for name, a, z, at in held:
            w = where[name]
            gname = w.name if w.etp is None else etp_io.shard_name(w.name, w.etp[1])
            pieces.append([gname, a + w.offset, z + w.offset, at, units[name]])
        out_bufs.append({**entry, "pieces": pieces})
    owner = list(getattr(engine.optimizer, "expert_group_owner", ()))  # expert group -> its dense group
    group = {
        s["name"]: owner[b["group"]] if b.get("group", 0) < len(owner) else int(b.get("group", 0))
        for b in xopt.checkpoint_layout()
        for s in b["params"]
    }
    params = [{"name": w.name, "shape": list(w.shape), "group": group[n]} for n, w in where.items()]
    for p, w in zip(params, where.values()):
        if w.etp is not None:
            p["etp"] = {"size": w.etp[2], "layout": w.etp[0]}
    part = {"ep": ep, "ep_rank": ep_rank, "params": params, "buffers": out_bufs}
    mark = {"ep": ep, "ep_rank": ep_rank, "has_shards": bufs is not None, "params": [p["name"] for p in params]}
    return part, mark


class ExpertIndex:
    """The expert pieces of a checkpoint's rank files, by global name (module docstring)."""

    def __init__(self, files: RankFiles, meta: dict) -> None:
        self.files = files
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.saved_ep: dict[str, int] = {}
        self.group: dict[str, int] = {}  # the dense param group whose hyper-parameters the expert follows
        # global name -> [(start, stop, file, buffer index, at, unit)], sorted by start
        self.pieces: dict[str, list[tuple[int, int, str, int, int, int]]] = {}
        self.etp: dict[str, tuple[int, str]] = {}  # global name -> (etp, layout) of a param saved as etp shards
        self._whole = etp_io.WholeCache()
        self.marked = sorted(f for f, e in meta.get("files", {}).items() if isinstance(e, dict) and KEY in e)

    def open(self) -> None:
        """Read the marked files' indexes (a missing or corrupt file raises, as any rank file read)."""
        for fname in self.marked:
            part = self.files.tree(fname)[KEY]
            for p in part["params"]:
                self.shapes[p["name"]] = tuple(int(s) for s in p["shape"])
                self.saved_ep[p["name"]] = int(part["ep"])
                self.group[p["name"]] = int(p.get("group", 0))
                if "etp" in p:
                    self.etp[p["name"]] = (int(p["etp"]["size"]), str(p["etp"]["layout"]))
            for bi, b in enumerate(part["buffers"]):
                for name, a, z, at, unit in b["pieces"]:
                    self.pieces.setdefault(name, []).append((int(a), int(z), fname, bi, int(at), int(unit)))
        for v in self.pieces.values():
            v.sort()

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def _buffer(self, fname: str, bi: int) -> dict:
        return self.files.tree(fname)[KEY]["buffers"][bi]

    def _overlap(self, name: str, a: int, z: int) -> list[tuple[int, int, str, int, int, int]]:
        return [p for p in self.pieces.get(name, []) if p[0] < z and p[1] > a]

    def _all(self, name: str) -> list[tuple[int, int, str, int, int, int]]:  # of each etp shard, if split
        if name not in self.etp:
            return self.pieces.get(name, [])
        return [p for t in range(self.etp[name][0]) for p in self.pieces.get(etp_io.shard_name(name, t), [])]

    def has(self, name: str, key: str) -> bool:
        pieces = self._all(name)
        return bool(pieces) and all(key in self._buffer(f, bi) for _, _, f, bi, _, _ in pieces)

    def keys(self, name: str) -> list[str]:
        """The state keys every piece of ``name`` holds ("params", "exp_avg", ...)."""
        bufs = [self._buffer(f, bi) for _, _, f, bi, _, _ in self._all(name)]
        common = set.intersection(*(set(b) for b in bufs)) if bufs else set()
        return sorted(common - {"pieces", "steps", "holes"})

    def files_for(self, name: str, a: int, z: int) -> set[str]:
        if name in self.etp:  # the whole tensor is merged from every shard
            return {p[2] for p in self._all(name)}
        return {p[2] for p in self._overlap(name, a, z)}

    def get(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of the global tensor ``name``'s state ``key``, flat, from the pieces overlapping
        (a param saved as etp shards: of the whole tensor merged from them)."""
        if name in self.etp:
            etp, layout = self.etp[name]

            def build() -> torch.Tensor:
                read = lambda t, n: self._range(etp_io.shard_name(name, t), key, 0, n)  # noqa: E731
                return etp_io.merged(read, self.shapes[name], layout, etp).reshape(-1)

            return self._whole.get((name, key), build)[a:z]
        return self._range(name, key, a, z)

    def _range(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        parts, at_ = [], a
        for s, e, fname, bi, at, _ in self._overlap(name, a, z):
            lo, hi = max(s, at_), min(e, z)
            if hi <= lo:  # covered already: the same rows written by each tp rank (experts whole over tp)
                continue
            if lo != at_:
                break
            parts.append(elements(self._buffer(fname, bi)[key], at + lo - s, at + hi - s))
            at_ = hi
        if at_ != z:
            raise CheckpointError(
                f"{self.files.path}: elements [{at_}, {z}) of expert param {name!r} ({key}) are in no rank file"
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def step(self, name: str) -> float:
        """The step count saved with the first piece of ``name``."""
        _, _, fname, bi, _, unit = self._all(name)[0]
        return float(elements(self._buffer(fname, bi)["steps"], unit, unit + 1)[0])


class ExpertLoad:
    """Loading this rank's expert optimizer from ``reader`` (a ``reshard.CheckpointReader``, which serves expert
    pieces and dense-saved params alike by global name): checked at construction, read by :meth:`touch` while the
    reads are recorded, written by :meth:`apply`."""

    def __init__(self, engine: Checkpointable, reader: Any, strict: bool) -> None:
        side = expert_side(engine.optimizer)
        assert side is not None
        self.xopt, self.ep_rank, self.ep = side
        refuse_expert_state(engine, self.xopt, self.ep, "load_checkpoint")
        self.reader, self.tp = reader, engine.checkpoint_grid()
        self.where = placement(engine, self.xopt, self.ep_rank, self.ep)
        self._shards = etp_io.WholeCache()  # an etp rank's shard of its ep rank's whole rows, by (name, key)
        self.missing: set[str] = set()
        for local, w in self.where.items():
            gname, shape, packed = w.name, w.shape, w.packed
            if not reader.holds(gname):
                self.missing.add(local)
                continue
            saved = reader.full_shape(gname)
            if not packed:  # one expert, whole
                if tuple(saved) != shape:
                    raise CheckpointError(
                        f"{reader.path}: expert param {gname!r} has shape {tuple(saved)} in the checkpoint but "
                        f"{shape} in this model"
                    )
                continue
            if saved[0] % self.ep:
                raise CheckpointError(
                    f"{reader.path}: {gname!r} holds {saved[0]} experts, which do not split over ep={self.ep} "
                    f"expert-parallel ranks (num_experts must be divisible by ep): load it at an ep dividing "
                    f"{saved[0]}"
                )
            if tuple(saved) != shape:
                raise CheckpointError(
                    f"{reader.path}: {gname!r} has shape {tuple(saved)} ({saved[0]} experts) in the checkpoint but "
                    f"{shape} ({shape[0]} experts) in this model"
                )
        for b, required in zip(self.xopt.checkpoint_layout(), self.xopt.checkpoint_required()):
            for key in required:
                for slot in b["params"]:
                    gname = self.where[slot["name"]].name
                    if slot["name"] not in self.missing and not reader.has(gname, key):
                        raise CheckpointError(f"{reader.path} has no {key!r} state for expert param {gname!r}")
        if self.missing and strict:
            names = sorted(self.where[n].name for n in self.missing)
            raise CheckpointError(
                f"{len(names)} expert params of this model are not in {reader.path}: {names[:8]} "
                "(load_checkpoint(..., strict=False) keeps their current values)"
            )

    def _cut(self, gname: str) -> Any:
        return self.reader.unsplit(gname, self.tp.tp, self.tp.tp_rank)

    def _rows(self, w: Where) -> tuple[int, int]:
        """The global element range of this ep rank's whole experts of a param split over etp."""
        n = w.shape[0] // self.ep * _rows(w.shape)
        return self.ep_rank * n, (self.ep_rank + 1) * n

    def files(self) -> set[str]:
        out: set[str] = set()
        for local, a, z in self.xopt.checkpoint_reads():
            if local not in self.missing:
                w = self.where[local]  # split over etp: the files of the ep rank's whole experts
                span = self._rows(w) if w.etp is not None else (a + w.offset, z + w.offset)
                out |= self.reader.files_for(w.name, *span, self._cut(w.name))
        return out

    def get(self, local: str, key: str, a: int, z: int) -> torch.Tensor | None:
        w = self.where[local]
        if not self.reader.has(w.name, key):
            return None
        if (spec := w.etp) is not None:  # this etp rank's shard of the ep rank's whole experts (``expert_tp.py``)

            def build() -> torch.Tensor:
                rows = self.reader.get(w.name, key, *self._rows(w), self._cut(w.name))
                return etp_io.cut(rows.view(w.shape[0] // self.ep, *w.shape[1:]), *spec)

            return self._shards.get((local, key), build)[a:z]
        return self.reader.get(w.name, key, a + w.offset, z + w.offset, self._cut(w.name))

    def touch(self) -> None:
        """Read what :meth:`apply` reads (the reader records the blocks; nothing is kept)."""
        keys = {k for b in self.xopt.checkpoint_layout() for k in b["state_keys"]}
        for local, a, z in self.xopt.checkpoint_reads():
            if local not in self.missing:
                for key in keys:
                    self.get(local, key, a, z)

    def names(self) -> set[str]:
        """The checkpoint names of this rank's experts (a one-expert param's global name, not its module's)."""
        return {w.name for w in self.where.values()}

    def apply(self) -> None:
        """Fill the expert optimizer (not collective; ``after_load`` follows on every rank)."""

        def step(local: str) -> float:
            return self.reader.step(self.where[local].name)

        if self.missing:
            self.xopt.load_pieces(self.get, step, keep=frozenset(self.missing))
        else:
            self.xopt.load_pieces(self.get, step)


__all__ = [
    "ExpertIndex",
    "ExpertLoad",
    "Where",
    "expert_side",
    "one_expert",
    "placement",
    "refuse_expert_state",
    "snapshot",
]
