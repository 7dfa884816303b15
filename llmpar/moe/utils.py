"""``deepspeed.moe.utils`` for DeepSpeed scripts: which parameters are experts', and the optimizer parameter groups
that keep them apart.

    from llmpar.moe.utils import split_params_into_different_moe_groups_for_optimizer
    groups = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "dense"})
    optimizer = torch.optim.AdamW(groups)

An expert parameter is one with ``allreduce == False`` (as DeepSpeed tags them; :class:`llmpar.moe.layer.MoE`'s
experts are) or one of llmpar's experts (``expert_parallel == True``, :class:`llmpar.moe.MoEBlock`); its group name
is ``param.group_name`` (``"ep_size_<ep>"``). The split puts, for each input group and each expert group name, the
expert parameters in a new group ``{**group, "name": group_name, "moe": True}``, cut into groups of at most
``max_group_size`` elements, appended after the input groups (which keep their other parameters), as DeepSpeed does.
A DeepSpeed-compatibility module: nothing inside llmpar imports it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from llmpar.moe.block import MoEBlock
from llmpar.moe.layer import MoE


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether ``m`` holds an MoE layer, the expert count of the first one)."""
    for module in m.modules():
        if isinstance(module, (MoE, MoEBlock)):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    return (hasattr(param, "allreduce") and not param.allreduce) or bool(getattr(param, "expert_parallel", False))


def _group_name(param: torch.Tensor) -> str:
    name = getattr(param, "group_name", None)
    return name if name is not None else f"ep_size_{getattr(param, 'ep_size', 1)}"


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the non-expert gradients, the expert gradients), each cast to its parameter's dtype; no-grad params skipped."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: "dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]]",
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """See the module docstring. Each input group needs a ``"name"``; its ``"params"`` may be any iterable."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups must be a dict, a list or a tuple of dicts, got {type(param_groups).__name__}")
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group or "name" not in group:
            raise ValueError(f"param_groups[{i}] must be a dict with 'params' and 'name' (DeepSpeed's), got {group!r}")
        group["params"] = list(group["params"])
    names = sorted({_group_name(p) for g in param_groups for p in g["params"] if is_moe_param(p)})
    moe: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for group in param_groups:
        for name in names:
            moe[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        kept = []
        for p in group["params"]:
            if is_moe_param(p):
                moe[group["name"]][_group_name(p)]["params"].append(p)
            else:
                kept.append(p)
        group["params"] = kept
    for by_name in moe.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            chunks: list[list[nn.Parameter]] = []
            current: list[nn.Parameter] = []
            size = 0
            for p in group["params"]:
                n = int(getattr(p, "ds_numel", p.numel()))
                if size + n <= max_group_size:
                    current.append(p)
                    size += n
                else:
                    chunks.append(current)
                    current, size = [p], n
            if current:
                chunks.append(current)
            param_groups += [{**group, "params": chunk} for chunk in chunks]
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]] | list:
    """Parameters (a list of parameters, or of groups) -> groups with the experts apart (unchanged when a group
    already says ``"moe"``)."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(f"the optimizer's params must be tensors or dicts, got {type(p).__name__}")
    if not model_parameters:
        return model_parameters
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]
