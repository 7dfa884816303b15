"""The matmul + communication autograd Functions behind the parallel linear layers, with overlap.

Shapes (``N`` tokens seen by the matmul, ``n = N / tp`` tokens per rank under sequence parallelism):

Column: ``y[N, out/tp] = x_total[N, in] @ W[out/tp, in]^T + b``
  * forward, sequence parallel: ``x_total`` is the all-gather (dim 0) of the local ``x[n, in]``, fetched in
    ``chunks`` pieces; piece i+1 is in flight while piece i is multiplied.
  * backward: ``dx_partial = dy @ W`` is all-reduced (reduce-scattered under sequence parallelism)
    asynchronously while ``dW = dy^T @ x_total`` and ``db`` are computed.
Row: ``y[N, out] = sum_ranks x[N, in/tp] @ W[out, in/tp]^T (+ b after the sum)``
  * forward: the tokens are cut into ``chunks`` pieces; piece i is all-reduced (reduce-scattered to ``[n, out]``
    under sequence parallelism) while piece i+1 is multiplied.
  * backward, sequence parallel: ``dy[n, out]`` is all-gathered in pieces, each multiplied as it arrives.

Under sequence parallelism a piece covers local rows ``[a, b)`` of *every* rank's block, so the reduce-scatter of
a piece lands in a contiguous slice ``[a, b)`` of this rank's output. On GPU the collectives run on the process
group's own stream (NCCL); on CPU the async gloo work runs on gloo's threads while this thread multiplies.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from llmpar.distributed.collectives import Handle, all_gather_flat, all_reduce, reduce_scatter_flat
from llmpar.tensor_parallel._utils import chunk_bounds, tp_size_rank


def _gather_pipelined(
    local: torch.Tensor, group: dist.ProcessGroup, bounds: list[tuple[int, int]]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(a, b, g)`` with ``g: [tp * (b - a), d]`` = rows ``[a, b)`` of every rank's ``local: [n, d]``,
    rank-major; the next piece's all-gather is launched before the current one is waited on."""
    tp, _ = tp_size_rank(group)

    def launch(a: int, b: int) -> tuple[torch.Tensor, Handle, torch.Tensor]:
        src = local[a:b].contiguous()
        buf = torch.empty((tp * (b - a), local.shape[1]), dtype=local.dtype, device=local.device)
        handle = all_gather_flat(buf.view(-1), src.view(-1), group, async_op=True)
        return buf, handle, src

    pending = launch(*bounds[0])
    for i, (a, b) in enumerate(bounds):
        buf, handle, _src = pending
        if i + 1 < len(bounds):
            pending = launch(*bounds[i + 1])
        handle.wait()
        yield a, b, buf


