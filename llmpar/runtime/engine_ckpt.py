"""DeepSpeed's checkpoint options on top of ``llmpar.checkpoint`` (which always saves and loads everything):

    engine.save_checkpoint(dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False)
    engine.load_checkpoint(dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
                           load_module_only=False, load_module_strict=True)

A ``tag`` is checked (``files.check_tag``: a plain directory name) by each rank before any collective. A directory
written by DeepSpeed's ``save_checkpoint`` (no ``metadata.json``; ``llmpar.checkpoint.formats.deepspeed``) loads the
same way, with every option below; its client_state is the keys the caller saved.
save_latest=False: the checkpoint is published, then ``DIR/latest`` is put back exactly as it was (atomic rewrite;
removed when there was none) before any rank returns. exclude_frozen_parameters=True: frozen params
(``requires_grad=False``) are not written (stages 0-2; ZeRO-3 shards them and writes them anyway, with a warning);
loading such a checkpoint into a model that has them needs ``load_module_strict=False``, as in DeepSpeed.
``"checkpoint": {"load_universal": true}`` in the config (DeepSpeed's meaning): a load with ``tag=None`` reads the tag
from ``DIR/latest_universal`` (an error on every rank when it is missing) even when ``DIR/latest`` exists, and the
checkpoint loaded must be a universal one (``universal_read``); false / absent: ``latest``, else
``latest_universal``, any layout.
load_optimizer_states=False: weights (and the fp32 masters, from the checkpoint) are loaded; Adam moments, step counts
and param-group hyper-parameters stay as they were. load_lr_scheduler_states=False: the scheduler (and the lrs it set)
stay. load_module_only=True: only the weights; optimizer, scheduler, engine counters and RNG states stay (client_state
is still returned). "Stay" is done by a snapshot before the load and putting it back after (one host-side copy of
this rank's moments while loading). A load with ``tag=None`` from a directory without ``latest`` returns
``(None, None)`` with a warning, as DeepSpeed does.

The model's own description, for checkpoints and exports: ``hf_configs`` (its HuggingFace config and generation
config, duck-typed: ``module.config.to_json_string`` / ``to_dict``, none for other models), ``unsaved_buffers``
(non-persistent buffers: not in ``state_dict``, left out of checkpoints and exports), and ``save_hf`` behind
``engine.save_hf_model``: the live model's full weights (ZeRO-3 gathered unit by unit, tensor-parallel params
all-gathered over tp and unpadded) written by ``llmpar.checkpoint.formats.hf`` as ``from_pretrained`` loads them.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from llmpar.checkpoint import files
from llmpar.checkpoint.formats.dcp import format as dcp_format
from llmpar.checkpoint.formats.hf import files as hf_files
from llmpar.checkpoint.formats.universal import read as universal_read
from llmpar.checkpoint.reshard import tp_specs
from llmpar.checkpoint.shards import rng_state, set_rng_state
from llmpar.distributed.collectives import all_gather_flat, collective_device, group_rank, group_size

logger = logging.getLogger("llmpar")

_HYPER = ("lr", "betas", "eps", "weight_decay")


def save(
    engine: Any,
    save_dir: Any,
    tag: str | None,
    client_state: dict | None,
    save_latest: bool,
    exclude_frozen_parameters: bool,
    async_save: bool,
) -> str:
    from llmpar.checkpoint import save_checkpoint

    for name, value in (("save_latest", save_latest), ("exclude_frozen_parameters", exclude_frozen_parameters)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if not save_latest and async_save:
        raise ValueError(
            "save_latest=False with async_save=True: an async save is published (and 'latest' written) "
            "later, at wait_checkpoint(); save synchronously, or keep save_latest=True"
        )
    if exclude_frozen_parameters and engine.optimizer.frozen_shapes():
        logger.warning(
            "save_checkpoint(exclude_frozen_parameters=True): ZeRO-3 shards the frozen params; they are written anyway"
        )
    if tag is not None:  # on every rank before any collective
        files.check_tag(tag)
    grid = engine.checkpoint_grid()
    latest = os.path.join(os.fspath(save_dir), files.LATEST) if isinstance(save_dir, (str, os.PathLike)) else None
    before: bytes | None = None  # latest's exact bytes, put back as they were
    err = 0  # agreed on every rank even when nothing is to be done (the ranks' save_latest may differ)
    if not save_latest and grid.rank0 and latest is not None and os.path.isfile(latest):
        try:
            with open(latest, "rb") as f:
                before = f.read()
        except OSError as e:  # saved all the same; every rank raises below
            logger.error("save_checkpoint(save_latest=False): could not read %s: %s", latest, e)
            err = 1
    engine.exclude_frozen = exclude_frozen_parameters
    try:
        path = save_checkpoint(engine, save_dir, tag=tag, client_state=client_state, async_save=async_save)
    finally:
        engine.exclude_frozen = False
    if not save_latest:
        if grid.rank0 and not err:
            try:
                if before is not None:
                    files.replace_file(latest, before)
                elif os.path.exists(latest):
                    os.remove(latest)
            except OSError as e:
                logger.error("save_checkpoint(save_latest=False): could not restore %s: %s", latest, e)
                err = 1
    if files.agree(err, grid.groups, grid.device):  # nobody returns before 'latest' is back
        raise OSError(f"save_checkpoint(save_latest=False): {path} was saved but {latest} could not be restored")
    return path


def _buffers(opt: Any) -> list:
    """The optimizer's flat buffers, then its expert optimizer's (expert parallelism: ``opt.experts``)."""
    experts = getattr(opt, "experts", None)
    return [*opt.buffers, *(experts.buffers if experts is not None else [])]


def _snapshot(engine: Any, optimizer: bool, scheduler: bool, module_only: bool) -> dict:
    opt, out = engine.optimizer, {}
    if optimizer or module_only:
        out["states"] = [{k: t.clone() for k, t in b.state.items() if k != "master"} for b in _buffers(opt)]
        out["steps"] = [[s.clone() for s in b.steps] for b in _buffers(opt)]
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
        for b, states, steps in zip(_buffers(opt), saved["states"], saved["steps"]):
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


def load(
    engine: Any,
    load_dir: Any,
    tag: str | None,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    strict: bool,
) -> tuple[str | None, dict | None]:
    from llmpar.checkpoint import load_checkpoint

    for name, value in (
        ("load_optimizer_states", load_optimizer_states),
        ("load_module_only", load_module_only),
        ("load_lr_scheduler_states", load_lr_scheduler_states),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if tag is not None:  # on every rank before any collective
        files.check_tag(tag)
    universal = engine.config.checkpoint.load_universal
    if universal and tag is None and isinstance(load_dir, (str, os.PathLike)):
        tag = _universal_tag(engine, os.fspath(load_dir))
    if isinstance(load_dir, (str, os.PathLike)):  # every rank agrees, whatever its tag (ranks may differ: an error)
        grid = engine.checkpoint_grid()
        found = (
            tag is not None
            or os.path.isfile(os.path.join(os.fspath(load_dir), files.LATEST))
            or (dcp_format.detect(os.fspath(load_dir)))
            or (  # a torch.distributed.checkpoint directory itself
                universal_read.resolve(load_dir, None) is not None
            )
        )  # DeepSpeed's latest_universal, or such a directory
        if files.agree(int(found), grid.groups, grid.device) == 0:  # no rank has one: DeepSpeed's (None, None)
            if grid.rank0:
                logger.warning(
                    "load_checkpoint: %s has no 'latest' file: nothing loaded (pass tag= to load a "
                    "checkpoint by its name)",
                    load_dir,
                )
            return None, None
    saved = _snapshot(engine, not load_optimizer_states, not load_lr_scheduler_states, load_module_only)
    path, client = load_checkpoint(
        engine,
        load_dir,
        tag=tag,
        strict=strict,  # a scheduler put back is not checked
        scheduler=load_lr_scheduler_states and not load_module_only,
        universal=universal,
    )
    _restore(engine, saved)
    engine.mirror_lrs_to_client()
    return path, client


def _universal_tag(engine: Any, load_dir: str) -> str | None:
    """``load_checkpoint(load_dir)`` with ``load_universal``: the tag ``load_dir/latest_universal`` names, as
    DeepSpeed reads it even when ``load_dir/latest`` exists (None: ``load_dir`` is a universal checkpoint itself);
    an error on every rank when there is neither."""
    tag = universal_read.latest_tag(load_dir)
    missing = tag is None and not universal_read.detect(load_dir)
    grid = engine.checkpoint_grid()
    if files.agree(int(missing), grid.groups, grid.device):
        where = os.path.join(load_dir, universal_read.LATEST_UNIVERSAL)
        raise ValueError(
            f'"checkpoint.load_universal"=true: {where} is missing or does not name a tag (on at least '
            "one rank), and the directory is not a universal checkpoint itself: pass tag=, or set "
            "load_universal to false to load DeepSpeed's or llmpar's own checkpoint"
        )
    return tag


def _json_dict(obj: Any) -> dict | None:
    """A config object (HuggingFace ``PretrainedConfig`` / ``GenerationConfig``, duck-typed) as a JSON-able dict."""
    if obj is None:
        return None
    if callable(getattr(obj, "to_json_string", None)):
        try:
            return json.loads(obj.to_json_string(use_diff=False))
        except TypeError:  # a to_json_string without use_diff
            return json.loads(obj.to_json_string())
    if callable(getattr(obj, "to_dict", None)):
        out = obj.to_dict()
        return json.loads(json.dumps(out, default=str)) if isinstance(out, dict) else None
    return None


def hf_configs(module: nn.Module) -> tuple[dict | None, dict | None]:
    """(config, generation config) of a HuggingFace model as dicts, with ``architectures`` set to the model's class
    as ``save_pretrained`` does; (None, None) for a model without a config object."""
    config = _json_dict(getattr(module, "config", None))
    if config is not None and not config.get("architectures"):
        config["architectures"] = [type(module).__name__]
    return config, _json_dict(getattr(module, "generation_config", None))


def unsaved_buffers(modules: list[nn.Module]) -> set[int]:
    """ids of the non-persistent buffers of ``modules`` (``register_buffer(..., persistent=False)``: recomputed by
    the module, not in its ``state_dict``; e.g. rotary ``inv_freq``)."""
    out = set()
    for root in modules:
        for m in root.modules():
            for name in m._non_persistent_buffers_set:
                if m._buffers.get(name) is not None:
                    out.add(id(m._buffers[name]))
    return out


@torch.no_grad()
def _unsplit_tp(engine: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (this tp rank's slices, the same names in the same order on every tp rank) with each
    tensor-parallel param all-gathered over tp along its split dim and its padding dropped (collective over tp)."""
    group = engine.tp_group
    tp = group_size(group)
    specs = tp_specs(engine.module, tp)
    split = {n: specs[id(p)] for n, p in engine.module.named_parameters(remove_duplicate=False) if specs.get(id(p))}
    device, done = collective_device(group), {}
    for name, t in state.items():
        spec = split.get(name)
        if spec is None:
            continue
        if id(t) not in done:  # a tied weight: gathered once
            local = t.to(device).contiguous()
            full = torch.empty(tp * local.numel(), dtype=local.dtype, device=device)
            all_gather_flat(full, local.view(-1), group, what=f"save_hf_model: all-gather of {name!r} over tp")
            whole = torch.cat(full.view(tp, *local.shape).unbind(0), spec["dim"])
            size = spec["full"] if spec.get("full") is not None else whole.shape[spec["dim"]]
            done[id(t)] = whole.narrow(spec["dim"], 0, size).to("cpu", copy=True)
        state[name] = done[id(t)]
    return state


