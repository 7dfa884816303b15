"""DeepSpeed's checkpoint options on top of ``llmpar.checkpoint`` (which always saves and loads everything):

    engine.save_checkpoint(dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False)
    engine.load_checkpoint(dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
                           load_module_only=False, load_module_strict=True)

save_latest=False: the checkpoint is published, then ``DIR/latest`` is put back as it was (atomic rewrite; removed
when there was none) before any rank returns. exclude_frozen_parameters=True: frozen params (``requires_grad=False``)
are not written (stages 0-2; ZeRO-3 shards them and writes them anyway, with a warning); loading such a checkpoint
into a model that has them needs ``load_module_strict=False``, as in DeepSpeed.
load_optimizer_states=False: weights (and the fp32 masters, from the checkpoint) are loaded; Adam moments, step counts
and param-group hyper-parameters stay as they were. load_lr_scheduler_states=False: the scheduler (and the lrs it set)
stay. load_module_only=True: only the weights; optimizer, scheduler, engine counters and RNG states stay (client_state
is still returned). "Stay" is done by a snapshot before the load and putting it back after (one host-side copy of
this rank's moments while loading). A load with ``tag=None`` from a directory without ``latest`` returns
``(None, None)`` with a warning, as DeepSpeed does.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any

from llmpar.checkpoint import files
from llmpar.checkpoint.shards import rng_state, set_rng_state

logger = logging.getLogger("llmpar")

_HYPER = ("lr", "betas", "eps", "weight_decay")


def save(engine: Any, save_dir: Any, tag: str | None, client_state: dict | None, save_latest: bool,
         exclude_frozen_parameters: bool, async_save: bool) -> str:
    from llmpar.checkpoint import save_checkpoint

    for name, value in (("save_latest", save_latest), ("exclude_frozen_parameters", exclude_frozen_parameters)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if not save_latest and async_save:
        raise ValueError("save_latest=False with async_save=True: an async save is published (and 'latest' written) "
                         "later, at wait_checkpoint(); save synchronously, or keep save_latest=True")
    if exclude_frozen_parameters and engine.optimizer.frozen_shapes():
        logger.warning("save_checkpoint(exclude_frozen_parameters=True): ZeRO-3 shards the frozen params; they are "
                       "written anyway")
    grid = engine.checkpoint_grid()
    latest = os.path.join(os.fspath(save_dir), files.LATEST) if isinstance(save_dir, (str, os.PathLike)) else None
    before = None
    if not save_latest and grid.rank0 and latest is not None and os.path.isfile(latest):
        with open(latest) as f:
            before = f.read().strip()
    engine.exclude_frozen = exclude_frozen_parameters
    try:
        path = save_checkpoint(engine, save_dir, tag=tag, client_state=client_state, async_save=async_save)
    finally:
        engine.exclude_frozen = False
    err = 0  # agreed on every rank even when nothing is to be done (the ranks' save_latest may differ)
    if not save_latest:
        if grid.rank0:
            try:
                if before:
                    files.write_latest(os.fspath(save_dir), before)
                elif os.path.exists(latest):
                    os.remove(latest)
            except OSError as e:
                logger.error("save_checkpoint(save_latest=False): could not restore %s: %s", latest, e)
                err = 1
    if files.agree(err, grid.groups, grid.device):  # nobody returns before 'latest' is back
        raise OSError(f"save_checkpoint(save_latest=False): {path} was saved but {latest} could not be restored")
    return path


def _snapshot(engine: Any, optimizer: bool, scheduler: bool, module_only: bool) -> dict:
    opt, out = engine.optimizer, {}
    if optimizer or module_only:
        out["states"] = [{k: t.clone() for k, t in b.state.items() if k != "master"} for b in opt.buffers]
        out["steps"] = [[s.clone() for s in b.steps] for b in opt.buffers]
        out["groups"] = [{k: copy.copy(g[k]) for k in _HYPER} for g in opt.param_groups]
    if (scheduler or module_only) and engine.lr_scheduler is not None:
        out["sched"] = copy.deepcopy(engine.lr_scheduler.state_dict())
        out["lrs"] = [g["lr"] for g in opt.param_groups]
    if module_only:  # the optimizer's counts first: engine.skipped_steps is counted relative to them
        out["opt_counts"] = (opt.skipped_steps, opt.last_grad_norm)
        out["counters"] = engine.checkpoint_counters()
        out["rng"] = rng_state()
    return out


def _restore(engine: Any, saved: dict) -> None:
    opt = engine.optimizer
    if "states" in saved:
        for b, states, steps in zip(opt.buffers, saved["states"], saved["steps"]):
            for k, t in states.items():
                b.state[k].copy_(t)
            for s, v in zip(b.steps, steps):
                s.copy_(v)
        for g, hyper in zip(opt.param_groups, saved["groups"]):
            g.update(hyper)
    if "sched" in saved:
        engine.lr_scheduler.load_state_dict(saved["sched"])
        for g, lr in zip(opt.param_groups, saved["lrs"]):
            g["lr"] = lr
    if "counters" in saved:
        opt.skipped_steps, opt.last_grad_norm = saved["opt_counts"]
        engine.restore_counters(saved["counters"])
        set_rng_state(saved["rng"])


def load(engine: Any, load_dir: Any, tag: str | None, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool, strict: bool) -> tuple[str | None, dict | None]:
    from llmpar.checkpoint import load_checkpoint

    for name, value in (("load_optimizer_states", load_optimizer_states), ("load_module_only", load_module_only),
                        ("load_lr_scheduler_states", load_lr_scheduler_states)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if isinstance(load_dir, (str, os.PathLike)):  # every rank agrees, whatever its tag (ranks may differ: an error)
        grid = engine.checkpoint_grid()
        found = tag is not None or os.path.isfile(os.path.join(os.fspath(load_dir), files.LATEST))
        if files.agree(int(found), grid.groups, grid.device) == 0:  # no rank has one: DeepSpeed's (None, None)
            if grid.rank0:
                logger.warning("load_checkpoint: %s has no 'latest' file: nothing loaded (pass tag= to load a "
                               "checkpoint by its name)", load_dir)
            return None, None
    saved = _snapshot(engine, not load_optimizer_states, not load_lr_scheduler_states, load_module_only)
    path, client = load_checkpoint(engine, load_dir, tag=tag, strict=strict)
    _restore(engine, saved)
    engine.mirror_lrs_to_client()
    return path, client


__all__ = ["load", "save"]
