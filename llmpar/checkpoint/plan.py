"""What one rank reads of an llmpar checkpoint, planned and checked before anything of the engine is modified
(``load.py`` runs the steps; its docstring tells the whole load):

    plan          the reader, this rank's cuts (``reshard.Cut``), the files it will read, the params it keeps
    touch_reads   every range the load will read, read once while the blocks it touches are recorded
    hash_shared   the ranks split the hashing of the blocks they recorded (collective), each block hashed once
    saved_extras  the saved module buffers and frozen params this rank takes
    apply         this rank's params, optimizer states and steps (``load_pieces``), buffers and frozen params
"""

from __future__ import annotations

import logging

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.blockfile import CorruptFile
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.protocol import Checkpointable, DescribesModel, Grid
from llmpar.checkpoint.reshard import CheckpointReader, Cut
from llmpar.checkpoint.shards import RankFiles, extras_names
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")


def rank_cuts(view: EngineView) -> dict[str, Cut]:
    """{optimizer param name: how this rank holds it}."""
    specs, g = view.specs(), view.grid
    return {name: Cut(shape=shape, spec=specs[name], tp=g.tp, rank=g.tp_rank) for name, shape in view.shapes().items()}


def shown(names: list[str], limit: int = 8) -> str:
    return f"{sorted(names)[:limit]}" + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plan(
    view: EngineView, path: str, meta: dict, strict: bool, reader: CheckpointReader | None = None
) -> tuple[CheckpointReader, dict[str, Cut], set[str], set[str]]:
    """The reader (``reader``, or a new one), this rank's cuts, the set of files it will read and the optimizer names
    of this rank's params the checkpoint lacks (kept as they are; an error when ``strict``); raises on a layout that
    cannot be loaded."""
    reader = CheckpointReader(path, meta) if reader is None else reader
    g, cuts = view.grid, rank_cuts(view)
    need: set[str] = set()
    missing: dict[str, str] = {}  # optimizer name -> checkpoint name
    for b, required in zip(view.layout, view.opt.checkpoint_required()):
        present = []
        for slot in b["params"]:
            name = view.saved_name[slot["name"]]
            if not reader.holds(name):
                missing[slot["name"]] = name
                continue
            reader.check(name, cuts[slot["name"]])
            present.append(name)
        for key in required:
            if any(not reader.has(name, key) for name in present):
                raise CheckpointError(
                    f"{path} has no {key!r} state for buffer of mode {b['mode']!r}: saved modes "
                    f"{sorted({x['mode'] for x in meta['layout']['buffers']})}"
                )
    note_state_precision(view, meta, path)
    lacking = sorted(set(missing.values()) | missing_extras(view, meta))
    if lacking and strict:
        raise CheckpointError(
            f"{len(lacking)} params / buffers of this model are not in {path}: {shown(lacking)} "
            f"(load_checkpoint(..., strict=False) keeps their current values)"
        )
    if lacking:
        logger.warning(
            "load_checkpoint(strict=False): %d params / buffers of this model are not in %s, they keep "
            "their current values: %s",
            len(lacking),
            path,
            shown(lacking),
        )
    for local, a, z in view.opt.checkpoint_reads():
        if local not in missing:
            need |= reader.files_for(view.saved_name[local], a, z, cuts[local])
    own = own_file(g, meta)
    if own in meta["files"]:
        need.add(own)
    wanted = set(view.targets())
    need |= {f for n, f in reader.extras_files(g.tp, g.tp_rank).items() if n == "*" or n in wanted}
    if files.CLIENT_STATE in meta["files"]:
        need.add(files.CLIENT_STATE)
    return reader, cuts, need, set(missing)


def note_state_precision(view: EngineView, meta: dict, path: str) -> None:
    """A load across state precisions works (the checkpoint holds float32 moments either way: 8- / 4-bit states are
    saved dequantized): said once, since a run keeping low-bit states re-quantizes them (exact at the saved blocks)."""
    saved = sorted({str(b.get("mode")) for b in meta["layout"]["buffers"]})
    here = sorted({str(b["mode"]) for b in view.layout})
    first = view.grid.dp_rank == view.grid.tp_rank == view.grid.pp_rank == 0
    if saved != here and {"int8", "int4"} & {*saved, *here} and first:
        logger.info(
            "load_checkpoint: %s was saved with optimizer states %s, this run keeps %s: the moments load as "
            "their float32 values%s",
            path,
            saved,
            here,
            ", re-quantized in this run's blocks" if {"int8", "int4"} & set(here) else "",
        )


def missing_extras(view: EngineView, meta: dict) -> set[str]:
    """Module buffers and frozen params of this rank that a save writes but the checkpoint lacks (unknown for a
    checkpoint that did not record the names of its extras)."""
    if "extras" not in meta:
        return set()
    trained = set(view.saved_name.values())
    frozen = set(view.opt.frozen_shapes())
    mine = set(extras_names(view.targets(), trained | frozen)) | frozen
    return mine - set(meta["extras"])


def stored_names(meta: dict) -> list[str]:
    """The params (tied copies once) and, when recorded, the module buffers and frozen params of a checkpoint."""
    try:
        params = {s["name"] for b in meta["layout"]["buffers"] for s in b["params"] if not s.get("dup")}
        for entry in meta["files"].values():  # an expert-parallel run's experts (``experts.py``)
            if isinstance(entry, dict) and isinstance(entry.get("experts"), dict):
                params |= set(entry["experts"].get("params", ()))
        return sorted(params | set(meta.get("extras", {})))
    except (KeyError, TypeError):  # a malformed layout: plan reports it
        return []