def hf_named(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under transformers' names where a swapped MoE block (``llmpar.moe.hf``, its ``hf_names``: {our
    local name: transformers'}) holds params under ours: the names ``from_pretrained`` reads."""
    names: dict[str, str] = {}
    for prefix, m in module.named_modules():
        hf = getattr(m, "hf_names", None)
        if isinstance(hf, dict):
            names |= {(f"{prefix}.{a}" if prefix else a): (f"{prefix}.{b}" if prefix else b) for a, b in hf.items()}
    return {names.get(k, k): v for k, v in state.items()} if names else state


def save_hf(engine: Any, save_dir: Any, dtype: Any, max_shard_size: Any) -> bool:
    """``engine.save_hf_model``: checked on every rank first; then the full state dict (collective), written by the
    grid's rank 0; every rank raises when the write failed."""
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_dir must be a path, got {type(save_dir).__name__}")
    hf_files.parse_dtype(dtype)
    hf_files.parse_size(max_shard_size)
    hf_files.parse_format("safetensors")
    grid = engine.checkpoint_grid()
    state = engine.module_state_dict()  # dp rank 0 of each tp rank; {} elsewhere
    if engine.tp_group is not None and group_size(engine.tp_group) > 1 and group_rank(engine.optimizer.dp_group) == 0:
        state = _unsplit_tp(engine, state)
    err = None
    if grid.rank0:
        try:
            config, generation = hf_configs(engine.module)
            hf_files.write_hf_model(
                os.fspath(save_dir),
                state,
                config=config,
                generation_config=generation,
                dtype=dtype,
                max_shard_size=max_shard_size,
                format="safetensors",
            )
        except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
            err = f"save_hf_model: writing {save_dir} failed on rank 0: {e!r}"
            logger.error(err)
    if files.agree(1 if err else 0, grid.groups, grid.device):
        raise OSError(err or f"save_hf_model: writing {save_dir} failed on rank 0 (see its error)")
    return True


__all__ = ["hf_configs", "hf_named", "load", "save", "save_hf", "unsaved_buffers"]
