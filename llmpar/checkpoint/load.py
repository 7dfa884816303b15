"""``load_checkpoint(engine, load_dir, tag)``: fill the engine's (possibly different) layout from a saved one.

Each rank plans what it needs (by param name and element range, from the saved ``metadata.json``), checks the sha256
of exactly the files it will read, and the ranks agree on the outcome before anything is modified: a missing or
corrupt file is an error naming that file on every rank. Then:

    stages 0-2: every rank fills its whole param buffer (the params are whole on every rank) and its own partition of
                master / moments / kahan compensation;
    stage 3:    its own param shard, master and moments; then the persistent gathered units are re-gathered.

A state the saved mode did not have is derived: ``master`` from the params, ``kahan_comp`` zero. Step counts, the
scheduler, engine counters, param-group hyper-parameters and this rank's RNG states (when the saved run had a rank
with the same dp and tp rank) are restored. dp degree, ZeRO stage and offload may differ from the saved run; tp may not.
"""
from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.save import grid, wait_checkpoint
from llmpar.checkpoint.shards import STATE_FALLBACK, ShardReader, set_rng_state

logger = logging.getLogger("llmpar")


def _plan(engine: Any, path: str, meta: dict, tp: int, tp_rank: int, dp_rank: int) -> tuple[ShardReader, set[str]]:
    """The reader and the set of files this rank will read; raises on a layout that cannot be loaded."""
    if meta["tp"] != tp:
        raise CheckpointError(f"checkpoint {path} was saved at tp={meta['tp']} and this run has tp={tp}: "
                              f"tensor-parallel resharding is not supported yet")
    reader = ShardReader(path, meta, tp_rank)
    opt = engine.optimizer
    rank = opt.rank if opt.stage > 0 else 0
    need: set[str] = set()
    missing = []
    for b in opt.buffers:
        for i in range(len(b.params)):
            slot = b.layout.slot(i)
            if slot.name not in reader.where:
                missing.append(slot.name)
                continue
            saved = tuple(reader.where[slot.name][1]["shape"])
            if saved != slot.shape:
                raise CheckpointError(f"param {slot.name!r} has shape {slot.shape} here but {saved} in {path}")
        for u in range(len(b.layout.units)):
            if b.shard is None:  # whole params needed (stages 0-2)
                for i in b.layout.units[u].params:
                    name = b.layout.slot(i).name
                    if name in reader.where:
                        need |= reader.files_for(name, 0, b.layout.slot(i).numel)
            else:
                for i, a, z, _ in b.layout.param_slices(u, rank):
                    name = b.layout.slot(i).name
                    if name in reader.where:
                        need |= reader.files_for(name, a, z)
        for key in b.state:
            if key not in STATE_FALLBACK and any(not reader.has(b.layout.slot(i).name, key)
                                                 for i in range(len(b.params)) if b.layout.slot(i).name
                                                 in reader.where):
                raise CheckpointError(f"{path} has no {key!r} state for buffer of mode {b.mode!r}: saved modes "
                                      f"{[x['mode'] for x in meta['layout']['buffers']]}")
    if missing:
        raise CheckpointError(f"{len(missing)} params of this model are not in {path}: {missing[:5]}")
    own = files.rank_file(dp_rank, tp_rank)
    if own in meta["files"]:
        need.add(own)
    need.add(files.rank_file(0, tp_rank))  # extras (module buffers, frozen params)
    if files.CLIENT_STATE in meta["files"]:
        need.add(files.CLIENT_STATE)
    return reader, need


