"""``save_checkpoint(engine, save_dir, tag, client_state, async_save)``: every rank writes its own shards; rank 0
publishes.

    1. prepare (collective): rank 0 clears ``DIR/.tmp-TAG``; barrier (an error agreement over dp then tp = the grid)
    2. snapshot: this rank's shards, extras, RNG states, the run state for ``metadata.json`` and ``client_state`` are
       copied to host memory (fresh tensors, deep copies): training may change the live state from here on
    3. write: ``dp{d}-tp{t}.pt`` (+ a small ``.json`` with its sha256); stage 0 dp ranks > 0 write only their RNG
       states: bytes written = the model state once, no duplication across dp ranks
    4. finish (collective): agreement: if any rank failed, every rank raises (nothing is published; the old checkpoint
       stays ``latest``); rank 0 writes ``metadata.json``, renames the directory to ``DIR/TAG``, updates
       ``DIR/latest``; agreement again: every rank returns only once the checkpoint is published

``async_save=False`` runs 1-4 in turn. ``async_save=True`` runs 1-2, starts a thread for 3 and returns; 4 runs in the
main thread at the next ``wait_checkpoint`` / ``save_checkpoint`` / ``load_checkpoint`` of that engine.

Why the publish is not done by the writer thread: its agreements are collectives, and gloo / NCCL need every rank to
issue the collectives of a group in the same order. From a second thread they would interleave with the training
collectives differently on each rank (a hang or crossed data) unless they ran on a group of their own; but
``new_group`` is collective over the *whole* job (ranks outside this engine's dp x tp grid, e.g. other pipeline
stages, would have to join in at the same moment), and a second NCCL communicator driven from a thread competes
with the training streams. Keeping every collective in the main thread, at calls every rank makes in the same
program order, holds the ordering by construction and needs no extra group. Cost: an async checkpoint becomes
``latest`` only when the training loop next calls ``wait_checkpoint`` / ``save_checkpoint`` (call
``engine.wait_checkpoint()`` before exiting); a crash before that leaves the previous checkpoint ``latest`` and the
written files under ``.tmp-TAG``, which no loader reads.
"""
from __future__ import annotations

import copy
import glob
import json
import logging
import os
import shutil
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.shards import extras, local_buffers, rng_state
from llmpar.distributed.collectives import group_rank, group_size

logger = logging.getLogger("llmpar")


def grid(engine: Any) -> tuple[list, int, int, int, int, torch.device]:
    """(groups, dp_rank, dp, tp_rank, tp, device) of the engine."""
    groups = [engine.dp_group] + ([engine.tp_group] if engine.tp_group is not None else [])
    tp_rank = group_rank(engine.tp_group) if engine.tp_group is not None else 0
    tp = group_size(engine.tp_group) if engine.tp_group is not None else 1
    opt = engine.optimizer
    device = opt.buffers[0].flat.device
    return groups, group_rank(engine.dp_group), group_size(engine.dp_group), tp_rank, tp, device


