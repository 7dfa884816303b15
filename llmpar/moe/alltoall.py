"""Expert parallelism's dispatcher: the E experts spread over the ep ranks of a group, tokens exchanged all-to-all.

Group rank r holds experts ``[r E_l, (r + 1) E_l)``, ``E_l = E / ep``. A dispatch is:

1. sort this rank's slots by global expert (:func:`~llmpar.moe.slots.plan_slots`: capacity dropping happens here,
   before anything is sent); as experts are numbered rank by rank, the sorted rows are grouped by destination rank;
2. one count exchange: an equal-size all-to-all of ``[ep, E_l + 1]`` int64, row r = the rows this rank sends to each
   of rank r's experts, plus this rank's status (0 = fine; else a code of
   :data:`~llmpar.moe.slots.STATUS_TEXT`). After it every rank knows ``C[s][e]`` (rows from rank s for its local
   expert e) and whether any rank failed, in which case every rank raises a ValueError before the token exchange;
3. the token exchange: an uneven all-to-all (``llmpar.distributed.exchange.all_to_all_uneven``), started
   asynchronously (the layer computes its shared experts meanwhile), then waited for;
4. the received rows, grouped by source rank then expert, are permuted to expert-major order
   (expert e: the rows of rank 0, then rank 1, ...) for the grouped expert computation.

The combine is the reverse: back to source-major order, the reverse uneven all-to-all, then the local unsort and
weighing in fp32 (:func:`~llmpar.moe.slots.combine_slots`). Both exchanges are autograd functions whose backward is
the reverse exchange. A rank that receives no rows (or sends none) still takes part in every exchange with zero-row
tensors, forward and backward, so it never leaves the others waiting; its experts get zero gradients.

Under torch.compile (``fullgraph=True`` or ``capture_dynamic_output_shape_ops``: the received rows are an unbacked
size) the same steps trace with the counts kept as tensors (:meth:`AllToAllDispatcher._dispatch_traced`): the count
exchange a functional all-to-all, the status check ``llmpar::moe_exchange_splits``, the token exchanges
``llmpar::all_to_all_v`` (``llmpar.distributed.funcol``), the expert-major permutation a search and a stable sort; no
graph break, and a routing change recompiles nothing. Otherwise the count exchange stays on the host, one break.
"""

from __future__ import annotations

from typing import Any

import torch

from llmpar.distributed import (
    GroupRef,
    all_to_all_single,
    collective_device,
    funcol,
    global_rank,
    group_rank,
    group_size,
)
from llmpar.distributed.exchange import all_to_all_uneven
from llmpar.moe.router import Routing
from llmpar.moe.slots import (
    STATUS_TEXT,
    DispatchMeta,
    DispatchStats,
    PendingDispatch,
    check_capacity_factor,
    combine_slots,
    gather_slots,
    nonfinite_message,
    plan_slots,
)


class _InFlight:
    """An exchange started by :class:`_Exchange`: its handle, and the send buffer kept alive until it is waited for."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.keep: tuple = ()

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        self.handle, self.keep = None, ()


class _Exchange(torch.autograd.Function):
    """Uneven all-to-all of rows, started asynchronously (the output is valid once ``flight.wait()`` returned);
    backward: the reverse exchange (synchronous)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, flight, what):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.what = (out_splits, in_splits), group, what
        send = x.contiguous()
        recv = x.new_empty((sum(out_splits), *x.shape[1:]))
        flight.handle = all_to_all_uneven(recv, send, out_splits, in_splits, group, async_op=True, what=what)
        flight.keep = (send,)
        return recv

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        g = grad.contiguous()
        gx = g.new_empty((sum(in_splits), *g.shape[1:]))
        all_to_all_uneven(gx, g, in_splits, out_splits, ctx.group, what=f"{ctx.what} (backward)")
        return gx, None, None, None, None, None


def exchange_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: GroupRef, what: str
) -> tuple[torch.Tensor, _InFlight]:
    """Differentiable uneven all-to-all of ``x``'s rows, in flight: read the result after ``flight.wait()``. Under
    torch.compile a functional all-to-all (the group by name, the wait in the graph; the flight has nothing to wait
    for)."""
    flight = _InFlight()
    if torch.compiler.is_compiling():
        return funcol.all_to_all_autograd(x, funcol.group_key(group), out_splits, in_splits), flight
    return _Exchange.apply(x, out_splits, in_splits, group, flight, what), flight


def expert_major(C: list[list[int]]) -> torch.Tensor:
    """Permutation ``perm`` with ``rows_expert_major = rows_source_major[perm]``, for ``C[s][e]`` rows from source
    rank s for local expert e, laid out source-major (s, then e) as received."""
    c = torch.tensor(C, dtype=torch.int64)  # [ep, E_l]
    flat = c.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(c)  # where block (s, e) begins in the received rows
    lens = c.t().reshape(-1)  # blocks in expert-major order
    begins = torch.cumsum(lens, 0) - lens
    total = sum(map(sum, C))  # on the host: no read of a tensor (torch.compile traces through)
    return torch.repeat_interleave(starts.t().reshape(-1) - begins, lens, output_size=total) + torch.arange(total)


