"""The MoE token permutation: tokens sorted by expert (permute) and the experts' outputs put back and weighed by the
routing scores (unpermute), each one op with its backward.

Slot ``s = t k + j`` is token t's j-th choice; ``order: [N]`` (int64) lists the kept slots sorted by expert (N = T k
when none was dropped), ``weights: [T, k]`` the routing scores.

    permute_rows(x, order, k)            x: [T, H] -> [N, H],  row i = x[order[i] // k]
        backward: dx[t] = sum_{j = 0..k-1} g[slot t k + j]  (a dropped slot counts 0), summed in slot order
    unpermute_rows(y, order, weights, T) y: [N, H] -> [T, H],  out_t = sum_{j = 0..k-1} w_tj * float(y[slot t k + j])
        left to right in fp32 (fp64 for fp64), then cast to ``out_dtype`` (default y's); backward (G = float(dOut)):
        dy[i] = w_s * G[t] (s = order[i], t = s // k), dw_s = <G[t], float(y[i])> (0 for a dropped slot)

Backends (``_dispatch.select_backend``; there is no CUDA-extension kernel): Triton (``llmpar.kernels.moe_permute``:
the unpermute forward and the permute backward are one gather-and-sum kernel over an inverse slot map, the weights
applied as the rows are summed, no [T k, H] buffer; the unpermute backward one kernel writing dy and dw) on CUDA
tensors, or on CPU under TRITON_INTERPRET=1, for float32 / float16 / bfloat16; else torch, whose forward and
backward are the same operations, in the same order, as autograd through the plain composition (a scatter into slot
order, k products summed left to right), so they equal it bitwise, with less memory traffic in the backward (no
zero-filled [T, k, H] per slot). The permute forward is one ``index_select`` on every backend.
"""

from __future__ import annotations

import torch

from llmpar.ops._dispatch import select_backend

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _backend(t: torch.Tensor, op: str) -> str:
    unfit = None if t.dtype in KERNEL_DTYPES else f"dtype {t.dtype} (the kernels take float32, float16, bfloat16)"
    return select_backend(
        t.device, kernel_unfit=unfit, op=op, cuda_unfit="the MoE permutation has no CUDA-extension kernel"
    )


def _inverse(order: torch.Tensor, n_slots: int) -> torch.Tensor:
    """[T k] int64: the row of each slot among the kept rows, -1 for a dropped slot."""
    inv = torch.full((n_slots,), -1, dtype=torch.int64, device=order.device)
    return inv.index_copy_(0, order, torch.arange(order.numel(), device=order.device))


def _slots(rows: torch.Tensor, order: torch.Tensor, n_slots: int) -> torch.Tensor:
    """[T k, H] with slot order[i] = rows[i], dropped slots zero (no zero fill when every slot is kept)."""
    full = order.numel() == n_slots
    out = rows.new_empty((n_slots, rows.shape[-1])) if full else rows.new_zeros((n_slots, rows.shape[-1]))
    return out.index_copy_(0, order, rows)


def _check(order: torch.Tensor, top_k: int, rows: torch.Tensor, what: str) -> None:
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or order.dim() != 1:
        raise TypeError(f"{what}: order must be a 1-D int64 tensor of slot ids, got {getattr(order, 'dtype', order)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{what}: top_k must be an int >= 1, got {top_k!r}")
    if rows.dim() != 2:
        raise ValueError(f"{what}: rows must be 2-D [rows, hidden], got shape {tuple(rows.shape)}")
    if order.device != rows.device:
        raise ValueError(f"{what}: order is on {order.device} but the rows on {rows.device}")


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, top_k):  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.top_k, ctx.num_tokens = top_k, x.shape[0]
        return x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        T, k = ctx.num_tokens, ctx.top_k
        if _backend(grad, "permute_rows backward") == "triton":
            from llmpar.kernels import moe_permute as kernels

            dx = grad.new_empty(T, grad.shape[1])
            kernels.gather_sum(grad.contiguous(), _inverse(order, T * k), None, dx, k)
            return dx, None, None
        return _slots(grad, order, T * k).view(T, k, grad.shape[-1]).sum(dim=1), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, order, weights, num_tokens, out_dtype):  # type: ignore[override]
        T, k = weights.shape
        acc = _acc(y.dtype)
        ctx.top_k, ctx.y_dtype, ctx.w_dtype = k, y.dtype, weights.dtype
        if _backend(y, "unpermute_rows") == "triton":
            from llmpar.kernels import moe_permute as kernels

            y = y.contiguous()
            w = weights.to(torch.float32).contiguous().view(-1)
            out = y.new_empty(T, y.shape[1], dtype=out_dtype)
            kernels.gather_sum(y, _inverse(order, T * k), w, out, k)
            ctx.triton = True
            ctx.save_for_backward(y, order, w)
            return out
        y3 = _slots(y, order, T * k).view(T, k, y.shape[-1]).to(acc)
        w = weights.to(acc)
        out = y3[:, 0] * w[:, 0:1]
        for j in range(1, k):
            out = out + y3[:, j] * w[:, j : j + 1]
        ctx.triton = False
        ctx.save_for_backward(y3, order, w)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        k = ctx.top_k
        if ctx.triton:
            from llmpar.kernels import moe_permute as kernels

            y, order, w = ctx.saved_tensors
            dy = torch.empty_like(y)
            dw = torch.zeros_like(w)
            kernels.unpermute_backward(grad.contiguous(), y, order, w, dy, dw, k)
            return dy, None, dw.view(-1, k).to(ctx.w_dtype), None, None
        y3, order, w = ctx.saved_tensors
        g = grad.to(y3.dtype)
        dw = torch.cat([(g * y3[:, j]).sum(1, keepdim=True) for j in range(k)], dim=1)
        tok = torch.div(order, k, rounding_mode="floor")
        dy = (g.index_select(0, tok) * w.view(-1).index_select(0, order)[:, None]).to(ctx.y_dtype)
        return dy, None, dw.to(ctx.w_dtype), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows of the kept slots sorted by expert: ``x: [T, H]`` -> ``[N, H]``, row i = ``x[order[i] // top_k]``
    (module docstring); differentiable in x."""
    _check(order, top_k, x, "permute_rows")
    return _Permute.apply(x, order, top_k)


def unpermute_rows(
    y: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    num_tokens: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The experts' rows back in token order, weighed: ``y: [N, H]`` -> ``[T, H]``,
    ``out_t = sum_j w_tj * float(y[slot t k + j])`` (module docstring); differentiable in y and weights."""
    _check(order, weights.shape[-1] if weights.dim() == 2 else 1, y, "unpermute_rows")
    if weights.dim() != 2 or weights.shape[0] != num_tokens:
        raise ValueError(f"unpermute_rows: weights must be [num_tokens={num_tokens}, k], got {tuple(weights.shape)}")
    if order.numel() != y.shape[0] or order.numel() > weights.numel():
        raise ValueError(
            f"unpermute_rows: order has {order.numel()} slots for {y.shape[0]} rows and {weights.numel()} slots "
            "(num_tokens x k)"
        )
    if not weights.is_floating_point() or weights.device != y.device:
        raise TypeError(
            f"unpermute_rows: weights must be floating point on {y.device}, got {weights.dtype} on {weights.device}"
        )
    return _Unpermute.apply(y, order, weights, num_tokens, out_dtype or y.dtype)