class _ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, chunks, overlap_grad, reduce_grad=True):
        tp, _ = tp_size_rank(group)
        in_f, out_f = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, in_f).contiguous()
        if sequence_parallel:
            n = x2.shape[0]
            bounds = chunk_bounds(n, chunks)
            if len(bounds) == 1:
                total = next(_gather_pipelined(x2, group, bounds))[2]
                y = total @ weight.t()
            else:
                total = torch.empty((tp, n, in_f), dtype=x.dtype, device=x.device)
                y = torch.empty((tp, n, out_f), dtype=x.dtype, device=x.device)
                for a, b, buf in _gather_pipelined(x2, group, bounds):
                    g = buf.view(tp, b - a, in_f)
                    total[:, a:b] = g
                    y[:, a:b] = g @ weight.t()
                total, y = total.view(tp * n, in_f), y.view(tp * n, out_f)
            if bias is not None:
                y += bias
            out_shape = (tp * x.shape[0], *x.shape[1:-1], out_f)
        else:
            total = x2
            y = torch.nn.functional.linear(x2, weight, bias)
            out_shape = (*x.shape[:-1], out_f)
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sp, ctx.overlap, ctx.reduce = group, sequence_parallel, overlap_grad, reduce_grad
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.view(out_shape)

    @staticmethod
    def backward(ctx, grad_y):
        total, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        handle = None
        if ctx.needs_input_grad[0]:
            dx = g @ weight  # [N, in], a partial sum over the ranks
            if ctx.sp:
                tp, _ = tp_size_rank(ctx.group)
                grad_x = torch.empty((dx.shape[0] // tp, dx.shape[1]), dtype=dx.dtype, device=dx.device)
                handle = reduce_scatter_flat(grad_x.view(-1), dx.view(-1), ctx.group, async_op=True)
            elif ctx.reduce:
                grad_x = dx
                handle = all_reduce(dx, ctx.group, async_op=True)
            else:
                grad_x = dx.view(ctx.x_shape)  # partial: the caller reduces it
            if handle is not None and not ctx.overlap:
                handle.wait()
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ total  # computed while the input-gradient collective flies
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        if handle is not None:
            handle.wait()
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class _RowParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, chunks):
        tp, _ = tp_size_rank(group)
        in_f, out_f = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, in_f).contiguous()
        big_n = x2.shape[0]
        handles, keep = [], []
        if sequence_parallel:
            n = big_n // tp
            y = torch.empty((n, out_f), dtype=x.dtype, device=x.device)
            xv = x2.view(tp, n, in_f)
            bounds = chunk_bounds(n, chunks)
            for a, b in bounds:
                piece = x2 if len(bounds) == 1 else xv[:, a:b].reshape(-1, in_f)
                part = piece @ weight.t()  # [tp * (b - a), out], partial sums
                keep.append(part)
                handles.append(reduce_scatter_flat(y[a:b].view(-1), part.view(-1), group, async_op=True))
            out_shape = (x.shape[0] // tp, *x.shape[1:-1], out_f)
        else:
            y = torch.empty((big_n, out_f), dtype=x.dtype, device=x.device)
            for a, b in chunk_bounds(big_n, chunks):
                torch.matmul(x2[a:b], weight.t(), out=y[a:b])
                handles.append(all_reduce(y[a:b], group, async_op=True))
            out_shape = (*x.shape[:-1], out_f)
        for h in handles:
            h.wait()
        if bias is not None:
            y += bias  # once, after the reduction
        ctx.save_for_backward(x2, weight)
        ctx.group, ctx.sp, ctx.chunks = group, sequence_parallel, chunks
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.view(out_shape)

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight = ctx.saved_tensors
        out_f, in_f = weight.shape
        g = grad_y.reshape(-1, out_f).contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        grad_x = grad_w = grad_b = None
        if ctx.sp:
            tp, _ = tp_size_rank(ctx.group)
            n = g.shape[0]
            bounds = chunk_bounds(n, ctx.chunks)
            if len(bounds) == 1:
                g = next(_gather_pipelined(g, ctx.group, bounds))[2]
            else:
                xv = x2.view(tp, n, in_f)
                grad_x = torch.empty((tp, n, in_f), dtype=g.dtype, device=g.device) if need_x else None
                grad_w = torch.zeros_like(weight) if need_w else None
                grad_b = torch.zeros(out_f, dtype=g.dtype, device=g.device) if need_b else None
                for a, b, gi in _gather_pipelined(g, ctx.group, bounds):
                    if need_x:
                        grad_x[:, a:b] = (gi @ weight).view(tp, b - a, in_f)
                    if need_w:
                        grad_w.addmm_(gi.t(), xv[:, a:b].reshape(-1, in_f))
                    if need_b:
                        grad_b += gi.sum(0)
                grad_x = grad_x.view(ctx.x_shape) if need_x else None
                return grad_x, grad_w, grad_b, None, None, None
        if need_x:
            grad_x = (g @ weight).view(ctx.x_shape)
        if need_w:
            grad_w = g.t() @ x2
        if need_b:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None, None
