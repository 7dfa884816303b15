"""Expert parameters under ZeRO: reduced and sharded over the expert-data-parallel ranks, the rest over dp.

A mixture-of-experts layer over an expert-parallel group of ``ep`` ranks (``llmpar.moe``) holds a different slice of
the experts on each ep rank; its expert params are tagged ``param.expert_parallel = True``. Of the ``dp`` ranks ZeRO
runs over (dp x cp under context parallelism), the ``edp = dp / ep`` ranks that hold the same experts form the
expert-data-parallel group (``ParallelDims.group("edp")``). ``ZeroOptimizer(..., expert_group=edp_group,
ep_group=ep_group)`` puts the tagged params in a second ZeroOptimizer over ``edp_group`` (same stage, offload and
state precision), built and driven by the first:

- gradients: a dense param's grad is averaged over dp as usual. An expert's grad on its holder already sums the
  contributions of the tokens of every rank of its ep group (the all-to-all carries them back), so it is summed over
  edp and divided by ``dp = edp * ep``: the mean over all dp ranks' losses, as for the dense params;
- clipping: one global norm, ``sqrt(|g_dense|^2 + sum_ep |g_experts|^2)``: the dense part summed over dp (tp, pp as
  usual), the expert part over edp (each holder's partition once), then over ep (each expert slice once); experts
  replicated over tp are not summed over tp. Both steps use the same coefficient and skip together;
- expert tensor parallelism (``llmpar.moe.expert_tp``: each expert's intermediate dimension split over an etp group,
  ``etp_group=``): the ranks holding the same shard are the edp ranks of one etp coordinate, so the reduction above is
  already over them only; the expert part of the norm is then also summed over etp (each distinct shard once), the
  router and shared experts (replicated over etp) stay in the dense part, counted once. :func:`merge_etp` rejoins a
  packed shard into the whole experts (``consolidated_state_dict``);
- a rank whose experts received no tokens still runs the experts (on zero rows): their zero grads are reduced and
  every collective of both optimizers runs on every rank.

``step()``, ``zero_grad()``, the accumulation boundary and ``wait_params()`` of the dense optimizer drive the expert
one (``step.py``); the learning rate and the other hyper-parameters of each param group follow the dense optimizer's
group, so an LR scheduler over ``optimizer.param_groups`` moves both.
"""

from __future__ import annotations

from typing import Any

import torch

from llmpar.distributed.collectives import CommCounter, GroupRef, all_gather_flat, all_reduce, group_size
from llmpar.zero.config import _GROUP_KEYS

