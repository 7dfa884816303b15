"""Writing a ``torch.distributed.checkpoint`` directory FSDP2 / torchtitan load (``format.py`` describes its keys).

    to_dcp(src, "out_dcp")                    # any reader of the protocol: an llmpar or a universal checkpoint
    # FSDP2 side (any number of ranks): model fully_shard-ed, torch AdamW with the same hyper-parameters
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd = {"model": msd, "optim": osd}; dcp.load(sd, checkpoint_id="out_dcp")
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=...)

The weights written are the fp32 masters when the run kept them (else the params as saved), whole (an llmpar
tensor-parallel param concatenated, padding dropped), with Adam's ``exp_avg`` / ``exp_avg_sq`` and step of every
trained param, and each param's group's lr, betas, eps and weight_decay; module buffers and frozen params go with the
model's tensors. A checkpoint without Adam moments (a plain SGD run) is an error naming the state keys it has. The
reader has checked its files when it opened (an llmpar checkpoint: every rank file's size and block hashes).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.dcp.format import MOMENTS
from llmpar.checkpoint.formats.source import HYPER, Source, full

ADAMW_FLAGS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}  # torch.optim.AdamW's, beside the hyper-parameters


def write_dcp(
    out_dir: str,
    model: dict[str, torch.Tensor],
    moments: dict[str, dict[str, torch.Tensor]],
    steps: dict[str, float],
    hyper: dict[str, dict[str, Any]],
) -> None:
    """Write a DCP directory FSDP2 loads (``{"model": ..., "optim": ...}``, the optimizer state flattened as
    ``get_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))`` gives it): ``model``:
    {name: full tensor}; ``moments``: {name: {"exp_avg": t, "exp_avg_sq": t}} of the trained params; ``steps``:
    {name: Adam step}; ``hyper``: {name: {"lr", "betas", "eps", "weight_decay"}} (torch AdamW's other flags added).
    One process, no collective (``no_dist``)."""
    for name, states in moments.items():
        if name not in model or name not in steps or name not in hyper:
            raise ValueError(
                f"moments of {name!r} without its weight, step or hyper-parameters: every trained param needs them"
            )
        for k, t in states.items():
            if k not in MOMENTS or tuple(t.shape) != tuple(model[name].shape):
                raise ValueError(
                    f"moment {k!r} of {name!r} with shape {tuple(t.shape)}: accepted {list(MOMENTS)} "
                    f"of the param's shape {tuple(model[name].shape)}"
                )
    optim: dict[str, Any] = {
        "state": {
            n: {**{k: t.contiguous() for k, t in s.items()}, "step": torch.tensor(float(steps[n]))}
            for n, s in moments.items()
        },
        "param_groups": {n: {**hyper[n], **ADAMW_FLAGS} for n in moments},
    }
    sd = {"model": {n: t.contiguous() for n, t in model.items()}, "optim": optim}
    os.makedirs(out_dir, exist_ok=True)
    dcp.save(sd, storage_writer=FileSystemWriter(out_dir), no_dist=True)


@torch.no_grad()  # the sources' tensors may require grad (DeepSpeed saves params so)
def to_dcp(src: Source, out_dir: str) -> list[str]:
    """Write checkpoint ``src`` as a DCP directory ``out_dir`` (module docstring). One process, no ranks needed.
    Returns the paths written."""
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, float] = {}
    hyper: dict[str, dict] = {}
    groups, hypers = src.groups(), src.hyper()
    if len(groups) != len(hypers):
        raise CheckpointError(f"{src.path}: {len(groups)} param groups, hyper-parameters of {len(hypers)}")
    for names, group in zip(groups, hypers):
        for name in names:
            lacking = [k for k in MOMENTS if not src.has(name, k)]
            if lacking:
                keys = [k for k in ("params", "master", *MOMENTS) if src.has(name, k)]
                raise CheckpointError(f"{src.path}: param {name!r} has states {keys}, DCP's AdamW needs {lacking} too")
            shape = src.shapes[name]
            model[name] = full(src, name, "master").view(shape)
            moments[name] = {k: full(src, name, k).view(shape) for k in MOMENTS}
            steps[name] = src.step(name)
            hyper[name] = {k: (tuple(group[k]) if k == "betas" else group[k]) for k in HYPER}
    for name, t in {**src.buffers(), **src.frozen()}.items():
        model.setdefault(name, t.clone())
    write_dcp(out_dir, model, moments, steps, hyper)
    return sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir))


__all__ = ["ADAMW_FLAGS", "to_dcp", "write_dcp"]