def _metadata(engine: Any, tag: str, dp: int, tp: int, rank_files: dict) -> dict:
    opt = engine.optimizer
    layout = opt.describe()
    for b, desc in zip(opt.buffers, layout["buffers"]):
        desc["state_keys"] = ["params", *b.state]
        desc["steps"] = [float(s) for s in b.steps]
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    zc = opt.zero_config
    return {
        "format": files.FORMAT_VERSION, "tag": tag, "stage": opt.stage, "dp": dp, "tp": tp,
        "offload_optimizer": bool(opt.placement.offload_optimizer), "offload_param": bool(opt.placement.offload_param),
        "reduce_bucket_size": zc.reduce_bucket_size, "layout": layout,
        "param_groups": [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in opt.param_groups],
        "engine": {"micro_steps": engine.micro_steps, "global_steps": engine.global_steps,
                   "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps},
        "optimizer": {"skipped_steps": opt.skipped_steps, "last_grad_norm": opt.last_grad_norm},
        "scheduler": sched, "files": rank_files,
    }




@dataclass(kw_only=True)
class _Save:
    """One save between its snapshot and its publish: what this rank writes, and how the ranks finish it."""

    save_dir: str
    tag: str
    tmp: str
    groups: list
    device: torch.device
    dp_rank: int
    dp: int
    tp_rank: int
    tp: int
    payload: dict  # this rank's file: host copies only
    meta: dict  # metadata.json without "files", as of the snapshot
    client_state: Any  # deep copy (rank 0), else None
    has_client: bool
    err: str | None = None  # set by write()
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def rank0(self) -> bool:
        return self.dp_rank == 0 and self.tp_rank == 0

    def write(self) -> None:
        """Phase 3 (any thread; no collectives): this rank's files into ``tmp``; an error is kept in ``err``."""
        try:
            files.fault("before_write")
            name = files.rank_file(self.dp_rank, self.tp_rank)
            info = files.save_file(self.payload, os.path.join(self.tmp, name))
            info.update(dp_rank=self.dp_rank, tp_rank=self.tp_rank, has_shards=self.payload["buffers"] is not None)
            if self.rank0 and self.has_client:
                cinfo = files.save_file(self.client_state, os.path.join(self.tmp, files.CLIENT_STATE))
                cinfo.update(dp_rank=0, tp_rank=0, has_shards=False)
                files.write_json_atomic(os.path.join(self.tmp, files.CLIENT_STATE + ".json"), cinfo)
            files.fault("shard_written")
            files.write_json_atomic(os.path.join(self.tmp, name + ".json"), info)
        except BaseException as e:  # noqa: BLE001 - agreed with the other ranks in finish(), then raised everywhere
            self.err = f"dp rank {self.dp_rank} tp rank {self.tp_rank} failed writing its shard: {e!r}"
            logger.error("%s\n%s", self.err, traceback.format_exc())
        finally:
            self.payload = {}  # drop the host copies as soon as they are on disk
            self.client_state = None
            self.done.set()

    def finish(self) -> str:
        """Phase 4 (main thread, collective over the grid): agree on the writes, rank 0 publishes, agree again."""
        if self.thread is not None:
            self.thread.join()
        err = self.err
        if files.agree(1 if err else 0, self.groups, self.device):
            raise CheckpointError(err or f"another rank failed writing checkpoint {self.tag!r} (see its error); "
                                         f"nothing was published, the previous checkpoint in {self.save_dir} is "
                                         f"untouched")
        path = os.path.join(self.save_dir, self.tag)
        if self.rank0:
            try:
                rank_files = {}
                for side in sorted(glob.glob(os.path.join(self.tmp, "*.pt.json"))):
                    with open(side) as f:
                        rank_files[os.path.basename(side)[:-5]] = json.load(f)
                    os.remove(side)
                expected = self.dp * self.tp + self.has_client
                if len(rank_files) != expected:
                    raise CheckpointError(f"{self.tmp} holds {len(rank_files)} rank files, expected {expected}")
                files.write_json_atomic(os.path.join(self.tmp, files.METADATA), {**self.meta, "files": rank_files})
                path = files.publish(self.save_dir, self.tmp, self.tag)
            except Exception as e:  # noqa: BLE001
                err = f"rank 0 failed publishing {path}: {e!r}"
                logger.error("%s\n%s", err, traceback.format_exc())
        if files.agree(1 if err else 0, self.groups, self.device):
            raise CheckpointError(err or f"rank 0 failed publishing checkpoint {self.tag!r} (see its error)")
        if self.rank0:
            logger.info("saved checkpoint %s", path)
        return path


_PENDING: "weakref.WeakKeyDictionary[Any, _Save]" = weakref.WeakKeyDictionary()  # engine -> its async save


def pending(engine: Any) -> _Save | None:
    """The engine's async save that is not published yet (its thread may have finished writing), else None."""
    return _PENDING.get(engine)


def wait_checkpoint(engine: Any) -> str | None:
    """Finish the engine's pending async save: wait for its writes, then publish it (collective over the grid, call
    it on every rank). Returns the published path, None when no save was pending; raises ``CheckpointError`` on every
    rank if any rank's writer failed (the previous checkpoint stays ``latest``)."""
    job = _PENDING.pop(engine, None)
    if job is None:
        return None
    return job.finish()


def _prepare(engine: Any, save_dir: Any, tag: str | None, client_state: dict | None) -> _Save:
    """Phases 1-2: checks, the tmp directory (collective), and the host snapshot of this rank's state."""
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_dir must be a path, got {type(save_dir).__name__}")
    save_dir = os.fspath(save_dir)
    tag = files.check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict or None, got {type(client_state).__name__}")
    opt = engine.optimizer
    if opt.reducer.micro_steps != 0:
        raise ValueError(f"save_checkpoint in the middle of a gradient accumulation ({opt.reducer.micro_steps} "
                         f"micro-steps since the last optimizer step): save after engine.step() at a boundary")
    groups, dp_rank, dp, tp_rank, tp, device = grid(engine)
    rank0 = dp_rank == 0 and tp_rank == 0
    tmp = os.path.join(save_dir, f".tmp-{tag}")

    err = None
    if rank0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            err = f"cannot create {tmp}: {e}"
    if files.agree(1 if err else 0, groups, device):
        raise CheckpointError(err or f"rank 0 could not create {tmp}: checkpoint {tag!r} not saved")

    if opt.stage3 is not None:
        opt.stage3.wait_all()
    # host copies (local_buffers / extras copy every tensor; rng_state returns fresh ones)
    payload = {"format": files.FORMAT_VERSION, "dp_rank": dp_rank, "tp_rank": tp_rank, "buffers": local_buffers(opt),
               "extras": extras(engine.module, opt) if dp_rank == 0 else {}, "rng": rng_state()}
    meta = copy.deepcopy(_metadata(engine, tag, dp, tp, {}))
    return _Save(save_dir=save_dir, tag=tag, tmp=tmp, groups=groups, device=device, dp_rank=dp_rank, dp=dp,
                 tp_rank=tp_rank, tp=tp, payload=payload, meta=meta, has_client=client_state is not None,
                 client_state=copy.deepcopy(client_state) if rank0 and client_state is not None else None)


def save_checkpoint(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                    async_save: bool = False) -> str:
    """Write the engine's state as checkpoint ``save_dir/tag`` (default ``global_step{N}``); returns its path.
    Collective over the engine's dp and tp groups; call it at a gradient accumulation boundary. A pending async save
    of this engine is finished (published) first. ``async_save=True``: returns once the state is copied to host
    memory, the files are written by a thread while training goes on, and the checkpoint is published by the next
    ``wait_checkpoint`` / ``save_checkpoint`` / ``load_checkpoint`` (the path returned is where it will be)."""
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be a bool, got {type(async_save).__name__}")
    wait_checkpoint(engine)
    job = _prepare(engine, save_dir, tag, client_state)
    if not async_save:
        job.write()
        return job.finish()
    job.thread = threading.Thread(target=job.write, name=f"llmpar-ckpt-{job.tag}", daemon=True)
    _PENDING[engine] = job
    job.thread.start()
    return os.path.join(job.save_dir, job.tag)
