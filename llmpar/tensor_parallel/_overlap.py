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

Fused path (``fused=True``; on CUDA tensors, or with ``LLMPAR_BACKEND`` forcing a kernel backend): the local
products go through ``llmpar.ops.gemm`` (cuBLASLt / Triton with the bias and activation in the GEMM's epilogue; the
column layer's optional activation ``act`` rides along, its pre-activation saved for a fused backward), the row
layer's pieces through ``linear_act_rows``; the overlap is the same. Otherwise plain torch matmuls, ``act`` "none".

Under sequence parallelism a piece covers local rows ``[a, b)`` of *every* rank's block, so the reduce-scatter of
a piece lands in a contiguous slice ``[a, b)`` of this rank's output. On the plain path the chunked products are
computed per rank block (``b - a`` rows each) straight into their place (``_mm_into``): no product is copied into
the output, and the row layer reads x's rows and writes dx's rows in place (its weight gradient keeps one GEMM per
piece, so a low-precision running sum is rounded no more often than before). On GPU the collectives run on the
process group's own stream (NCCL); on CPU the async gloo work runs on gloo's threads while this thread multiplies.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from llmpar.distributed.collectives import Handle, all_gather_flat, all_reduce, reduce_scatter_flat
from llmpar.ops._dispatch import forced_backend
from llmpar.ops.gemm import linear_act_backward, linear_act_forward, linear_act_rows
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


def fused_path(x: torch.Tensor) -> bool:
    """Whether the parallel linears run their products through llmpar.ops.gemm for this input: on CUDA tensors, or
    when ``LLMPAR_BACKEND`` forces a kernel backend; plain torch otherwise (CPU by default)."""
    return x.device.type == "cuda" or forced_backend() in ("triton", "cuda")


def _column_product(x2, weight, bias, act, fused):
    """(y, pre) = (act(x2 W^T + b), what the fused backward takes act' from) for one block of rows."""
    if fused:
        return linear_act_forward(x2, weight, bias, act=act)
    return torch.nn.functional.linear(x2, weight, bias), None


def _mm_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``out = x W^T (+ b)`` written straight into ``out`` (contiguous rows of a larger buffer): the plain path's
    chunked products land where they belong, with no temporary and no copy."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


class _ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, group, sequence_parallel, chunks, overlap_grad, reduce_grad=True, act="none", fused=False
    ):
        tp, _ = tp_size_rank(group)
        in_f, out_f = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, in_f).contiguous()
        pre = None
        if sequence_parallel:
            n = x2.shape[0]
            bounds = chunk_bounds(n, chunks)
            if len(bounds) == 1:
                total = next(_gather_pipelined(x2, group, bounds))[2]
                y, pre = _column_product(total, weight, bias, act, fused)
            else:
                total = torch.empty((tp, n, in_f), dtype=x.dtype, device=x.device)
                y = torch.empty((tp, n, out_f), dtype=x.dtype, device=x.device)
                pre = torch.empty_like(y) if act != "none" else None
                for a, b, buf in _gather_pipelined(x2, group, bounds):
                    g = buf.view(tp, b - a, in_f)
                    total[:, a:b] = g  # rank-major, as the output rows: kept for the weight gradient
                    if not fused:  # each rank's rows straight into their place in y
                        for r in range(tp):
                            _mm_into(y[r, a:b], g[r], weight, bias)
                        continue
                    yp, pp = _column_product(buf, weight, bias, act, fused)
                    y[:, a:b] = yp.view(tp, b - a, out_f)
                    if pre is not None:
                        pre[:, a:b] = pp.view(tp, b - a, out_f)
                total, y = total.view(tp * n, in_f), y.view(tp * n, out_f)
                pre = pre.view(tp * n, out_f) if pre is not None else None
            out_shape = (tp * x.shape[0], *x.shape[1:-1], out_f)
        else:
            total = x2
            if fused:
                y, pre = linear_act_forward(x2, weight, bias, act=act)
            else:
                y = torch.nn.functional.linear(x2, weight, bias)
            out_shape = (*x.shape[:-1], out_f)
        ctx.save_for_backward(total, weight, pre)
        ctx.group, ctx.sp, ctx.overlap, ctx.reduce = group, sequence_parallel, overlap_grad, reduce_grad
        ctx.has_bias, ctx.x_shape, ctx.act, ctx.fused = bias is not None, x.shape, act, fused
        return y.view(out_shape)

    @staticmethod
    def _launch_input_grad(ctx, dx: torch.Tensor) -> tuple[torch.Tensor, Handle | None]:
        """Start reducing the partial input gradient ``dx: [N, in]`` (all-reduce, or reduce-scatter under sequence
        parallelism); returns the tensor that will hold the result and the handle to wait on."""
        handle = None
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
        return grad_x, handle

    @staticmethod
    def backward(ctx, grad_y):
        total, weight, pre = ctx.saved_tensors
        g = grad_y.reshape(-1, weight.shape[0])
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        launched: list = [None, None]  # grad_x, handle

        def on_grad_input(dx):
            launched[:] = _ColumnParallelMatmul._launch_input_grad(ctx, dx)

        if ctx.fused:  # dX first (its collective starts in the hook), then dW and db while it flies
            _, grad_w, grad_b = linear_act_backward(
                g,
                total,
                weight,
                pre,
                act=ctx.act,
                has_bias=ctx.has_bias,
                needs=(need_x, need_w, need_b),
                on_grad_input=on_grad_input,
            )
        else:
            grad_w = grad_b = None
            if need_x:
                on_grad_input(g @ weight)  # [N, in], a partial sum over the ranks
            if need_w:
                grad_w = g.t() @ total  # computed while the input-gradient collective flies
            if need_b:
                grad_b = g.sum(0)
        grad_x, handle = launched
        if handle is not None:
            handle.wait()
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


