"""What ``initialize`` hands the optimizer: the user's ``model_parameters`` as param groups of ``(name, param)``
pairs named as in the model (``model.named_parameters()``; a bare ``model.parameters()`` keeps the model's names in
checkpoints), and, under a pipeline, those groups carried over to each stage's params by the unsplit model's names
(so they survive the stage split and tensor-parallel layers swapped in by it). DeepSpeed's group labels ``"name"`` and
``"moe"`` are dropped: the experts are found by their tags (``llmpar.zero.experts.is_expert``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpar.pipeline.blocks import stage_key, to_blocks


def named_groups(model: nn.Module, model_parameters: Any, *, strict: bool = False) -> list[dict]:
    """``model_parameters`` (params, (name, param) pairs or param-group dicts; None: all of the model's) as
    param-group dicts of (name, param) pairs; a bare param takes its name in ``model``. ``strict``: every tensor must
    be a param of ``model`` (after ``initialize`` swapped in tensor-parallel layers, a list made before is stale)."""
    if model_parameters is None:
        return [{"params": list(model.named_parameters())}]
    if isinstance(model_parameters, torch.Tensor):
        raise TypeError(
            "model_parameters must be an iterable of parameters, (name, parameter) pairs or param-group "
            "dicts, got a single tensor"
        )
    items = list(model_parameters)
    name_of: dict[int, str] = {}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for n, p in by_name.items():
        name_of.setdefault(id(p), n)  # a tied param: its first name, as checkpoints name it
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    out = []
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"model_parameters[{gi}] must be a param-group dict with a 'params' entry")
        named = []
        for k, item in enumerate(g["params"]):
            p = item[1] if isinstance(item, tuple) else item
            if strict and isinstance(p, torch.Tensor) and id(p) not in name_of:
                if isinstance(item, tuple) and item[0] in by_name:  # replaced by the split: the new param of that name
                    item = (item[0], by_name[item[0]])
                else:
                    raise ValueError(
                        f"model_parameters group {gi} item {k} is not a param of the model: "
                        "llmpar.initialize split the model over the tensor_parallel block, replacing its "
                        "layers; pass (name, param) pairs or a generator (model.parameters()), or "
                        "parallelize the model yourself first and pass mesh="
                    )
            if isinstance(item, tuple):
                named.append(item)
            elif isinstance(item, torch.Tensor):
                named.append((name_of.get(id(item), f"group{gi}.param{k}"), item))
            else:
                raise TypeError(f"model_parameters group {gi} item {k} is a {type(item).__name__}, not a tensor")
        marks = ("name", "moe")  # DeepSpeed's group labels (split_params_into_different_moe_groups_for_optimizer)
        out.append({**{k: v for k, v in g.items() if k not in marks}, "params": named})
    return out


def unsplit_names(module: nn.Module, stage_named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{``stage{s}.{local name}``: name in the unsplit ``module``} for the given stage params / buffers: the blocks of
    ``to_blocks`` hold the model's own submodules, so a stage-local name maps through its block to the model's name
    (a tensor the split replaced, e.g. by a tensor-parallel layer, keeps its block's name)."""
    by_id: dict[int, str] = {}
    for kind in ("named_parameters", "named_buffers"):
        for n, t in getattr(module, kind)(remove_duplicate=False):
            by_id.setdefault(id(t), n)
    block_names: dict[str, str] = {}  # "blocks_3.attn.qkv.weight" -> "blocks.3.attn.qkv.weight"
    for bname, block in to_blocks(module):
        for kind in ("named_parameters", "named_buffers"):
            for n, t in getattr(block, kind)(remove_duplicate=False):
                block_names[f"{stage_key(bname)}.{n}"] = by_id.get(id(t), f"{bname}.{n}")
    out = {}
    for name, _ in stage_named:
        local = name.split(".", 1)[1]
        out[name] = block_names.get(local, local)
    return out


def canonical_names(model: nn.Module) -> dict[str, str]:
    """{every name of a param in ``model``: its first name} (a tied weight has several)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def stage_groups(
    groups: list[dict], stage_named: list[tuple[str, torch.Tensor]], names: dict[str, str], canonical: dict[str, str]
) -> list[dict]:
    """The user's ``groups`` (of the unsplit model's (name, param)) over this pipeline rank's ``stage_named`` params
    (``names``: stage name -> unsplit name; ``canonical``: any name of a param -> its first name, taken before the
    split). Every group is kept, empty or not, so all pp ranks have the same groups."""
    group_of = {canonical.get(n, n): gi for gi, g in enumerate(groups) for n, _ in g["params"]}
    out = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
    for stage_name, p in stage_named:
        model_name = canonical.get(names.get(stage_name, stage_name), names.get(stage_name, stage_name))
        if model_name not in group_of and p.requires_grad:
            raise ValueError(
                f"model_parameters leaves out {model_name!r}: under a pipeline every trainable param "
                "must be in one of the groups"
            )
        out[group_of.get(model_name, 0)]["params"].append(p)  # a frozen param left out: held, never stepped
    return out


__all__ = ["canonical_names", "named_groups", "stage_groups", "unsplit_names"]
