"""``save_checkpoint(engine, save_dir, tag, client_state)``: every rank writes its own shards; rank 0 publishes.

    1. rank 0 clears ``DIR/.tmp-TAG``; barrier (an error agreement over dp then tp = the whole grid)
    2. every rank writes ``dp{d}-tp{t}.pt`` (+ a small ``.json`` with its sha256); stage 0 dp ranks > 0 write only
       their RNG states: bytes written = the model state once, no duplication across dp ranks
    3. agreement: if any rank failed, every rank raises (nothing is published; the old checkpoint stays ``latest``)
    4. rank 0 writes ``metadata.json``, renames the directory to ``DIR/TAG``, then updates ``DIR/latest``
    5. agreement again: every rank returns only once the checkpoint is published (or raises if publishing failed)
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import traceback
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


def save_checkpoint(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
    """Write the engine's state as checkpoint ``save_dir/tag`` (default ``global_step{N}``); returns its path.
    Collective over the engine's dp and tp groups; call it at a gradient accumulation boundary."""
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

    try:
        if opt.stage3 is not None:
            opt.stage3.wait_all()
        buffers = local_buffers(opt)
        payload = {"format": files.FORMAT_VERSION, "dp_rank": dp_rank, "tp_rank": tp_rank, "buffers": buffers,
                   "extras": extras(engine.module, opt) if dp_rank == 0 else {}, "rng": rng_state()}
        name = files.rank_file(dp_rank, tp_rank)
        info = files.save_file(payload, os.path.join(tmp, name))
        info.update(dp_rank=dp_rank, tp_rank=tp_rank, has_shards=buffers is not None)
        if rank0 and client_state is not None:
            cinfo = files.save_file(client_state, os.path.join(tmp, files.CLIENT_STATE))
            cinfo.update(dp_rank=0, tp_rank=0, has_shards=False)
            files.write_json_atomic(os.path.join(tmp, files.CLIENT_STATE + ".json"), cinfo)
        files.fault("shard_written")
        files.write_json_atomic(os.path.join(tmp, name + ".json"), info)
        err = None
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
        err = f"dp rank {dp_rank} tp rank {tp_rank} failed writing its shard: {e!r}"
        logger.error("%s\n%s", err, traceback.format_exc())
    if files.agree(1 if err else 0, groups, device):
        raise CheckpointError(err or f"another rank failed writing checkpoint {tag!r} (see its error); nothing was "
                                     f"published, the previous checkpoint in {save_dir} is untouched")

    path = os.path.join(save_dir, tag)
    if rank0:
        try:
            rank_files = {}
            for side in sorted(glob.glob(os.path.join(tmp, "*.pt.json"))):
                with open(side) as f:
                    rank_files[os.path.basename(side)[:-5]] = json.load(f)
                os.remove(side)
            expected = dp * tp + (client_state is not None)
            if len(rank_files) != expected:
                raise CheckpointError(f"{tmp} holds {len(rank_files)} rank files, expected {expected}")
            files.write_json_atomic(os.path.join(tmp, files.METADATA),
                                    _metadata(engine, tag, dp, tp, rank_files))
            path = files.publish(save_dir, tmp, tag)
        except Exception as e:  # noqa: BLE001
            err = f"rank 0 failed publishing {path}: {e!r}"
            logger.error("%s\n%s", err, traceback.format_exc())
    if files.agree(1 if err else 0, groups, device):
        raise CheckpointError(err or f"rank 0 failed publishing checkpoint {tag!r} (see its error)")
    if rank0:
        logger.info("saved checkpoint %s", path)
    return path
