"""Expert tensor parallelism: each expert's intermediate dimension split over an expert-tp group of ``etp`` ranks.

As Megatron-Core's ``expert_tensor_parallel_size``: an expert ``y = (silu(x G^T) * (x U^T)) D^T`` with
``G, U: [I, H]`` and ``D: [H, I]`` is split over the ``etp`` ranks of its expert-tp group along ``I``, ``G`` and
``U`` by rows (column-parallel), ``D`` by columns (row-parallel). Rank ``t`` holds ``I_t = I / etp`` rows
``[t I_t, (t + 1) I_t)``; SwiGLU is elementwise along ``I``, so rank ``t`` computes the partial
``y_t = (silu(x G_t^T) * (x U_t^T)) D_t^T`` and ``y = sum_t y_t`` (one sum all-reduce over the expert-tp group).
In the packed layout (:mod:`llmpar.moe.experts`) a rank's shards are::

    gate_up_proj: [E_local, 2 I / etp, H]   rows [0, I_t) its gate rows, rows [I_t, 2 I_t) its up rows
    down_proj:    [E_local, H, I / etp]

The ranks of one expert-tp group see the same tokens: they sit at the same expert-parallel rank, the dispatch happens
over the expert-parallel group, and each one passes the same input (they are the attention's tensor-parallel ranks,
which hold replicated activations). The tokens enter the experts through ``copy_to_tensor_region`` (the backward
all-reduces the partial input gradients over the group) and leave through ``reduce_from_tensor_region`` (the forward
sums the partial outputs), :mod:`llmpar.tensor_parallel.comm`'s autograd collectives. Each shard's gradient is then
the full gradient of that slice; parameters outside the experts are replicated over the group.

:func:`expert_parallel_groups` builds the ep and etp groups over the whole job with etp innermost (the expert-tp peers
are neighbouring ranks, as tp's are): rank ``r`` has ``etp_rank = r % etp``, ``ep_rank = (r // etp) % ep`` and the
remaining ``world / (ep etp)`` is the expert-data-parallel degree.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from llmpar.distributed import check_same_on_ranks


def check_expert_tp(intermediate_size: int, etp: int) -> None:
    """Refuse an ``intermediate_size`` that the ``etp`` ranks of an expert-tp group cannot split evenly."""
    if intermediate_size % etp:
        raise ValueError(
            f"intermediate_size={intermediate_size} is not divisible by the expert-tensor-parallel size etp={etp}: "
            f"each rank of the expert-tp group holds intermediate_size / etp columns of every expert (use a multiple "
            f"of {etp}, or another etp)"
        )


def shard_intermediate(
    gate_up: torch.Tensor, down: torch.Tensor, etp: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shards of packed experts: ``gate_up: [E, 2I, H]``, ``down: [E, H, I]`` ->
    ``([E, 2I/etp, H], [E, H, I/etp])`` (module docstring), new contiguous tensors."""
    i = down.shape[-1]
    check_expert_tp(i, etp)
    if gate_up.shape[-2] != 2 * i:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} does not match down {tuple(down.shape)}: expected 2I={2 * i}")
    n, lo = i // etp, rank * (i // etp)
    gu = torch.cat([gate_up[..., lo : lo + n, :], gate_up[..., i + lo : i + lo + n, :]], dim=-2)
    return gu.contiguous(), down[..., lo : lo + n].contiguous()


