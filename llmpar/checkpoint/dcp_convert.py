"""An llmpar checkpoint as a ``torch.distributed.checkpoint`` directory FSDP2 loads (``dcp_format.write_dcp``).

    to_dcp("ckpts", "out_dcp")                # ckpts/latest; or a checkpoint directory; tag= another one
    # FSDP2 side (any number of ranks): model fully_shard-ed, torch AdamW with the same hyper-parameters
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd = {"model": msd, "optim": osd}; dcp.load(sd, checkpoint_id="out_dcp")
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=...)

Every rank file is verified first (sizes and block hashes). The weights written are the fp32 masters when the run kept
them (else the params as saved), whole (tensor-parallel ones concatenated, padding dropped), with Adam's
``exp_avg`` / ``exp_avg_sq`` and step of every trained param, and each param's group's lr, betas, eps and
weight_decay; module buffers and frozen params go with the model's tensors. A checkpoint without Adam moments (a
plain SGD run) is an error naming the state keys it has.
"""

from __future__ import annotations

import os

import torch

from llmpar.checkpoint import files, metacheck
from llmpar.checkpoint.dcp_format import MOMENTS, write_dcp
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.reshard import CheckpointReader


def to_dcp(src: str, out_dir: str, tag: str | None = None) -> str:
    """Write llmpar checkpoint ``src`` (a checkpoint directory, or a save directory with ``latest`` / ``tag``) as a
    DCP directory ``out_dir`` (module docstring). One process, no ranks needed. Returns ``out_dir``."""
    src = os.fspath(src)
    ckpt = src if tag is None and os.path.isfile(os.path.join(src, files.METADATA)) else files.resolve(src, tag)[1]
    meta = metacheck.read(ckpt)
    reader = CheckpointReader(ckpt, meta)
    for fname in sorted(meta["files"]):
        why = reader.files.check(fname, full=True)
        if why is not None:
            raise CheckpointError(f"checkpoint shard {os.path.join(ckpt, fname)} is {why}")
    buffers = meta["layout"]["buffers"]
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, float] = {}
    hyper: dict[str, dict] = {}
    for name, (bi, _, _) in reader.where.items():
        keys = buffers[bi]["state_keys"]
        lacking = [k for k in MOMENTS if k not in keys]
        if lacking:
            raise CheckpointError(f"{ckpt}: param {name!r} has states {keys}, DCP's AdamW needs {lacking} too")
        model[name] = reader.full(name, "master" if "master" in keys else "params").float().clone()
        moments[name] = {k: reader.full(name, k).float().clone() for k in MOMENTS}
        steps[name] = reader.step(name)
        group = meta["param_groups"][int(buffers[bi].get("group", 0))]
        hyper[name] = {k: (tuple(v) if k == "betas" else v) for k, v in group.items()}
    for name, t in reader.extras(reader.tp, 0).items():
        model.setdefault(name, t.clone())
    write_dcp(out_dir, model, moments, steps, hyper)
    return out_dir


__all__ = ["to_dcp"]