@torch.no_grad()
def _apply(engine: Any, reader: ShardReader) -> None:
    opt = engine.optimizer
    rank = opt.rank if opt.stage > 0 else 0
    for b in opt.buffers:
        lay = b.layout
        if b.shard is None:
            for i in range(len(b.params)):
                s = lay.slot(i)
                lay.param_view(b.flat, i).copy_(reader.get(s.name, "params", 0, s.numel).view(s.shape))
        for u in range(len(lay.units)):
            pieces = lay.param_slices(u, rank)
            if b.shard is not None:
                mine = lay.shard_of_partition(b.shard, u)
                for i, a, z, at in pieces:
                    mine[at:at + z - a].copy_(reader.get(lay.slot(i).name, "params", a, z))
            for key, t in b.state.items():
                mine = lay.shard_of_partition(t, u)
                for i, a, z, at in pieces:
                    name = lay.slot(i).name
                    if reader.has(name, key):
                        mine[at:at + z - a].copy_(reader.get(name, key, a, z))
                    elif STATE_FALLBACK[key] is None:
                        mine[at:at + z - a].zero_()
                    else:
                        mine[at:at + z - a].copy_(reader.get(name, STATE_FALLBACK[key], a, z))
            if lay.units[u].params:
                b.steps[u].fill_(reader.step(lay.slot(lay.units[u].params[0]).name))
    saved_extras = reader.extras()
    params = dict(engine.module.named_parameters())
    bufs = dict(engine.module.named_buffers())
    for name, value in saved_extras.items():
        dst = bufs.get(name, params.get(name))
        if dst is not None and dst.shape == value.shape:
            dst.copy_(value)
        else:
            logger.warning("load_checkpoint: %s in the checkpoint has no matching buffer here: skipped", name)


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None) -> tuple[str, dict | None]:
    """Load checkpoint ``load_dir/tag`` (default: the one ``load_dir/latest`` names) into ``engine``.
    Returns ``(path, client_state)``. Collective over the engine's dp and tp groups. A pending async save of this
    engine is published first."""
    wait_checkpoint(engine)
    groups, dp_rank, dp, tp_rank, tp, device = grid(engine)
    err, path, reader, meta = None, str(load_dir), None, None
    code = 0
    try:
        _, path = files.resolve(load_dir, tag)
        meta = files.read_metadata(path)
        reader, need = _plan(engine, path, meta, tp, tp_rank, dp_rank)
        names = sorted(meta["files"])
        for fname in sorted(need):
            why = files.check_file(path, fname, meta["files"][fname])
            if why is not None:
                code = 2 + 2 * names.index(fname) + (why == "corrupt")
                break
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
        err = f"{e}" if isinstance(e, (CheckpointError, ValueError, TypeError)) else repr(e)
        logger.debug("load_checkpoint: %s", traceback.format_exc())
        code = 1
    code = files.agree(code, groups, device)
    if code >= 2 and meta is not None:
        fname = sorted(meta["files"])[(code - 2) // 2]
        why = "is corrupt (sha256 or size differs from metadata.json)" if (code - 2) % 2 else "is missing"
        raise CheckpointError(f"checkpoint shard {os.path.join(path, fname)} {why}")
    if code:
        raise CheckpointError(err or f"another rank failed to load checkpoint {path} (see its error)")
    assert reader is not None and meta is not None

    opt = engine.optimizer
    try:
        _apply(engine, reader)
        err = None
    except Exception as e:  # noqa: BLE001 - agreed before the stage-3 re-gather so that no rank waits alone
        err = f"loading {path} failed part-way, the engine's state is mixed: {e!r}"
        logger.error("%s\n%s", err, traceback.format_exc())
    if files.agree(1 if err else 0, groups, device):
        raise CheckpointError(err or f"another rank failed part-way loading {path}; the engine's state is mixed")
    if opt.stage3 is not None:
        opt.stage3.regather_persistent()
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    for k, v in meta["engine"].items():
        setattr(engine, k, v)
    opt.skipped_steps = meta["optimizer"]["skipped_steps"]
    opt.last_grad_norm = meta["optimizer"]["last_grad_norm"]
    if engine.lr_scheduler is not None and meta["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["scheduler"])
    own = files.rank_file(dp_rank, tp_rank)
    if own in meta["files"]:
        set_rng_state(reader._file_any(own)["rng"])
    else:
        logger.warning("load_checkpoint: the saved run had no rank dp=%d tp=%d: RNG states not restored", dp_rank,
                       tp_rank)
    client = None
    if files.CLIENT_STATE in meta["files"]:
        client = files.load_file(os.path.join(path, files.CLIENT_STATE), mmap=False)
    if dp_rank == 0 and tp_rank == 0:
        logger.info("loaded checkpoint %s (saved at dp=%d stage %d, loaded at dp=%d stage %d)", path, meta["dp"],
                    meta["stage"], dp, opt.stage)
    return path, client