def expert_major_traced(C: torch.Tensor, total: int) -> torch.Tensor:
    """:func:`expert_major` from ``C: [ep, E_l]`` as a tensor (torch.compile: no host read; ``total`` = the received
    rows, an unbacked size): each received row's block (s, e) found by a search over the blocks' ends, then a stable
    sort by e (within an expert the rows stay source-major)."""
    ends = torch.cumsum(C.reshape(-1), 0)
    block = torch.searchsorted(ends, torch.arange(total, device=C.device), right=True)
    return torch.sort(block % C.shape[1], stable=True).indices


@torch.library.custom_op("llmpar::moe_exchange_splits", mutates_args=())
def _exchange_splits(
    sent: torch.Tensor, received: torch.Tensor, nonfinite: torch.Tensor, num_tokens: int, group_name: str
) -> torch.Tensor:
    """``[2, ep]`` int64: (rows sent to, rows received from) each ep rank, from the count tables of
    :meth:`AllToAllDispatcher._exchange_counts` (``[ep, E_l + 2]`` each), after raising what the eager dispatch
    raises when a rank's status is non-zero. Read on the host when the op runs, so a compiled dispatch holds it with
    no graph break; the token exchange consumes its output, so the check is never pruned."""
    el = sent.shape[1] - 2
    host_sent, host_received = sent.tolist(), received.tolist()
    failed = [(s, row[el]) for s, row in enumerate(host_received) if row[el]]
    pg = torch.distributed.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
    if host_sent[0][el]:
        where = f" on expert-parallel rank {group_rank(pg)}"
        raise ValueError(nonfinite_message(int(nonfinite), num_tokens, where))
    if failed:
        s, code = failed[0]
        raise ValueError(
            f"MoE dispatch stopped: expert-parallel rank {s} (global rank {global_rank(pg, s)}) "
            f"failed: {STATUS_TEXT.get(code, f'status {code}')}; see that rank's error"
        )
    return torch.stack([sent[:, :el].sum(1), received[:, :el].sum(1)])


@_exchange_splits.register_fake
def _exchange_splits_fake(sent, received, nonfinite, num_tokens, group_name):
    return sent.new_empty((2, sent.shape[0]))


@torch._dynamo.assume_constant_result
def _dynamic_rows_traceable() -> bool:
    """Whether the graph being traced may hold an op whose output size is data (an unbacked size): torch allows it
    under ``fullgraph=True`` or with ``torch._dynamo.config.capture_dynamic_output_shape_ops`` (run at trace time, a
    constant in the graph)."""
    ctx = torch._guards.TracingContext.try_get()
    shape_env = None if ctx is None or ctx.fake_mode is None else ctx.fake_mode.shape_env
    if shape_env is not None:
        return bool(shape_env.allow_dynamic_output_shape_ops)
    return bool(torch._dynamo.config.capture_dynamic_output_shape_ops)


@torch.compiler.disable
def _host_counts(dispatcher: "AllToAllDispatcher", counts, status, dropped):
    """``dispatcher._exchange_counts`` out of the graph: under torch.compile where the received rows cannot be an
    unbacked size (not ``fullgraph``, no ``capture_dynamic_output_shape_ops``: :func:`_dynamic_rows_traceable`) the
    split sizes are read on the host here, one graph break, and the graphs after it are specialised on the counts."""
    return dispatcher._exchange_counts(counts, status, dropped)


