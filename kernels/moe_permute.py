"""Triton kernels of the MoE token permutation (llmpar/ops/moe_permute.py states the math): rows gathered by an
inverse slot map and summed per token with optional weights (the unpermute with the routing weights applied, and the
permute's backward), and the unpermute's backward (each kept slot's row gradient scaled by its weight, and the
weight's gradient as a row dot product). One program per (token, column block) or per slot row; fp32 accumulation,
the k slots of a token taken in slot order; no atomics (every output element has one writer).
"""

from __future__ import annotations

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton  # noqa: F401

BLOCK_H = 128  # columns per program (interpreter: 32)

if HAS_TRITON:

    @triton.jit
    def _gather_sum_kernel(
        src_ptr,  # [N, H] rows of the kept slots
        inv_ptr,  # [T * k] int64: the row of slot s in src, -1 for a dropped slot
        w_ptr,  # [T * k] fp32 (HAS_W)
        out_ptr,  # [T, H]
        H,
        stride_src,
        stride_out,
        K: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            s = tl.cast(t, tl.int64) * K + j
            row = tl.load(inv_ptr + s)
            kept = (row + tl.zeros((BLOCK,), dtype=tl.int64)) >= 0  # a block mask (interpreters reject scalar ones)
            v = tl.load(src_ptr + tl.maximum(row, 0) * stride_src + cols, mask=mask & kept, other=0.0)
            v = v.to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + s)
            acc += v
        tl.store(out_ptr + tl.cast(t, tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _unpermute_bwd_kernel(
        grad_ptr,  # [T, H] output gradient
        y_ptr,  # [N, H] the rows the forward weighed
        order_ptr,  # [N] slot of row i
        w_ptr,  # [T * k] fp32
        dy_ptr,  # [N, H]
        dw_ptr,  # [T * k] fp32 (zero-filled: dropped slots keep 0)
        H,
        stride_grad,
        stride_y,
        stride_dy,
        K: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.cast(tl.program_id(0), tl.int64)
        s = tl.load(order_ptr + i)
        t = s // K
        w = tl.load(w_ptr + s)
        dot = tl.zeros((BLOCK,), dtype=tl.float32)
        if INTERPRETER:  # the interpreter (numpy >= 2.4) cannot run `for` over a runtime bound
            h0 = 0
            while h0 < H:
                dot = _bwd_step(grad_ptr, y_ptr, dy_ptr, dot, h0, t, i, w, H, stride_grad, stride_y, stride_dy, BLOCK)
                h0 += BLOCK
        else:
            for h0 in range(0, H, BLOCK):
                dot = _bwd_step(grad_ptr, y_ptr, dy_ptr, dot, h0, t, i, w, H, stride_grad, stride_y, stride_dy, BLOCK)
        tl.store(dw_ptr + s, tl.sum(dot, axis=0))

    @triton.jit
    def _bwd_step(grad_ptr, y_ptr, dy_ptr, dot, h0, t, i, w, H, stride_grad, stride_y, stride_dy, BLOCK: tl.constexpr):
        cols = h0 + tl.arange(0, BLOCK)
        mask = cols < H
        g = tl.load(grad_ptr + t * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + i * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dy_ptr + i * stride_dy + cols, (g * w).to(dy_ptr.dtype.element_ty), mask=mask)
        return dot + g * yv


def _block(h: int) -> int:
    return 32 if INTERPRETED else min(BLOCK_H, triton.next_power_of_2(max(h, 16)))


def gather_sum(src, inv, weights, out, top_k: int) -> None:
    """out[t] = sum_j w[t k + j] * src[inv[t k + j]] (w = 1 when ``weights`` is None; inv -1: the slot counts 0)."""
    T, H = out.shape
    if T == 0 or H == 0:
        return
    block = _block(H)
    grid = (T, triton.cdiv(H, block))
    w = weights if weights is not None else inv
    _gather_sum_kernel[grid](
        src, inv, w, out, H, src.stride(0), out.stride(0), K=top_k, HAS_W=weights is not None, BLOCK=block
    )


def unpermute_backward(grad, y, order, weights, dy, dw, top_k: int) -> None:
    """dy[i] = w[order[i]] * grad[order[i] // k]; dw[order[i]] = <grad[order[i] // k], y[i]> (dw pre-zeroed)."""
    N, H = y.shape
    if N == 0:
        return
    _unpermute_bwd_kernel[(N,)](
        grad,
        y,
        order,
        weights,
        dy,
        dw,
        H,
        grad.stride(0),
        y.stride(0),
        dy.stride(0),
        K=top_k,
        INTERPRETER=INTERPRETED,
        BLOCK=_block(H),
    )