def merge_intermediate(
    gate_ups: Sequence[torch.Tensor], downs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`shard_intermediate`: the ``etp`` ranks' shards (in expert-tp rank order) -> the whole
    ``([E, 2I, H], [E, H, I])``."""
    if not gate_ups or len(gate_ups) != len(downs):
        raise ValueError(
            f"expected one gate_up and one down shard per expert-tp rank, got {len(gate_ups)} / {len(downs)}"
        )
    n = downs[0].shape[-1]
    gates = [g[..., :n, :] for g in gate_ups]
    ups = [g[..., n:, :] for g in gate_ups]
    return torch.cat(gates + ups, dim=-2), torch.cat(list(downs), dim=-1)


def merge_packed(parts: Sequence[torch.Tensor], layout: str) -> torch.Tensor:
    """One packed expert tensor whole from its ``etp`` shards (in expert-tp rank order): ``layout`` "gate_up":
    ``[E, 2I/etp, H]`` each (its gate rows, then its up rows) -> ``[E, 2I, H]`` (every shard's gate rows in order,
    then the up rows); "down": ``[E, H, I/etp]`` -> ``[E, H, I]``."""
    if layout == "down":
        return torch.cat(list(parts), dim=-1)
    if layout != "gate_up":
        raise ValueError(f"layout={layout!r} is not one of gate_up, down")
    n = parts[0].shape[-2] // 2
    return torch.cat([t[..., :n, :] for t in parts] + [t[..., n:, :] for t in parts], dim=-2)


def shard_packed(full: torch.Tensor, layout: str, etp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of one whole packed expert tensor (the inverse of :func:`merge_packed`), contiguous:
    "gate_up" ``[E, 2I, H]`` -> ``[E, 2I/etp, H]``, "down" ``[E, H, I]`` -> ``[E, H, I/etp]``."""
    if layout == "down":
        i = full.shape[-1]
        check_expert_tp(i, etp)
        n = i // etp
        return full[..., rank * n : (rank + 1) * n].contiguous()
    if layout != "gate_up":
        raise ValueError(f"layout={layout!r} is not one of gate_up, down")
    i = full.shape[-2] // 2
    check_expert_tp(i, etp)
    n, lo = i // etp, rank * (i // etp)
    return torch.cat([full[..., lo : lo + n, :], full[..., i + lo : i + lo + n, :]], dim=-2).contiguous()


class ExpertGroups(NamedTuple):
    """This rank's groups from :func:`expert_parallel_groups` (None where the degree is 1) and its coordinates."""

    ep_group: dist.ProcessGroup | None
    etp_group: dist.ProcessGroup | None
    ep_rank: int
    etp_rank: int


def expert_parallel_groups(ep: int, etp: int) -> ExpertGroups:
    """The expert-parallel and expert-tensor-parallel groups over the whole job, etp innermost (module docstring).

    ``ep * etp`` must divide the world size (the rest is expert-data-parallel). A collective: every rank calls it
    with the same degrees (checked first, so that a rank passing other degrees gets an error rather than a hang)."""
    world, me = dist.get_world_size(), dist.get_rank()
    check_same_on_ranks(
        repr((ep, etp)),
        dist.group.WORLD,  # type: ignore[arg-type]  # set once torch.distributed is initialized
        what="expert_parallel_groups(ep, etp)",
        hint="pass the same degrees on every rank",
    )
    for name, value in (("ep", ep), ("etp", etp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if world % (ep * etp):
        raise ValueError(
            f"ep*etp = {ep}*{etp} = {ep * etp} does not divide the world size {world}: the ranks are "
            "edp x ep x etp (choose degrees whose product divides the world size)"
        )

    def partition(key: int) -> dist.ProcessGroup | None:
        parts: dict[tuple[int, int], list[int]] = {}
        for r in range(world):
            t, p, d = r % etp, (r // etp) % ep, r // (etp * ep)
            parts.setdefault((d, t) if key == 0 else (d, p), []).append(r)
        mine = None
        for ranks in sorted(parts.values()):
            group = dist.new_group(ranks)  # every rank creates every group, in one order
            if me in ranks:
                mine = group
        return mine

    ep_group = partition(0) if ep > 1 else None
    etp_group = partition(1) if etp > 1 else None
    return ExpertGroups(ep_group, etp_group, (me // etp) % ep, me % etp)


__all__ = [
    "ExpertGroups",
    "check_expert_tp",
    "expert_parallel_groups",
    "merge_intermediate",
    "merge_packed",
    "shard_intermediate",
    "shard_packed",
]
