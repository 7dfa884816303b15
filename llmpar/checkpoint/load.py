"""``load_checkpoint(engine, load_dir, tag)``: fill the engine's (possibly different) layout from a saved one.

Each rank plans what it needs (by param name and element range, from the saved ``metadata.json``), checks the sha256
of exactly the files it will read, and the ranks agree on the outcome before anything is modified: a missing or
corrupt file is an error naming that file on every rank. Then:

    stages 0-2: every rank fills its whole param buffer (the params are whole on every rank) and its own partition of
                master / moments / kahan compensation;
    stage 3:    its own param shard, master and moments; then the persistent gathered units are re-gathered.

The engine and its optimizer are seen only through the checkpoint protocol (``protocol.py``): the plan asks the
optimizer which element ranges it will read (``checkpoint_reads``), the optimizer fills its own shards from a callback
(``load_pieces``) and derives a state the saved mode did not have (ZeRO: ``master`` from the params, ``kahan_comp``
zero). Step counts, the
scheduler, engine counters, param-group hyper-parameters and this rank's RNG states (when the saved run had a rank
with the same pp, dp and tp rank) are restored. dp degree, ZeRO stage and offload may differ from the saved run, and
so may tp (``reshard.py``: each split param and its optimizer states are rebuilt along the split dim from the saved
tp ranks' shards whose chunks overlap this rank's, padding dropped and re-added) and pp (params are named as in the
unsplit model, ``view.py``: a pp=2 pipeline checkpoint loads into a plain engine and the other way round). A param
whose full shape or split dim differs raises a CheckpointError naming it, on every rank.
"""
from __future__ import annotations

import logging
import os
import traceback

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.protocol import Checkpointable, Grid
from llmpar.checkpoint.reshard import CheckpointReader, Cut
from llmpar.checkpoint.save import wait_checkpoint
from llmpar.checkpoint.shards import set_rng_state
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")


def _cuts(view: EngineView) -> dict[str, Cut]:
    """{optimizer param name: how this rank holds it}."""
    specs, g = view.specs(), view.grid
    return {name: Cut(shape=shape, spec=specs[name], tp=g.tp, rank=g.tp_rank) for name, shape in view.shapes().items()}


def _plan(view: EngineView, path: str, meta: dict) -> tuple[CheckpointReader, dict[str, Cut], set[str]]:
    """The reader, this rank's cuts and the set of files it will read; raises on a layout that cannot be loaded."""
    reader = CheckpointReader(path, meta)
    g, cuts = view.grid, _cuts(view)
    need: set[str] = set()
    missing = []
    for b, required in zip(view.layout, view.opt.checkpoint_required()):
        present = []
        for slot in b["params"]:
            name = view.saved_name[slot["name"]]
            if name not in reader.where:
                missing.append(name)
                continue
            reader.check(name, cuts[slot["name"]])
            present.append(name)
        for key in required:
            if any(not reader.has(name, key) for name in present):
                raise CheckpointError(f"{path} has no {key!r} state for buffer of mode {b['mode']!r}: saved modes "
                                      f"{sorted({x['mode'] for x in meta['layout']['buffers']})}")
    if missing:
        raise CheckpointError(f"{len(missing)} params of this model are not in {path}: {missing[:5]}")
    for local, a, z in view.opt.checkpoint_reads():
        need |= reader.files_for(view.saved_name[local], a, z, cuts[local])
    own = _own_file(g, meta)
    if own in meta["files"]:
        need.add(own)
    wanted = set(view.targets())
    need |= {f for n, f in reader.extras_files(g.tp, g.tp_rank).items() if n == "*" or n in wanted}
    if files.CLIENT_STATE in meta["files"]:
        need.add(files.CLIENT_STATE)
    return reader, cuts, need


def _own_file(g: Grid, meta: dict) -> str:
    """This rank's file in the saved run, if it had a rank at the same place (its RNG states)."""
    return files.rank_file(g.dp_rank, g.tp_rank, g.pp_rank, int(meta.get("pp", 1)))


