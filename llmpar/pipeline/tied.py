"""Parameters shared between pipeline stages (a tied embedding / head): which copy this rank holds, and keeping the
copies' gradients equal.

Every stage holding a copy computes a partial gradient; each copy must receive their sum over the pp group, so that
the copies, stepped by their stages' optimizers on the same gradient, stay equal. The gradient norm counts such a
weight once: the copy on the lowest stage counts, the others are the *duplicates* it skips.

With ZeRO (:func:`sync_tied_zero`) the reduced gradient of a copy is spread over its stage's dp ranks in slices that
differ between stages (their flat layouts differ), so each rank writes its slices into a zero vector of the full
size, sums it over pp and then over dp (stages 1/2: each element lives on one dp rank per stage), and reads its
slices back.

This module knows the runner and the optimizer only by the attributes it reads (no import of either).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpar.distributed.collectives import Group, all_reduce, group_size

Tied = list[tuple[nn.Parameter | None, int]]  # per shared parameter: this rank's copy (or None) and its numel


def resolve_tied(split: Any, device: torch.device) -> tuple[Tied, list[nn.Parameter]]:
    """(per shared parameter of ``split.tied``: this rank's copy or None and its numel agreed over pp, this rank's
    copies that are not on the lowest stage holding the parameter). Collective over the pp group when any is tied."""
    local: list[nn.Parameter | None] = []
    duplicates: list[nn.Parameter] = []
    for where in split.tied:
        p = None
        for s, name in sorted(where.items()):
            if s in split.stage_indices:
                p = split.modules[split.stage_indices.index(s)].get_parameter(name)
                if s != min(where):
                    duplicates.append(p)  # counted once, on the lowest stage, by the grad norm
                break
        local.append(p)
    if not local:
        return [], duplicates
    big = 2**62
    sizes = torch.tensor(
        [[p.numel() if p is not None else 0 for p in local], [-p.numel() if p is not None else -big for p in local]],
        dtype=torch.int64,
        device=device,
    )
    all_reduce(sizes, split.pp_group, op="max")  # row 0: largest copy, row 1: -(smallest copy)
    for where, hi, lo in zip(split.tied, sizes[0].tolist(), sizes[1].tolist()):
        if hi != -lo:
            raise ValueError(
                f"the shared parameter {where} has copies of {-lo} and {hi} elements on different "
                "stages: tie only parameters that every stage splits alike (same tp plan kind)"
            )
    return list(zip(local, sizes[0].tolist())), duplicates


def set_grad(p: nn.Parameter, flat: torch.Tensor) -> None:
    """``p.grad`` takes the values of ``flat`` (``[p.numel()]``), allocated in ``p``'s dtype when missing."""
    if p.grad is None:
        p.grad = flat.view_as(p).to(p.dtype).clone()
    else:
        p.grad.copy_(flat.view_as(p.grad))


@torch.no_grad()
def sync_tied_grads(tied: Tied, pp_group: Group, device: torch.device) -> None:
    """Every copy's ``.grad`` becomes the sum over pp of the copies' grads (float64 on every rank: stages without a
    copy send zeros)."""
    if not tied:
        return
    flat = torch.cat(
        [
            (
                p.grad.reshape(-1).double()
                if p is not None and p.grad is not None
                else torch.zeros(n, device=device, dtype=torch.float64)
            )
            for p, n in tied
        ]
    )
    all_reduce(flat, pp_group)
    offset = 0
    for p, n in tied:
        if p is not None:
            set_grad(p, flat[offset : offset + n])
        offset += n


@torch.no_grad()
def sync_tied_zero(runner: Any, opt: Any) -> None:
    """Reduce the grads over dp (``opt.reduce_gradients()``), then give every copy of each tied weight the sum over
    pp of the copies' reduced gradients, inside ZeRO's shards (module docstring). ``runner``: a PipelineRunner;
    ``opt``: the ZeroOptimizer over its parameters."""
    opt.reduce_gradients()
    if not runner._tied:
        return
    flat = torch.zeros(sum(n for _, n in runner._tied), dtype=torch.float64, device=runner.device)
    pieces: list[tuple[torch.Tensor, int]] = []
    offset = 0
    for p, n in runner._tied:
        if p is not None:
            for view, a, z in opt.grad_pieces(p):
                flat[offset + a : offset + z] = view.to(flat.dtype)
                pieces.append((view, offset + a))
        offset += n
    all_reduce(flat, runner.split.pp_group)
    if opt.stage > 0 and group_size(opt.dp_group) > 1:
        all_reduce(flat, opt.dp_group)
    for view, at in pieces:
        view.copy_(flat[at : at + view.numel()])


__all__ = ["Tied", "resolve_tied", "set_grad", "sync_tied_grads", "sync_tied_zero"]
