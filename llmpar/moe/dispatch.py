"""The dispatcher seam: carry each token to the experts that serve it, and their outputs back.

One protocol (:class:`Dispatcher`), one implementation per way of moving tokens, found by :func:`make_dispatcher`:

    pending = dispatcher.dispatch_async(x, routing)     # x: [T, H]; the exchange may still be in flight
    ...                                                 # (the shared experts run here)
    x_local, counts, meta = pending.wait()              # x_local: [N_local, H], counts[e] rows per local expert
    y_local = experts(x_local, counts)                  # [N_local, H], same order
    out = dispatcher.combine(y_local, meta)             # [T, H] in x's dtype

``meta`` is opaque to the caller except for ``meta.stats`` (:class:`DispatchStats`, for logs).

Slots. Token t's j-th choice is slot ``t k + j``. The slots are sorted by expert, stably (within an expert in token
order), so the sort is deterministic. With a ``capacity_factor`` each expert keeps at most
``C = ceil(capacity_factor * T k / E)`` of this rank's slots (before any exchange): those of the highest routing
weight, ties going to the earlier slot; the rest are dropped (their output counts as zero) and counted.

Combine. The expert outputs are put back in slot order and weighed in fp32, summing a token's k slots in slot order::

    out_t = sum_{j = 0..k-1} w_tj * float(y_{t k + j})        (left to right, then cast to x's dtype)

and the gradient of ``x`` sums a token's k slots in slot order too (no scatter-add): forward and backward are
deterministic on every device.

:class:`LocalDispatcher` (ep = 1) keeps every expert on this rank. ``llmpar.moe.alltoall.AllToAllDispatcher`` spreads
them over an expert-parallel group.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from llmpar.distributed import group_size
from llmpar.moe.alltoall import AllToAllDispatcher
from llmpar.moe.router import Routing
from llmpar.moe.slots import (
    DispatchMeta,
    DispatchStats,
    PendingDispatch,
    check_capacity_factor,
    checked_counts,
    combine_slots,
    gather_slots,
    nonfinite_message,
    plan_slots,
)


class Dispatcher(Protocol):
    """Moves tokens to the experts (see the module docstring)."""

    num_experts: int
    num_local_experts: int

    def dispatch_async(self, x: torch.Tensor, routing: Routing) -> PendingDispatch: ...

    def dispatch(
        self, x: torch.Tensor, routing: Routing
    ) -> "tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta]": ...

    def combine(self, y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor: ...

    def fail(self, message: str) -> None:
        """Raise ``ValueError(message)`` here and a ValueError naming this rank on every other rank of the group,
        in place of a dispatch (called by a layer that refuses its input)."""
        ...


class LocalDispatcher:
    """Every expert on this rank (ep = 1): a stable sort by expert, no exchange."""

    def __init__(self, num_experts: int, capacity_factor: float | None = None) -> None:
        self.num_experts = self.num_local_experts = num_experts
        self.capacity_factor = check_capacity_factor(capacity_factor)

    def dispatch_async(self, x: torch.Tensor, routing: Routing) -> PendingDispatch:
        result = self.dispatch(x, routing)
        return PendingDispatch(lambda: result)

    def dispatch(
        self, x: torch.Tensor, routing: Routing
    ) -> "tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta]":
        T, k = routing.indices.shape
        order, counts, dropped = plan_slots(routing, self.num_experts, self.capacity_factor)
        if torch.compiler.is_compiling():  # no host read: the counts stay a tensor (the grouped GEMM's offsets)
            counts = checked_counts(counts, routing.nonfinite, T)
            stats = DispatchStats(sent=counts, received=counts, dropped=dropped)
            return gather_slots(x, order, k), counts, DispatchMeta(order, T, k, routing.weights, x.dtype, stats)
        host = torch.cat([counts, dropped.view(1), routing.nonfinite.view(1).to(counts.dtype)]).tolist()
        if host[-1]:
            raise ValueError(nonfinite_message(host[-1], T, ""))
        sent = host[: self.num_experts]
        x_sorted = gather_slots(x, order, k)
        stats = DispatchStats(sent=sent, received=list(sent), dropped=host[-2])
        return x_sorted, list(sent), DispatchMeta(order, T, k, routing.weights, x.dtype, stats)

    def combine(self, y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        return combine_slots(y, meta)

    def fail(self, message: str) -> None:
        raise ValueError(message)


def make_dispatcher(num_experts: int, ep_group: Any = None, capacity_factor: float | None = None) -> Dispatcher:
    """The dispatcher for an expert-parallel group: :class:`LocalDispatcher` for None (or a group of one rank),
    else the all-to-all one."""
    if ep_group is None or group_size(ep_group) == 1:
        return LocalDispatcher(num_experts, capacity_factor)
    return AllToAllDispatcher(num_experts, ep_group, capacity_factor)


__all__ = [
    "AllToAllDispatcher",
    "DispatchMeta",
    "DispatchStats",
    "Dispatcher",
    "LocalDispatcher",
    "PendingDispatch",
    "make_dispatcher",
]
