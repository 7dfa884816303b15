"""Experts split over an expert-tensor-parallel group in llmpar's checkpoints: written as shards, read whole.

A model built with ``MoEBlock(etp_group=...)`` (``llmpar.moe.expert_tp``) holds on etp rank ``t`` of ep rank ``r``
the shards ``gate_up_proj: [E_local, 2I/etp, H]`` (its gate rows, then its up rows) and ``down_proj: [E_local, H,
I/etp]`` of the experts ``[r E_local, (r + 1) E_local)``; the live params carry ``etp_layout`` ("gate_up" / "down").
The ep ranks' shards of one etp rank stacked in ep order are ``S_t: [E, 2I/etp, H]`` / ``[E, H, I/etp]``, and a
rank's rows of them are again a contiguous element range, so each rank writes its partition of the expert optimizer
(params, fp32 master, moments) as ``(name@etp{t}, start, stop)`` pieces of ``S_t`` (:func:`shard_name`) and lists
the param under its global name with its *whole* shape and ``"etp": {"size", "layout"}``. Reading merges:

    whole = merge_packed([S_0, ..., S_{etp-1}], layout)        (``llmpar.moe.expert_tp``: gate rows, then up rows)

so ``ExpertIndex`` serves the global tensor ``[E, 2I, H]`` / ``[E, H, I]`` by element range exactly as for a
checkpoint written without etp: a load at etp=1 (any ep), ``consolidate`` and the converters see whole experts; a
load at etp > 1 reads its ep rank's rows of the whole tensor and cuts its shard (:func:`cut`), from a checkpoint of
any etp (or none). Every read is a copy of saved values: weights and optimizer states come back bitwise. A saved
width (``I``) other than the model's is a shape mismatch naming the param. An older reader finds no pieces under the
global name and refuses the checkpoint rather than misplacing the shards.

Experts whole on every rank of a tp group (etp = 1 beside tensor-parallel attention) are the same rows on each tp
rank: only tp rank 0 writes them (:func:`replica`); a reader skips rows already read (checkpoints written before).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from llmpar.distributed.collectives import group_rank, group_size
from llmpar.moe.expert_tp import merge_packed, shard_packed

SEP = "@etp"
# the tag on packed expert shards split over etp (llmpar.zero.experts.ETP_LAYOUT; the checkpoint sees the optimizer
# through protocol.py only, so it names the tag, as it names "expert_index")
ETP_LAYOUT = "etp_layout"
CACHED = 4  # whole expert tensors kept by a reader between range reads (a load asks one unit's ranges per key)


def etp_side(opt: Any) -> tuple[int, int]:
    """``(etp rank, etp)`` of the dense optimizer ``opt`` (``(0, 1)`` without expert tensor parallelism)."""
    group = getattr(opt, "etp_group", None)
    if group is None or group_size(group) == 1:
        return 0, 1
    return group_rank(group), group_size(group)


def replica(engine: Any, xopt: Any) -> bool:
    """Whether this rank's experts are a copy of tp rank 0's (whole experts, none split over tp or etp, on a tp
    rank > 0): every tp rank holds the same rows, tp rank 0 writes them."""
    if engine.checkpoint_grid().tp_rank == 0 or etp_side(engine.optimizer)[1] > 1:
        return False
    return not any(getattr(p, "tensor_model_parallel", False) for buf in xopt.checkpoint_params() for _, p in buf)


def layout_of(p: Any) -> str | None:
    """ "gate_up" / "down" for a live packed expert shard split over etp, else None."""
    return getattr(p, ETP_LAYOUT, None)


def shard_name(name: str, t: int) -> str:
    """The name the pieces of etp rank ``t``'s shards of global param ``name`` are written under."""
    return f"{name}{SEP}{t}"


def _dim(layout: str) -> int:
    return -2 if layout == "gate_up" else -1


def whole_shape(local: tuple[int, ...], layout: str, ep: int, etp: int) -> tuple[int, ...]:
    """The global tensor's shape from a rank's shard ``local: [E_local, ...]`` split over ``ep`` x ``etp``."""
    out = [local[0] * ep, *local[1:]]
    out[_dim(layout)] *= etp
    return tuple(out)


def shard_shape(whole: tuple[int, ...], layout: str, etp: int) -> tuple[int, ...]:
    """``S_t``'s shape (module docstring) from the global tensor's."""
    out = list(whole)
    out[_dim(layout)] //= etp
    return tuple(out)


class WholeCache:
    """Whole tensors by key, the last :data:`CACHED` kept (reads of one tensor's ranges in a row cost one build)."""

    def __init__(self) -> None:
        self.items: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self.items:
            if len(self.items) >= CACHED:
                self.items.pop(next(iter(self.items)))
            self.items[key] = build()
        return self.items[key]


def merged(read: Callable[[int, int], torch.Tensor], whole: tuple[int, ...], layout: str, etp: int) -> torch.Tensor:
    """The whole global tensor ``whole`` from ``read(t, numel)``: ``S_t`` flat (module docstring)."""
    shape = shard_shape(whole, layout, etp)
    return merge_packed([read(t, math.prod(shape)).view(shape) for t in range(etp)], layout)


def cut(rows: torch.Tensor, layout: str, t: int, etp: int) -> torch.Tensor:
    """Etp rank ``t``'s shard of an ep rank's whole rows ``[E_local, 2I, H]`` / ``[E_local, H, I]``, flat."""
    return shard_packed(rows, layout, etp, t).reshape(-1)


__all__ = [
    "SEP",
    "WholeCache",
    "cut",
    "etp_side",
    "layout_of",
    "merged",
    "replica",
    "shard_name",
    "shard_shape",
    "whole_shape",
]