@torch.no_grad()
def _apply(view: EngineView, reader: CheckpointReader, cuts: dict[str, Cut]) -> None:
    """This rank's params, optimizer states and steps (through ``load_pieces``), module buffers and frozen params."""
    opt, g = view.opt, view.grid

    def get(local: str, key: str, a: int, z: int) -> torch.Tensor | None:
        name = view.saved_name[local]
        return reader.get(name, key, a, z, cuts[local]) if reader.has(name, key) else None

    def step(local: str) -> float:
        return reader.step(view.saved_name[local])

    opt.load_pieces(get, step)
    targets, frozen, to_shards = view.targets(), opt.frozen_shapes(), {}
    for name, value in reader.extras(g.tp, g.tp_rank, set(targets)).items():
        dst = targets[name][0]
        shape = frozen.get(name, tuple(dst.shape))
        if tuple(value.shape) != tuple(shape):
            logger.warning("load_checkpoint: %s has shape %s in the checkpoint and %s here: skipped", name,
                           tuple(value.shape), tuple(shape))
        elif name in frozen:  # a ZeRO-3 frozen param: into this rank's shard of it
            to_shards[name] = value
        else:
            dst.copy_(value)
    if to_shards:
        opt.load_frozen(to_shards)


def load_checkpoint(engine: Checkpointable, load_dir: str, tag: str | None = None) -> tuple[str, dict | None]:
    """Load checkpoint ``load_dir/tag`` (default: the one ``load_dir/latest`` names) into ``engine``.
    Returns ``(path, client_state)``. Collective over the engine's dp, tp (and pp) groups. A pending async save of this
    engine is published first."""
    wait_checkpoint(engine)
    view = EngineView(engine)
    g = view.grid
    err, path, reader, meta = None, str(load_dir), None, None
    cuts: dict[str, Cut] = {}
    code = 0
    try:
        _, path = files.resolve(load_dir, tag)
        meta = files.read_metadata(path)
        reader, cuts, need = _plan(view, path, meta)
        names = sorted(meta["files"])
        for fname in sorted(need):
            why = files.check_file(path, fname, meta["files"][fname]) if fname in meta["files"] else "missing"
            if why is not None:
                code = 2 + 2 * (names.index(fname) if fname in names else len(names)) + (why == "corrupt")
                break
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
        err = f"{e}" if isinstance(e, (CheckpointError, ValueError, TypeError)) else repr(e)
        logger.debug("load_checkpoint: %s", traceback.format_exc())
        code = 1
    code = files.agree(code, g.groups, g.device)
    if code >= 2 and meta is not None:
        i = (code - 2) // 2
        fname = sorted(meta["files"])[i] if i < len(meta["files"]) else "a file metadata.json does not list"
        why = "is corrupt (sha256 or size differs from metadata.json)" if (code - 2) % 2 else "is missing"
        raise CheckpointError(f"checkpoint shard {os.path.join(path, fname)} {why}")
    if code:
        raise CheckpointError(err or f"another rank failed to load checkpoint {path} (see its error)")
    assert reader is not None and meta is not None

    opt = engine.optimizer
    try:
        _apply(view, reader, cuts)
        err = None
    except Exception as e:  # noqa: BLE001 - agreed before the stage-3 re-gather so that no rank waits alone
        err = f"loading {path} failed part-way, the engine's state is mixed: {e!r}"
        logger.error("%s\n%s", err, traceback.format_exc())
    if files.agree(1 if err else 0, g.groups, g.device):
        raise CheckpointError(err or f"another rank failed part-way loading {path}; the engine's state is mixed")
    opt.after_load()
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    engine.restore_counters(meta["engine"])
    opt.skipped_steps = meta["optimizer"]["skipped_steps"]
    opt.last_grad_norm = meta["optimizer"]["last_grad_norm"]
    if engine.lr_scheduler is not None and meta["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["scheduler"])
    own = _own_file(g, meta)
    if own in meta["files"]:
        set_rng_state(reader.rank_file(own)["rng"])
    else:
        logger.warning("load_checkpoint: the saved run had no rank pp=%d dp=%d tp=%d: RNG states not restored",
                       g.pp_rank, g.dp_rank, g.tp_rank)
    client = None
    if files.CLIENT_STATE in meta["files"]:
        client = files.load_file(os.path.join(path, files.CLIENT_STATE), mmap=False)
    if g.rank0:
        logger.info("loaded checkpoint %s (saved at pp=%d dp=%d tp=%d stage %d, loaded at pp=%d dp=%d tp=%d stage %d)",
                    path, meta.get("pp", 1), meta["dp"], meta["tp"], meta["stage"], g.pp, g.dp, g.tp, opt.stage)
    return path, client