def unsaved(engine: Checkpointable) -> set[str]:
    """Module buffers the engine does not save (non-persistent ones): not unexpected in an older checkpoint."""
    return set(engine.checkpoint_model().get("unsaved_buffers", ())) if isinstance(engine, DescribesModel) else set()


def own_file(g: Grid, meta: dict) -> str:
    """This rank's file in the saved run, if it had a rank at the same place (its RNG states)."""
    return files.rank_file(g.dp_rank, g.tp_rank, g.pp_rank, int(meta.get("pp", 1)), fmt=int(meta.get("format", 1)))


def touch_reads(view: EngineView, reader: CheckpointReader, cuts: dict[str, Cut], keep: set[str]) -> None:
    """Read, copying nothing, what :func:`apply` will read (recorded: ``RankFiles.record``, then hashed by
    :func:`hash_shared`): the "params" of every range of ``checkpoint_reads``, the states in the ranges this rank
    holds (``checkpoint_held``). A block outside those is verified when read (an older checkpoint's files: checked
    whole)."""
    for local, a, z in view.opt.checkpoint_reads():
        if local not in keep:
            reader.verify(view.saved_name[local], "params", a, z, cuts[local])
    for desc, held in zip(view.layout, view.opt.checkpoint_held()):
        for local, a, z, _ in held:
            name = view.saved_name[local]
            if local in keep:
                continue
            for key in desc["state_keys"]:
                if key != "params" and reader.has(name, key):
                    reader.verify(name, key, a, z, cuts[local])


def hash_shared(rank_files: RankFiles | None, blank: RankFiles, meta: dict, g: Grid, code: int) -> int:
    """Collective over the grid: hash the blocks this rank read while recording (``rank_files``; None: it failed
    before) that the ranks' claims give it: a block wanted by several ranks is hashed once, by the rank that wrote
    the file when it is one of them (a same-layout load: each rank its own file), else by the lowest. Returns
    ``code``, or that of the corrupt file found. ``blank``: the same checkpoint, nothing opened (the claims' size)."""
    index, world = (g.pp_rank * g.dp + g.dp_rank) * g.tp + g.tp_rank, g.pp * g.dp * g.tp
    here = (g.pp_rank, g.dp_rank, g.tp_rank)

    def owns(name: str) -> bool:
        e = meta["files"][name]
        return (e.get("pp_rank", 0), e.get("dp_rank"), e.get("tp_rank")) == here

    claims = (rank_files or blank).claims(owns, index, world)
    if claims.numel() == 0:  # no block files (an older checkpoint): each file was checked whole
        return code
    top = files.agree_tensor(claims, g.groups, g.device)
    if rank_files is not None:
        try:
            rank_files.verify_mine(top, owns, index, world)
        except CorruptFile as e:
            return file_code(meta, e.name, "corrupt")
    return code


def file_code(meta: dict, fname: str, why: str) -> int:
    """The agreement code of rank file ``fname`` being ``why`` ("missing" / "corrupt"); decoded in
    :func:`load_checkpoint`."""
    names = sorted(meta["files"])
    return 2 + 2 * (names.index(fname) if fname in names else len(names)) + (why == "corrupt")


def saved_extras(view: EngineView, reader: CheckpointReader, strict: bool) -> dict[str, torch.Tensor]:
    """The saved module buffers and frozen params this rank takes; a shape that differs is an error (``strict``) or
    skipped with a warning."""
    g, targets, frozen = view.grid, view.targets(), view.opt.frozen_shapes()
    out, bad = {}, []
    for name, value in reader.extras(g.tp, g.tp_rank, set(targets)).items():
        shape = frozen.get(name, tuple(targets[name][0].shape))
        if tuple(value.shape) != tuple(shape):
            bad.append(f"{name!r} has shape {tuple(value.shape)} in the checkpoint and {tuple(shape)} here")
        else:
            out[name] = value
    if bad and strict:
        raise CheckpointError(f"{reader.path}: {'; '.join(bad[:8])} (strict=False skips them)")
    for b in bad:
        logger.warning("load_checkpoint(strict=False): %s: skipped", b)
    return out


@torch.no_grad()
def apply(
    view: EngineView, reader: CheckpointReader, cuts: dict[str, Cut], keep: set[str], extras: dict[str, torch.Tensor]
) -> None:
    """This rank's params, optimizer states and steps (through ``load_pieces``; the params in ``keep`` are not in
    the checkpoint and stay as they are), module buffers and frozen params."""
    opt = view.opt

    def get(local: str, key: str, a: int, z: int) -> torch.Tensor | None:
        name = view.saved_name[local]
        return reader.get(name, key, a, z, cuts[local]) if reader.has(name, key) else None

    def step(local: str) -> float:
        return reader.step(view.saved_name[local])

    if keep:
        opt.load_pieces(get, step, keep=frozenset(keep))
    else:
        opt.load_pieces(get, step)
    view.put_extras(extras)  # a ZeRO-3 frozen param: into this rank's shard of it


__all__ = [
    "apply",
    "file_code",
    "hash_shared",
    "own_file",
    "plan",
    "rank_cuts",
    "saved_extras",
    "shown",
    "stored_names",
    "touch_reads",
    "unsaved",
]
