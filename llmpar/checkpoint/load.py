"""``load_checkpoint(engine, load_dir, tag, strict)``: fill the engine's (possibly different) layout from a saved one.

Every rank checks a given tag (``files.check_tag``, before any collective), resolves it (``latest``, read exactly, when
None) and reads ``metadata.json`` (its digest and every field a load uses checked: ``metacheck.py``); the ranks agree
that they read the same checkpoint (the sha256 of its ``metadata.json``: different tags, or a ``latest`` that moved
between the ranks' reads, fail on every rank, naming each rank's choice). Each rank then plans what it needs (by
param name and element range), checks the files it will read (size and index sha256; a format 1-2 file's whole
sha256) and notes the blocks it will read (``blockfile.py``); the ranks split the hashing of those blocks (each block
wanted by several ranks is hashed once, by the rank that wrote the file when it is one of them: at the same layout
each rank hashes its own file) and agree on the outcome before anything is modified: a missing or corrupt file is an
error naming that file on every rank, and so is (``strict=True``) a param or buffer of the model that the checkpoint
lacks or one of the checkpoint that no rank's model has (``strict=False``: the model's keep their values, optimizer
states and steps; the checkpoint's are ignored; a warning names them). Then:

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
whose full shape or split dim differs raises a CheckpointError naming it, on every rank. A foreign checkpoint
(``formats.find``: DeepSpeed's files instead of ``metadata.json``, DeepSpeed's universal layout, ``zero/<param>/
fp32.pt``, found also through ``latest_universal``, or a ``torch.distributed.checkpoint`` directory) is loaded by its
format's loader (``formats.load``) once the ranks agreed on it: this module's one way into ``formats/``.
"""

from __future__ import annotations

import logging
import os
import traceback

import torch

from llmpar.checkpoint import experts, files, formats, metacheck, plan, publish
from llmpar.checkpoint.blockfile import CorruptFile
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.pending import wait_checkpoint
from llmpar.checkpoint.protocol import Checkpointable, Grid
from llmpar.checkpoint.reshard import CheckpointReader, Cut
from llmpar.checkpoint.shards import RankFiles, set_rng_state
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")


def _open(g: Grid, load_dir: str, tag: str | None, universal: bool = False) -> tuple[str, dict, formats.Located | None]:
    """Resolve and read the checkpoint on every rank, and agree that every rank reads the same one (collective):
    (its path, its ``metadata.json``, or {} and the foreign checkpoint found). ``universal``: it must be a universal
    checkpoint (DeepSpeed's ``checkpoint.load_universal``)."""
    err, path, meta, ident = None, str(load_dir), None, ""
    found = None
    try:
        found = formats.find(load_dir, tag)  # a foreign layout: universal, DCP, DeepSpeed's files
        if universal and (found is None or found.format != "universal"):
            where = os.path.join(str(load_dir), tag) if tag is not None else str(load_dir)
            raise CheckpointError(
                f'"checkpoint.load_universal"=true: {where} is not a universal checkpoint (no '
                "zero/ folder beside a model states file); convert it with ds_to_universal or "
                "`llmpar checkpoint convert --to universal`, or set load_universal to false"
            )
        if found is not None:
            path, meta, ident = found.path, {}, found.identity()
        else:
            _, path = files.resolve(load_dir, tag)
            meta = metacheck.read(path)  # its digest, then every field a load uses
            ident = metacheck.identity(path)
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
        err = f"{e}" if isinstance(e, (CheckpointError, ValueError, TypeError)) else repr(e)
        logger.debug("load_checkpoint: %s", traceback.format_exc())
    h = files.fingerprint(ident) if err is None else 0
    code, high, neg_low = files.agree_all([1 if err else 0, h, -h], g.groups, g.device)
    if code:
        raise CheckpointError(files.agreed_error(err, g))
    if high != -neg_low:
        chosen = files.gather_text(f"{path} (metadata.json sha256 {ident[:12]})", g)
        by: dict[str, list[str]] = {}
        for i, c in enumerate(chosen):
            by.setdefault(c, []).append(files.rank_name(g, i))
        raise CheckpointError(
            "the ranks would load different checkpoints, none was loaded: "
            + "; ".join(f"{', '.join(r)}: {c}" for c, r in by.items())
            + f" (tag={tag!r}: pass the same tag on every rank; "
            f"with tag=None every rank reads {os.path.join(str(load_dir), files.LATEST)}, which a save running at "
            f"the same time may move)"
        )
    assert meta is not None
    if g.rank0:
        for t in publish.unpublished(os.path.dirname(path)):
            logger.warning(
                "%s holds a complete save of tag %r that was never published (the run ended before its "
                "publish): `llmpar checkpoint publish %s %s` publishes it, the next save into %s deletes "
                "it",
                os.path.join(os.path.dirname(path), files.TMP_PREFIX + t),
                t,
                os.path.dirname(path),
                t,
                os.path.dirname(path),
            )
    return path, meta, found