EXPERT_ATTR = "expert_parallel"


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` holds experts of an expert-parallel layer (reduced over the expert-data-parallel group): tagged
    ``expert_parallel`` (llmpar's layers), or ``allreduce = False`` as DeepSpeed tags an expert param."""
    return bool(getattr(p, EXPERT_ATTR, False)) or getattr(p, "allreduce", True) is False


def expert_ep_size(p: torch.Tensor) -> int:
    """The ep degree ``p``'s experts are spread over: its ``ep_size`` tag, else DeepSpeed's ``group_name``
    (``"ep_size_<ep>"``), else 1."""
    if hasattr(p, "ep_size"):
        return int(p.ep_size)
    name = str(getattr(p, "group_name", ""))
    return int(name[len("ep_size_") :]) if name.startswith("ep_size_") and name[len("ep_size_") :].isdigit() else 1


def split_expert_groups(groups: list[dict]) -> tuple[list[dict], list[dict], list[int]]:
    """``(dense groups, expert groups, index of each expert group's dense group)`` of normalised param groups
    (``config.param_groups``): each group's params split by :func:`is_expert`; a group keeps its hyper-parameters
    on both sides; expert groups without params are left out."""
    dense, experts, owner = [], [], []
    for gi, g in enumerate(groups):
        hyper = {k: g[k] for k in _GROUP_KEYS}
        pairs = list(zip(g["names"], g["params"]))
        mine = [(n, p) for n, p in pairs if is_expert(p)]
        rest = [(n, p) for n, p in pairs if not is_expert(p)]
        dense.append({**g, "params": [p for _, p in rest], "names": [n for n, _ in rest]})
        if mine:
            experts.append({"params": mine, **hyper})
            owner.append(gi)
    return dense, experts, owner


def refuse_spread_experts(groups: list[dict]) -> None:
    """Params holding experts spread over ep > 1 ranks, given to a ZeroOptimizer without ``expert_group``: a
    ValueError naming them (the dp reduction would average different experts' gradients). Same on every rank."""
    spread = [
        (n, expert_ep_size(p))
        for g in groups
        for n, p in zip(g["names"], g["params"])
        if is_expert(p) and expert_ep_size(p) > 1
    ]
    if spread:
        names = ", ".join(n for n, _ in spread[:3]) + (f" and {len(spread) - 3} more" if len(spread) > 3 else "")
        raise ValueError(
            f"{names} hold experts spread over ep={spread[0][1]} ranks (expert_parallel) but no expert_group= was "
            "given: reducing them over dp would average different experts; pass expert_group=ParallelDims(ep=...)"
            '.group("edp") and ep_group=...group("ep") (llmpar.initialize does with an "expert_parallel" block)'
        )


def check_expert_groups(dp_group: Any, expert_group: Any, ep_group: Any) -> None:
    """``dp == edp * ep`` (the sizes of the groups), checked locally before any collective."""
    dp, edp = group_size(dp_group), group_size(expert_group)
    ep = group_size(ep_group) if ep_group is not None else 1
    if edp * ep != dp:
        raise ValueError(
            f"expert_group has {edp} ranks and ep_group {ep}, but dp_group has {dp}: the expert-data-parallel and "
            "expert-parallel groups must fold the data-parallel ranks (edp * ep == dp; ParallelDims(ep=...)"
            '.group("edp") / .group("ep"))'
        )


def joint_norm(
    dense: torch.Tensor,
    experts: torch.Tensor,
    ep_group: GroupRef | None,
    counter: CommCounter | None,
    etp_group: GroupRef | None = None,
) -> torch.Tensor:
    """``sqrt(dense^2 + sum over ep x etp of experts^2)``, float64 0-d on every rank: ``dense`` the dense params'
    global norm, ``experts`` the norm of this rank's expert shards (already summed over edp). A collective over
    ``ep_group`` and ``etp_group`` (each distinct expert shard once)."""
    sq = (experts.double() ** 2).reshape(1).to(dense.device)
    for group in (ep_group, etp_group):
        if group is not None and group_size(group) > 1:
            all_reduce(sq, group, counter=counter)
    return (dense.double() ** 2 + sq[0]).sqrt()


ETP_LAYOUT = "etp_layout"  # "gate_up" / "down" on packed expert shards split over an etp group


def merge_etp(value: torch.Tensor, layout: str, etp_group: Any) -> torch.Tensor:
    """The whole packed experts from this rank's shard, all-gathered over ``etp_group`` (a collective over it):
    ``layout`` "gate_up": shards ``[E, 2I/etp, H]``, each its gate rows then its up rows -> ``[E, 2I, H]`` (every
    rank's gate rows in etp order, then the up rows); "down": ``[E, H, I/etp]`` -> ``[E, H, I]`` (``llmpar.moe.
    expert_tp.merge_intermediate``)."""
    etp = group_size(etp_group)
    flat = value.new_empty((etp * value.numel(),))
    all_gather_flat(flat, value.contiguous().reshape(-1), etp_group)
    parts = list(flat.view(etp, *value.shape).unbind(0))
    if layout == "down":
        return torch.cat(parts, dim=-1)
    if layout != "gate_up":
        raise ValueError(f"etp_layout={layout!r} is not one of gate_up, down")
    n = value.shape[-2] // 2
    return torch.cat([t[..., :n, :] for t in parts] + [t[..., n:, :] for t in parts], dim=-2)


def sync_hyperparameters(dense: Any, experts: Any) -> None:
    """Copy each param group's hyper-parameters (lr, betas, eps, weight decay) from the dense optimizer to the
    expert one (a scheduler changes the dense optimizer's groups)."""
    for eg, gi in zip(experts.param_groups, dense.expert_group_owner):
        for k in _GROUP_KEYS:
            eg[k] = dense.param_groups[gi][k]


__all__ = [
    "ETP_LAYOUT",
    "EXPERT_ATTR",
    "check_expert_groups",
    "expert_ep_size",
    "is_expert",
    "joint_norm",
    "merge_etp",
    "refuse_spread_experts",
    "split_expert_groups",
    "sync_hyperparameters",
]
