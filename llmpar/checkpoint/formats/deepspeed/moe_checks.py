"""The checks of a DeepSpeed MoE checkpoint's files against each other and against the loading model (``moe.py``
reads the checkpoint; ``ck`` below is its reader, :class:`moe.DeepSpeedMoECheckpoint`)."""

from __future__ import annotations

import re
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError

# a legacy MoE layer's expert param: (layer prefix, expert index, the rest of the name)
LOCAL_RE = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..+)$")
SAMPLE = 16  # elements of each expert's master compared with its expert file at each end


def check_files(ck: Any) -> None:
    """Each layer's expert files are its ``E_local ep`` experts' (module docstring)."""
    layers = sorted({layer for layer, _ in ck.expert_ids})
    prefixes = list(ck.per_rank)  # layers in module order: DeepSpeed numbers its files so
    if len(layers) != len(prefixes) or layers != list(range(len(layers))):
        raise CheckpointError(
            f"{ck.path}: expert files of MoE layers {layers}, but the optimizer holds the experts of "
            f"{len(prefixes)} layers ({[p.split('.deepspeed_moe')[0] for p in prefixes]})"
        )
    counts = ck.model.get("num_experts")
    for layer, prefix in zip(layers, prefixes):
        want = ck.per_rank[prefix] * ck.ep_of[prefix]
        have = sorted(e for l_, e in ck.expert_ids if l_ == layer)
        missing = [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for e in range(want) if e not in have]
        if missing:
            raise CheckpointError(
                f"{ck.path} lacks expert files {missing[:4]}{' ...' if len(missing) > 4 else ''}: MoE layer "
                f"{layer} ({prefix.split('.deepspeed_moe')[0]}) has {want} experts ({ck.per_rank[prefix]} per "
                f"ep rank x ep={ck.ep_of[prefix]}, from the optimizer files)"
            )
        if have != list(range(want)):
            raise CheckpointError(
                f"{ck.path}: MoE layer {layer} ({prefix.split('.deepspeed_moe')[0]}) has expert files of "
                f"experts {have}, but {want} experts ({ck.per_rank[prefix]} per ep rank x "
                f"ep={ck.ep_of[prefix]}) by its optimizer files: files of another save?"
            )
        if isinstance(counts, list) and layer < len(counts) and counts[layer] != want:
            raise CheckpointError(
                f"{ck.path}: num_experts {counts} of the model states file, but {want} experts of MoE layer "
                f"{layer} in its expert and optimizer files"
            )
        first = ck.expert_file(layer, 0)
        if not all(n.startswith(f"{prefix}0.") for n in first):
            raise CheckpointError(
                f"{ck.path}: layer_{layer}_expert_0_mp_rank_00_model_states.pt holds {sorted(first)[:2]}, "
                f"not the experts of {prefix.split('.deepspeed_moe')[0]} (the {layer}th MoE layer)"
            )
    ck.layer_of = dict(zip(prefixes, layers))
    for gname in ck.xwhere:
        if gname not in ck.shapes:  # no ZeRO: the shapes of the expert files
            layer, e = ck.expert_of(gname)
            t = ck.expert_file(layer, e).get(gname)
            if t is None:
                raise CheckpointError(
                    f"{ck.path}: layer_{layer}_expert_{e}_mp_rank_00_model_states.pt has no {gname!r}"
                )
            ck.shapes[gname] = tuple(t.shape)


def check_experts(ck: Any) -> None:
    """Each expert's fp32 master, at both ends, equals (in the weights' dtype) its expert file's weights (ZeRO 1-2:
    without ZeRO the expert files are the masters)."""
    if ck.stage == 0:
        return
    for gname in ck.xwhere:
        layer, e = ck.expert_of(gname)
        w = ck.expert_file(layer, e)[gname].reshape(-1)
        n = w.numel()
        for lo, hi in {(0, min(n, SAMPLE)), (max(0, n - SAMPLE), n)}:
            if not torch.equal(ck.read(gname, "master", lo, hi).to(w.dtype), w[lo:hi]):
                raise CheckpointError(
                    f"{ck.path}: the fp32 master of expert param {gname!r} (elements [{lo}, {hi})) differs "
                    f"from layer_{layer}_expert_{e}_mp_rank_00_model_states.pt: optimizer files of another save, "
                    "or swapped between ranks"
                )


def fits(ck: Any, names: list[str]) -> None:
    """A CheckpointError when a model whose trained params are ``names`` (experts under their global index, as
    an ep=1 model names them) has another expert count in one of the checkpoint's MoE layers."""
    here: dict[str, int] = {}
    for n in names:
        m = LOCAL_RE.match(n)
        if m is not None:
            here[m.group(1)] = max(here.get(m.group(1), 0), int(m.group(2)) + 1)
    for p, k in ck.per_rank.items():
        want = k * ck.ep_of[p]
        if p in here and here[p] != want:
            layer = p.split(".deepspeed_moe.")[0]
            raise CheckpointError(
                f"MoE layer {layer!r} has {want} experts in DeepSpeed checkpoint {ck.path} (files "
                f"layer_{ck.layer_of[p]}_expert_0 .. {want - 1}_mp_rank_00_model_states.pt, written at "
                f"ep={ck.ep_of[p]}) but {here[p]} in this model: build it with num_experts={want}"
            )


__all__ = ["LOCAL_RE", "SAMPLE", "check_experts", "check_files", "fits"]
