"""Slots: the pieces every dispatcher shares (see :mod:`llmpar.moe.dispatch` for the seam).

Token t's j-th choice is slot ``t k + j``. :func:`plan_slots` sorts the slots by expert, stably (within an expert in
token order); with a capacity factor it first drops, per expert, the slots over ``C = ceil(capacity_factor * T k / E)``
of lowest routing weight (ties: the later slot goes); a routing whose router dropped slots itself
(``Routing.keep``) sends its kept slots only. :func:`combine_slots` undoes the sort and weighs in fp32::

    out_t = sum_{j = 0..k-1} w_tj * float(y_{t k + j})        (left to right, then cast to x's dtype)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from llmpar.moe.router import Routing, expert_counts
from llmpar.ops.moe_permute import permute_rows, unpermute_rows

STATUS_TEXT = {1: "its router produced non-finite logits (NaN or inf)", 2: "its input to the MoE layer was refused"}


@dataclass
class DispatchStats:
    """What one dispatch moved, for logs. ``sent``: this rank's kept slots per global expert ``[E]``; ``received``:
    rows per local expert after the exchange; ``dropped``: slots over capacity (0 when dropless). Under torch.compile
    int64 tensors (``[E]``, ``[E_local]``, ``[]``): a compiled dispatch reads nothing on the host."""

    sent: list[int] | torch.Tensor
    received: list[int] | torch.Tensor
    dropped: int | torch.Tensor


@dataclass
class DispatchMeta:
    """Opaque to callers (read ``stats`` only): what :meth:`Dispatcher.combine` needs to undo a dispatch."""

    order: torch.Tensor  # [N_kept] slot ids sorted by expert
    num_tokens: int
    top_k: int
    weights: torch.Tensor  # [T, k] fp32
    dtype: torch.dtype
    stats: DispatchStats
    extra: dict[str, Any] = field(default_factory=dict)  # the dispatcher's own (splits, permutation)


class PendingDispatch:
    """A dispatch whose token exchange may still be in flight; :meth:`wait` finishes it (once)."""

    def __init__(self, finish: Callable[[], "tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta]"]) -> None:
        self._finish: Callable[[], tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta]] | None = finish
        self._result: tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta] | None = None

    def wait(self) -> "tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta]":
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


def check_capacity_factor(capacity_factor: float | None) -> float | None:
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise TypeError(f"capacity_factor must be a number or None (dropless), got {type(capacity_factor).__name__}")
    if not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0, or None (dropless)")
    return float(capacity_factor)


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots one expert keeps of this rank's ``num_tokens * top_k``: ``ceil(capacity_factor * T k / E)``."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def plan_slots(
    routing: Routing, num_experts: int, capacity_factor: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order [N_kept], counts [E], dropped [])`` on the routing's device: the kept slot ids sorted by expert
    (stable), the kept slots per expert, and how many slots were dropped (see the module docstring)."""
    e = routing.indices.reshape(-1)
    n = e.numel()
    if routing.keep is not None:  # the router dropped slots itself: send the kept ones, in expert order
        if capacity_factor is not None:
            raise ValueError("a routing that drops slots itself (Routing.keep) takes no dispatcher capacity_factor")
        keep = routing.keep.reshape(-1)
        kept_counts = torch.bincount(e[keep], minlength=num_experts)
        key = torch.where(keep, e, torch.full_like(e, num_experts))
        order = torch.sort(key, stable=True).indices[: int(kept_counts.sum())]
        return order, kept_counts, n - kept_counts.sum()
    counts = expert_counts(e, num_experts)
    if capacity_factor is None:
        order = torch.sort(e, stable=True).indices
        return order, counts, counts.new_zeros(())
    cap = capacity(routing.indices.shape[0], routing.indices.shape[1], num_experts, capacity_factor)
    by_score = torch.sort(routing.weights.detach().reshape(-1), descending=True, stable=True).indices
    grouped = by_score[torch.sort(e[by_score], stable=True).indices]  # by expert, then weight (desc), then slot
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=e.device) - starts[e[grouped]]
    keep = torch.zeros(n, dtype=torch.bool, device=e.device)
    keep[grouped[rank_in_expert < cap]] = True
    kept_counts = counts.clamp(max=cap)
    key = torch.where(keep, e, torch.full_like(e, num_experts))  # dropped slots sort last, then are cut off
    order = torch.sort(key, stable=True).indices[: int(kept_counts.sum())]
    return order, kept_counts, (counts - kept_counts).sum()


def nonfinite_message(nonfinite: int, num_tokens: int, where: str) -> str:
    return (
        f"MoE router produced non-finite logits (NaN or inf) for {nonfinite} of {num_tokens} tokens{where}: the "
        "layer's input or the router weight holds NaN / inf (check the loss scale and the learning rate)"
    )


@torch.library.custom_op("llmpar::moe_checked_counts", mutates_args=())
def _checked_counts(counts: torch.Tensor, nonfinite: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A copy of ``counts``, after raising the non-finite routing's ValueError when ``nonfinite > 0`` (read on the
    host when the op runs): a compiled dispatch checks its routing without a graph break, and as the expert
    computation consumes the copy the check cannot be pruned from the graph."""
    bad = int(nonfinite)
    if bad:
        raise ValueError(nonfinite_message(bad, num_tokens, ""))
    return counts.clone()


@_checked_counts.register_fake
def _checked_counts_fake(counts, nonfinite, num_tokens):
    return torch.empty_like(counts)


def checked_counts(counts: torch.Tensor, nonfinite: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``counts`` once the routing's non-finite count is checked (``llmpar::moe_checked_counts``; see there)."""
    return torch.ops.llmpar.moe_checked_counts(counts, nonfinite, num_tokens)


def gather_slots(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """The rows of the kept slots, sorted: ``x: [T, H]`` -> ``[N_kept, H]`` with row i = ``x[order[i] // top_k]``;
    backward: each token's gradient is the sum over its k slots in slot order (deterministic on every device).
    One op: ``llmpar.ops.moe_permute.permute_rows``."""
    return permute_rows(x, order, top_k)


def combine_slots(y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
    """Undo the sort of :func:`plan_slots` and weigh: ``out_t = sum_j w_tj * y_slot(t, j)`` in fp32 (fp64 for fp64),
    the k slots summed left to right; dropped slots count as zero. ``y: [N_kept, H]`` -> ``[T, H]`` in
    ``meta.dtype``. One op with the weights applied as the rows are put back: ``llmpar.ops.moe_permute.unpermute_rows``
    (equal bitwise to the plain composition on its torch path)."""
    return unpermute_rows(y, meta.order, meta.weights, meta.num_tokens, meta.dtype)


__all__ = [
    "STATUS_TEXT",
    "DispatchMeta",
    "DispatchStats",
    "PendingDispatch",
    "capacity",
    "check_capacity_factor",
    "checked_counts",
    "combine_slots",
    "gather_slots",
    "nonfinite_message",
    "plan_slots",
]
