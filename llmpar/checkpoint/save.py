"""``save_checkpoint(engine, save_dir, tag, client_state, async_save)``: every rank writes its own shards; rank 0
publishes.

    1. prepare (collective): rank 0 clears ``DIR/.tmp-TAG``; barrier (an error agreement over dp, tp, pp = the grid,
       which also checks that every rank saves the same tag)
    2. snapshot: this rank's extras, RNG states, the run state for ``metadata.json`` and ``client_state`` are copied
       (fresh tensors, deep copies); its shards too under ``async_save`` (training may change the live state from
       there on), else they are written from the live buffers themselves (``ShardViews``: no copy)
    3. write: (rank 0) ``metadata.json.part``; ``dp{d}-tp{t}.shard`` (``pp{p}-dp{d}-tp{t}.shard`` under a pipeline of
       pp > 1; ``blockwrite.py``: raw tensors, hashed per block while written, one fsync) + last a small ``.json`` with
       its size and index sha256, the names of its extras, and (dp rank 0, tp rank 0 of each pp rank) that pp rank's
       layout with each param under its name in the unsplit model and its tp split; stage 0 dp ranks > 0 write only
       their RNG states: bytes written = the model state once, no duplication across dp ranks (a tied weight: once,
       by its lowest stage)
    4. finish (collective): agreement: if any rank failed, every rank raises (nothing is published; the old checkpoint
       stays ``latest``; rank 0 deletes ``DIR/.tmp-TAG``); rank 0 writes ``metadata.json`` (one for all pp ranks, from
       the side files, with its digest), renames the directory to ``DIR/TAG``, updates ``DIR/latest``
       (``publish.py``), deletes what earlier failures left in ``DIR``; agreement again: every rank returns only once
       the checkpoint is published

``async_save=False`` runs 1-4 in turn. ``async_save=True`` runs 1-2, starts a thread for 3 and returns; 4 runs in the
main thread at the next ``wait_checkpoint`` / ``save_checkpoint`` / ``load_checkpoint`` of that engine. The pending
save is the engine's own (``engine.checkpoint_pending``): no module-level registry. The engine and its optimizer are
seen only through the checkpoint protocol (``protocol.py``); ``fault_hook`` (tests) is passed per save.

Why the publish is not done by the writer thread: its agreements are collectives, and gloo / NCCL need every rank to
issue the collectives of a group in the same order. From a second thread they would interleave with the training
collectives differently on each rank (a hang or crossed data) unless they ran on a group of their own; but
``new_group`` is collective over the *whole* job (ranks outside this engine's dp x tp grid, e.g. other pipeline
stages, would have to join in at the same moment), and a second NCCL communicator driven from a thread competes
with the training streams. Keeping every collective in the main thread, at calls every rank makes in the same
program order, holds the ordering by construction and needs no extra group. Cost: an async checkpoint becomes
``latest`` only when the training loop next calls ``wait_checkpoint`` / ``save_checkpoint`` (call
``engine.wait_checkpoint()`` before exiting). A save still pending when the engine goes (garbage-collected, or the
interpreter exits) is finished by a ``weakref.finalize`` of that engine, without collectives: each rank joins its
writer; rank 0 publishes once it sees every rank's side file on disk (``Save.finish_orphaned``), else warns what to
run. A process killed before that leaves the previous checkpoint ``latest`` and the written files under
``.tmp-TAG``: ``load_checkpoint`` warns about such a complete, never published save, ``llmpar checkpoint publish DIR
TAG`` publishes it, the next successful save deletes it.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
import weakref
from typing import Any

from llmpar.checkpoint import experts, files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.pending import Save, wait_checkpoint
from llmpar.checkpoint.protocol import Checkpointable, DescribesModel, FaultHook, Grid
from llmpar.checkpoint.shards import extras, local_buffers, rng_state
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")


def _metadata(engine: Checkpointable, tag: str, g: Grid) -> dict:
    """``metadata.json`` as of the snapshot, less what rank 0 collects at the publish ("files", the layout's
    "buffers", "extras")."""
    opt = engine.optimizer
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return {
        "format": files.FORMAT_VERSION,
        "tag": tag,
        "stage": opt.stage,
        "dp": g.dp,
        "tp": g.tp,
        "pp": g.pp,
        **opt.checkpoint_facts(),
        "layout": {"stage": opt.stage, "dp": opt.dp},
        "param_groups": [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in opt.param_groups],
        "engine": engine.checkpoint_counters(),
        "optimizer": {"skipped_steps": opt.skipped_steps, "last_grad_norm": opt.last_grad_norm},
        "scheduler": sched,
        "files": {},
        **model_facts(engine),
    }


def model_facts(engine: Checkpointable) -> dict:
    """``{"model": {"hf_config": ..., "hf_generation_config": ...}}`` for ``metadata.json`` when the engine describes
    its model (``DescribesModel``) with either, else {}."""
    if not isinstance(engine, DescribesModel):
        return {}
    facts = engine.checkpoint_model()
    model = {k: facts[k] for k in ("hf_config", "hf_generation_config") if facts.get(k) is not None}
    return {"model": model} if model else {}


def _layout(view: EngineView) -> list[dict]:
    """This pp rank's buffers as ``metadata.json`` lists them: the optimizer's ``checkpoint_layout()`` (with state
    keys and unit steps) plus the pp rank and index, and per param its checkpoint name, tp split (``reshard.py``) and
    whether it is a tied copy written by a lower stage (``dup``)."""
    specs = view.specs()
    out = []
    for index, desc in enumerate(copy.deepcopy(view.layout)):
        desc.update(pp_rank=view.grid.pp_rank, index=index)
        for slot in desc["params"]:
            name = slot["name"]
            slot.update(name=view.saved_name[name], tp=specs[name])
            if name in view.duplicates:
                slot["dup"] = True
        out.append(desc)
    return out


def _prepare(
    engine: Checkpointable,
    save_dir: Any,
    tag: str | None,
    client_state: dict | None,
    fault_hook: FaultHook | None,
    snapshot: bool,
) -> Save:
    """Phases 1-2: checks, the tmp directory (collective), and what this rank writes (``snapshot``: host copies of
    its shards, else views of the live ones)."""
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_dir must be a path, got {type(save_dir).__name__}")
    save_dir = os.fspath(save_dir)
    tag = files.check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict or None, got {type(client_state).__name__}")
    if fault_hook is not None and not callable(fault_hook):
        raise TypeError(f"fault_hook must be callable or None, got {type(fault_hook).__name__}")
    opt = engine.optimizer
    opt.prepare_save()  # raises mid-accumulation (on every rank alike); in-flight gathers finished
    view = EngineView(engine)
    g = view.grid
    tmp = os.path.join(save_dir, files.TMP_PREFIX + tag)

    err = None
    if g.rank0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            files.remove_path(tmp)  # a failed save's files (a link there: unlinked, never followed)
            os.makedirs(tmp)
        except OSError as e:
            err = f"cannot create {tmp}: {e}"
    h = files.fingerprint(tag)  # every rank must save the same tag (else they write into different directories)
    code, high, neg_low = files.agree_all([1 if err else 0, h, -h], g.groups, g.device)
    if high != -neg_low:
        if g.rank0 and err is None:
            shutil.rmtree(tmp, ignore_errors=True)
        tags = files.gather_text(tag, g)
        by_tag: dict[str, list[str]] = {}
        for i, t in enumerate(tags):
            by_tag.setdefault(t, []).append(files.rank_name(g, i))
        raise CheckpointError(
            "the ranks are saving different tags, nothing was saved: "
            + "; ".join(f"{', '.join(r)}: {t!r}" for t, r in by_tag.items())
            + " (the default tag global_step{N} differs when the ranks' step counts differ)"
        )
    if code:
        raise CheckpointError(err or f"rank 0 could not create {tmp}: checkpoint {tag!r} not saved")

    try:  # extras copies every tensor, rng_state returns fresh ones, local_buffers copies when snapshot
        trained = set(view.saved_name.values())
        frozen = opt.frozen_shapes()
        kept = extras(view.targets(), trained | set(frozen)) if g.dp_rank == 0 else {}
        if frozen:  # ZeRO-3 shards frozen params too: gathered whole to dp rank 0 (collective over dp)
            kept.update(opt.gather_frozen())
        payload = {
            "format": files.FORMAT_VERSION,
            "dp_rank": g.dp_rank,
            "tp_rank": g.tp_rank,
            "pp_rank": g.pp_rank,
            "buffers": local_buffers(opt, view.duplicates, copy=snapshot),
            "extras": kept,
            "rng": rng_state(),
        }
        xpart, xmark = experts.snapshot(engine, copy=snapshot)  # expert-parallel: global names (``experts.py``)
        if xpart is not None:
            payload[experts.KEY] = xpart
    except BaseException:
        if g.rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    side: dict = {"extras": sorted(kept)}
    if xmark is not None:
        side[experts.KEY] = xmark
    if g.dp_rank == 0 and g.tp_rank == 0:
        side["layout"] = _layout(view)
    meta = copy.deepcopy(_metadata(engine, tag, g)) if g.rank0 else {}
    return Save(
        save_dir=save_dir,
        tag=tag,
        tmp=tmp,
        grid=g,
        payload=payload,
        meta=meta,
        side=side,
        has_client=client_state is not None,
        fault_hook=fault_hook,
        client_state=copy.deepcopy(client_state) if g.rank0 and client_state is not None else None,
    )


def save_checkpoint(
    engine: Checkpointable,
    save_dir: str,
    tag: str | None = None,
    client_state: dict | None = None,
    async_save: bool = False,
    *,
    fault_hook: FaultHook | None = None,
) -> str:
    """Write the engine's state as checkpoint ``save_dir/tag`` (default ``global_step{N}``); returns its path.
    Collective over the engine's dp, tp (and pp) groups; call it at a gradient accumulation boundary. A ``tag`` that
    is not a plain directory name (``files.check_tag``: whitespace around it, a control character, path syntax) is a
    ValueError naming it, raised by each rank before any collective. A pending async save of this engine is finished
    (published) first. ``async_save=True``: returns once the state is copied to host
    memory, the files are written by a thread while training goes on, and the checkpoint is published by the next
    ``wait_checkpoint`` / ``save_checkpoint`` / ``load_checkpoint`` (the path returned is where it will be).
    An async save still pending when the engine is garbage-collected or the interpreter exits is finished then (a
    ``weakref.finalize`` per save: written on every rank, published by rank 0 when it sees every rank's file; see
    ``Save.finish_orphaned``), with a warning: call ``wait_checkpoint`` before the end of the script.
    ``fault_hook`` (tests): called on every rank at "before_write", "shard_written" (the writer; a thread under
    ``async_save``), then on rank 0 at the publish's instants ("before_publish", "old_moved_aside" and
    "before_cleanup" when re-saving a tag, "before_latest", ``publish.py``); one that raises simulates a crash
    there (an ``Exception`` is handled as a failure, a ``BaseException`` the publish does not catch leaves the disk as
    a dead process would)."""
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be a bool, got {type(async_save).__name__}")
    if tag is not None:  # on every rank before any collective (the pending save's publish is one)
        files.check_tag(tag)
    wait_checkpoint(engine)
    job = _prepare(engine, save_dir, tag, client_state, fault_hook, snapshot=async_save)
    if not async_save:
        job.write()
        return job.finish()
    job.thread = threading.Thread(target=job.write, name=f"llmpar-ckpt-{job.tag}", daemon=True)
    engine.checkpoint_pending = job
    job.finalizer = weakref.finalize(engine, job.finish_orphaned)  # holds the job, not the engine
    job.thread.start()
    return os.path.join(job.save_dir, job.tag)