def load_checkpoint(
    engine: Checkpointable,
    load_dir: str,
    tag: str | None = None,
    *,
    strict: bool = True,
    scheduler: bool = True,
    universal: bool = False,
) -> tuple[str, dict | None]:
    """Load checkpoint ``load_dir/tag`` (default: the one ``load_dir/latest`` names, read exactly) into ``engine``.
    Returns ``(path, client_state)``. Collective over the engine's dp, tp (and pp) groups. A ``tag`` that is not a
    plain directory name (``files.check_tag``) is a ValueError naming it, raised by each rank before any collective.
    A pending async save of this engine is published first. ``metadata.json`` is checked whole (``metacheck``: a
    malformed field is an error naming it and the file) before anything of the engine is modified. ``strict``: a param
    or buffer of the model the checkpoint lacks, or one of the checkpoint no rank's model has, is an error naming it
    (False: the model's keep their values, the checkpoint's are ignored, with a warning). ``scheduler=False``: the
    engine's LR scheduler is neither checked against the saved one nor loaded. ``universal=True``: ``load_dir/tag``
    must be a DeepSpeed universal checkpoint (an error on every rank otherwise; ``engine_ckpt`` resolves tag None
    to ``load_dir/latest_universal`` first)."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if not isinstance(scheduler, bool):
        raise TypeError(f"scheduler must be a bool, got {type(scheduler).__name__}")
    if not isinstance(universal, bool):
        raise TypeError(f"universal must be a bool, got {type(universal).__name__}")
    if tag is not None:  # on every rank before any collective (the pending save's publish is one)
        files.check_tag(tag)
    wait_checkpoint(engine)
    view = EngineView(engine)
    g = view.grid
    path, meta, found = _open(g, load_dir, tag, universal)
    if found is not None:  # agreed by every rank in _open (the same identity)
        return formats.load(engine, view, found, strict=strict, scheduler=scheduler)
    err, reader = None, None
    xload: experts.ExpertLoad | None = None
    cuts: dict[str, Cut] = {}
    keep: set[str] = set()
    extras: dict[str, torch.Tensor] = {}
    rng, own = None, plan.own_file(g, meta)
    code = 0
    sched = engine.lr_scheduler if scheduler else None
    try:
        metacheck.check_engine(
            meta,
            os.path.join(path, files.METADATA),
            engine.checkpoint_counters(),
            None if sched is None else sched.state_dict(),
        )
        reader = CheckpointReader(path, meta)
        if experts.expert_side(view.opt) is not None:  # this rank's experts: their rows of the global tensors
            xload = experts.ExpertLoad(engine, reader, strict)  # checked first: an expert count ep cannot split
        reader, cuts, need, keep = plan.plan(view, path, meta, strict, reader)
        if xload is not None:
            need |= xload.files()
        for fname in sorted(need):
            why = reader.files.check(fname)
            if why is not None:
                code = plan.file_code(meta, fname, why)
                break
        if code == 0:
            reader.files.record(True)  # the blocks these read are noted, then each hashed by one rank
            plan.touch_reads(view, reader, cuts, keep)
            if xload is not None:
                xload.touch()
            extras = plan.saved_extras(view, reader, strict)
            rng = reader.rng(own) if own in meta["files"] else None
    except CorruptFile as e:
        code = plan.file_code(meta, e.name, "corrupt")
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
        err = f"{e}" if isinstance(e, (CheckpointError, ValueError, TypeError)) else repr(e)
        logger.debug("load_checkpoint: %s", traceback.format_exc())
        code = 1
    rank_files = reader.files if reader is not None and code == 0 else None
    code = plan.hash_shared(rank_files, RankFiles(path, meta), meta, g, code)
    stored = plan.stored_names(meta)  # the same list on every rank (the same metadata.json, agreed above)
    mine = set(view.saved_name.values()) | set(view.targets()) | plan.unsaved(engine)
    mine |= xload.names() if xload is not None else set()  # one-expert params: global names, not their modules'
    code, *held = files.agree_all([code, *(int(n in mine) for n in stored)], g.groups, g.device)
    unexpected = [n for n, h in zip(stored, held) if not h]  # in the checkpoint, in no rank's model
    if code >= 2:
        i = (code - 2) // 2
        fname = sorted(meta["files"])[i] if i < len(meta["files"]) else "a file metadata.json does not list"
        why = "is corrupt (sha256 or size differs from metadata.json)" if (code - 2) % 2 else "is missing"
        raise CheckpointError(f"checkpoint shard {os.path.join(path, fname)} {why}")
    problems = [files.agreed_error(err, g)] if code else []
    if unexpected and strict:
        problems.append(
            f"{len(unexpected)} params / buffers in {path} are in no rank's model: "
            f"{plan.shown(unexpected)} (load_checkpoint(..., strict=False) ignores them)"
        )
    if problems:
        raise CheckpointError("; ".join(problems))
    if unexpected and g.rank0:
        logger.warning(
            "load_checkpoint(strict=False): %d params / buffers in %s are in no rank's model, ignored: %s",
            len(unexpected),
            path,
            plan.shown(unexpected),
        )
    assert reader is not None
    reader.files.trust()  # every block read was hashed by one rank, and none differed

    opt = engine.optimizer
    with files.all_or_mixed(g, path):  # agreed before the stage-3 re-gather so that no rank waits alone
        plan.apply(view, reader, cuts, keep, extras)
        if xload is not None:
            xload.apply()
    opt.after_load()
    if xload is not None:
        xload.xopt.after_load()
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    opt.skipped_steps = meta["optimizer"]["skipped_steps"]  # first: engine.skipped_steps is counted relative to it
    opt.last_grad_norm = meta["optimizer"]["last_grad_norm"]
    engine.restore_counters(meta["engine"])
    if sched is not None and meta["scheduler"] is not None:
        sched.load_state_dict(meta["scheduler"])
    if rng is not None:
        set_rng_state(rng)
    else:
        logger.warning(
            "load_checkpoint: the saved run had no rank pp=%d dp=%d tp=%d: RNG states not restored",
            g.pp_rank,
            g.dp_rank,
            g.tp_rank,
        )
    client = None
    if files.CLIENT_STATE in meta["files"]:
        client = files.load_file(os.path.join(path, files.CLIENT_STATE), mmap=False)
    if g.rank0:
        logger.info(
            "loaded checkpoint %s (saved at pp=%d dp=%d tp=%d stage %d, loaded at pp=%d dp=%d tp=%d stage %d)",
            path,
            meta.get("pp", 1),
            meta["dp"],
            meta["tp"],
            meta["stage"],
            g.pp,
            g.dp,
            g.tp,
            opt.stage,
        )
    return path, client