class AllToAllDispatcher:
    """Experts spread over ``ep_group`` (see the module docstring)."""

    def __init__(self, num_experts: int, ep_group: Any, capacity_factor: float | None = None) -> None:
        self.group = GroupRef(ep_group)
        self.ep, self.rank = group_size(self.group.get()), group_rank(self.group.get())
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size ep={self.ep}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.ep
        self.capacity_factor = check_capacity_factor(capacity_factor)

    def _exchange_counts(
        self, counts: torch.Tensor | None, status: torch.Tensor | int, dropped: torch.Tensor | int = 0
    ):
        """One equal all-to-all of ``[ep, E_l + 2]`` int64 (row r: the rows for each of rank r's experts, this
        rank's status, this rank's dropped slots): returns (sent rows, received rows) as lists; raises on every rank
        when any rank's status is non-zero (the failing rank raises its own error after this)."""
        ep, el = self.ep, self.num_local_experts
        device = collective_device(self.group)
        send = torch.zeros(ep, el + 2, dtype=torch.int64, device=device)
        if counts is not None:
            send[:, :el] = counts.view(ep, el).to(device)
        send[:, el] = torch.as_tensor(status, device=device)
        send[:, el + 1] = torch.as_tensor(dropped, device=device)
        recv = torch.empty_like(send)
        all_to_all_single(recv, send, self.group, what=f"MoE token counts ({ep} ranks x {el} experts)")
        sent, received = torch.stack([send, recv]).tolist()
        failed = [(s, row[el]) for s, row in enumerate(received) if row[el]]
        if failed and not sent[0][el]:
            s, code = failed[0]
            raise ValueError(
                f"MoE dispatch stopped: expert-parallel rank {s} (global rank {global_rank(self.group.get(), s)}) "
                f"failed: {STATUS_TEXT.get(code, f'status {code}')}; see that rank's error"
            )
        return sent, received

    def fail(self, message: str) -> None:
        self._exchange_counts(None, 2)
        raise ValueError(message)

    def dispatch(
        self, x: torch.Tensor, routing: Routing
    ) -> "tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta]":
        return self.dispatch_async(x, routing).wait()

    def _dispatch_traced(self, x: torch.Tensor, routing: Routing) -> PendingDispatch:
        """The dispatch under torch.compile: the same steps with the counts kept as tensors (the count exchange a
        functional all-to-all, the checks and the token exchange ``llmpar::`` ops that read them when they run), so
        the graph has no break and does not depend on the routing; the received rows are an unbacked size."""
        T, k = routing.indices.shape
        ep, el = self.ep, self.num_local_experts
        order, counts, dropped = plan_slots(routing, self.num_experts, self.capacity_factor)
        status = (routing.nonfinite > 0).to(torch.int64)
        key = funcol.group_key(self.group)
        send = torch.cat([counts.view(ep, el), status.expand(ep, 1), dropped.to(torch.int64).expand(ep, 1)], dim=1)
        recv = funcol.all_to_all_dim0(send, key)
        splits = torch.ops.llmpar.moe_exchange_splits(send, recv, routing.nonfinite, T, key.name)
        x_recv = funcol.all_to_all_v(gather_slots(x, order, k), key, splits[0], splits[1])
        C = recv[:, :el]
        perm = expert_major_traced(C, x_recv.shape[0]) if el > 1 else None
        x_local = x_recv if perm is None else x_recv.index_select(0, perm)
        stats = DispatchStats(sent=counts, received=C.sum(0), dropped=dropped)
        extra = {"in_splits": splits[0], "out_splits": splits[1], "perm": perm, "key": key}
        result = (x_local, C.sum(0), DispatchMeta(order, T, k, routing.weights, x.dtype, stats, extra))
        return PendingDispatch(lambda: result)

    def dispatch_async(self, x: torch.Tensor, routing: Routing) -> PendingDispatch:
        if torch.compiler.is_compiling() and _dynamic_rows_traceable():
            return self._dispatch_traced(x, routing)
        T, k = routing.indices.shape
        el = self.num_local_experts
        order, counts, dropped = plan_slots(routing, self.num_experts, self.capacity_factor)
        status = (routing.nonfinite > 0).to(torch.int64)
        sent, received = _host_counts(self, counts, status, dropped)
        if sent[0][el]:
            bad = int(routing.nonfinite)
            raise ValueError(nonfinite_message(bad, T, f" on expert-parallel rank {self.rank}"))
        C = [row[:el] for row in received]
        in_splits = [sum(row[:el]) for row in sent]
        out_splits = [sum(row) for row in C]
        x_sorted = gather_slots(x, order, k)
        what = f"MoE token dispatch ({sum(in_splits)} rows out, {sum(out_splits)} in)"
        x_recv, flight = exchange_rows(x_sorted, out_splits, in_splits, self.group, what)
        n_dropped = sent[0][el + 1]

        def finish() -> "tuple[torch.Tensor, list[int] | torch.Tensor, DispatchMeta]":
            flight.wait()
            perm = expert_major(C).to(x.device) if el > 1 else None
            x_local = x_recv if perm is None else x_recv.index_select(0, perm)
            local = [sum(C[s][e] for s in range(self.ep)) for e in range(el)]
            stats = DispatchStats(sent=[c for row in sent for c in row[:el]], received=local, dropped=n_dropped)
            extra = {"in_splits": in_splits, "out_splits": out_splits, "perm": perm}
            return x_local, local, DispatchMeta(order, T, k, routing.weights, x.dtype, stats, extra)

        return PendingDispatch(finish)

    def combine(self, y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        perm = meta.extra["perm"]
        y_src = y if perm is None else torch.empty_like(y).index_copy(0, perm, y)
        in_splits, out_splits = meta.extra["in_splits"], meta.extra["out_splits"]
        if isinstance(in_splits, torch.Tensor):  # dispatched under torch.compile: the splits are tensors
            y_back = funcol.all_to_all_v(y_src, meta.extra["key"], out_splits, in_splits, meta.order.shape[0])
            return combine_slots(y_back, meta)
        what = f"MoE token combine ({sum(out_splits)} rows out, {sum(in_splits)} in)"
        y_back, flight = exchange_rows(y_src, in_splits, out_splits, self.group, what)
        flight.wait()
        return combine_slots(y_back, meta)


__all__ = ["AllToAllDispatcher", "exchange_rows", "expert_major", "expert_major_traced"]