class _RowParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, chunks, fused=False):
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
                if len(bounds) > 1 and not fused:  # [tp, b - a, out] partial sums, each rank's block in place
                    part = torch.empty((tp, b - a, out_f), dtype=x.dtype, device=x.device)
                    for r in range(tp):
                        _mm_into(part[r], xv[r, a:b], weight)
                else:  # [tp * (b - a), out]
                    piece = x2 if len(bounds) == 1 else xv[:, a:b].reshape(-1, in_f)
                    part = _column_product(piece, weight, None, "none", fused)[0]
                keep.append(part)
                handles.append(reduce_scatter_flat(y[a:b].view(-1), part.view(-1), group, async_op=True))
            out_shape = (x.shape[0] // tp, *x.shape[1:-1], out_f)
        else:
            y = torch.empty((big_n, out_f), dtype=x.dtype, device=x.device)
            for a, b in chunk_bounds(big_n, chunks):
                if fused:
                    linear_act_rows(x2, weight, out=y, start=a, end=b)
                else:
                    _mm_into(y[a:b], x2[a:b], weight)
                handles.append(all_reduce(y[a:b], group, async_op=True))
            out_shape = (*x.shape[:-1], out_f)
        for h in handles:
            h.wait()
        if bias is not None:
            y += bias  # once, after the reduction
        ctx.save_for_backward(x2, weight)
        ctx.group, ctx.sp, ctx.chunks, ctx.fused = group, sequence_parallel, chunks, fused
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.view(out_shape)

    @staticmethod
    def _piece_grads(ctx, gi, xv, weight, a, b, grad_x, grad_w, grad_b) -> None:
        """Sequence-parallel backward, one piece: ``gi: [tp * (b - a), out]`` = rows ``[a, b)`` of every rank's
        ``dy``; adds their share to ``grad_x: [tp, n, in]``, ``grad_w``, ``grad_b`` (None: not needed)."""
        tp, rows, in_f = xv.shape[0], b - a, xv.shape[2]
        if not ctx.fused:
            if grad_x is not None:  # each rank's rows of dx straight into their place
                gv = gi.view(tp, rows, -1)
                for r in range(tp):
                    torch.mm(gv[r], weight, out=grad_x[r, a:b])
            if grad_w is not None:  # one GEMM per piece: as few roundings of the running sum as chunks
                grad_w.addmm_(gi.t(), xv[:, a:b].reshape(-1, in_f))
            if grad_b is not None:
                grad_b += gi.sum(0)
            return
        needs = (grad_x is not None, grad_w is not None, grad_b is not None)
        dxp, dwp, dbp = linear_act_backward(
            gi, xv[:, a:b].reshape(-1, in_f), weight, None, has_bias=needs[2], needs=needs
        )
        if grad_x is not None:
            grad_x[:, a:b] = dxp.view(tp, rows, in_f)
        if grad_w is not None:
            grad_w.add_(dwp)
        if grad_b is not None:
            grad_b += dbp

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
                    _RowParallelMatmul._piece_grads(ctx, gi, xv, weight, a, b, grad_x, grad_w, grad_b)
                grad_x = grad_x.view(ctx.x_shape) if need_x else None
                return grad_x, grad_w, grad_b, None, None, None, None
        if ctx.fused:
            grad_x, grad_w, grad_b = linear_act_backward(
                g, x2, weight, None, has_bias=need_b, needs=(need_x, need_w, need_b)
            )
            grad_x = grad_x.view(ctx.x_shape) if grad_x is not None else None
            return grad_x, grad_w, grad_b, None, None, None, None
        if need_x:
            grad_x = (g @ weight).view(ctx.x_shape)
        if need_w:
            grad_w = g.t() @ x2
        if need_b:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None
