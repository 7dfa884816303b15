"""Device helpers both passes of the Triton flash attention use (kernels/attention.py): ``_dot`` (acc + a @ b in fp32:
IEEE fp32 products, or the 16-bit / TF32 tensor cores; under the interpreter on fp32 operands) and ``_visible`` (which
(row, key) pairs of a block are seen: inside both blocks, causal by global position, key not padding), with the
position sentinels of padding rows and keys as Triton constants."""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton
from .attention_tiles import POS_MAX, POS_MIN

if HAS_TRITON:
    _POS_MIN, _POS_MAX = tl.constexpr(POS_MIN), tl.constexpr(POS_MAX)

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr, INTERPRETER: tl.constexpr):
        """acc + a @ b in fp32."""
        if INTERPRETER:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _visible(
        offs_m, offs_n, Sq, Sk, qp, kp_ptr, valid_row_ptr, s_vn, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr
    ):
        """[BLOCK_M, BLOCK_N] bool: inside both blocks, causal by position, key not padding."""
        mask_n = offs_n < Sk
        ok = (offs_m < Sq)[:, None] & mask_n[None, :]
        if CAUSAL:
            kp = tl.load(kp_ptr + offs_n, mask=mask_n, other=_POS_MAX)
            ok = ok & (kp[None, :] <= qp[:, None])
        if HAS_VALID:
            vl = tl.load(valid_row_ptr + offs_n.to(tl.int64) * s_vn, mask=mask_n, other=0)
            ok = ok & (vl != 0)[None, :]
        return ok
