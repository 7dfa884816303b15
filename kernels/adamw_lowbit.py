"""Triton twin of csrc/adamw_lowbit_kernels.cu: AdamW with 8- or 4-bit block-quantized moments, one program per block.

The contract (llmpar/ops/lowbit.py): per block of B elements (8 bits: 256, 4 bits: 128), codes uint8 (4 bits: element
2i in the low nibble of byte i, 2i + 1 in the high one), a float32 scale per block (its absmax), float32 maps of 2^bits
entries (m signed, v unsigned) passed as tensors. Per element, in float32, t = the tensor's step (already incremented):
    g = float(grad) * gscale;  m = qmap_m[code] * scale;  v = qmap_v[code] * scale;  p = p * (1 - lr * wd)
    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g g
    p = p - lr / bc1 * (m / (sqrt(v) * (1 / sqrt(bc2)) + eps)),   bcK = 1 - betaK**t
then per block s = max |m| (|v|), y = m * (1 / s) (y = 0 where s = 0) and code = the number of midpoints < y (midpoints
mid[k] = (q[k] + q[k+1]) / 2 in float32, given as a tensor): for 4 bits an unrolled compare over the 15 midpoints, for 8
bits a binary search of 8 steps over the 255. p is the float32 param, or the float32 master with the bf16 param rounded
from it (to nearest even, on the bits: the interpreter's own cast truncates) in the same pass. A nonzero found_inf
masks every lane: nothing is read or written. Every division and square root rounds to nearest (tl.math.div_rn /
sqrt_rn, as the CUDA twin's IEEE `/` and sqrtf): Triton's plain `/` and tl.sqrt compile to div.full / sqrt.approx,
which move a value sitting on a midpoint to the neighbouring code (tests/test_lowbit_kernels.py reads the sm_90 PTX).

One launch covers all tensors: the int64 ``table`` has TABLE_ROWS rows of n entries; program b finds its tensor by
binary search in row 0 (the first program of each tensor; kernels/multi_tensor.py). Runs under ``TRITON_INTERPRET=1``
on CPU tensors.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton
from .adamw import _tl, log_beta
from .multi_tensor import first_programs, table_to_device

__all__ = ["HAS_TRITON", "INTERPRETED", "TRITON_IMPORT_ERROR", "BLOCK", "TABLE_ROWS", "step"]

BLOCK = {8: 256, 4: 128}  # = llmpar.ops.lowbit.BLOCK (a test checks)
TABLE_ROWS = ("first", "param", "grad", "m_codes", "m_scale", "v_codes", "v_scale", "master", "step", "numel")

if HAS_TRITON:
    from .adamw import _bf16_bits, _one_minus_pow
    from .multi_tensor import _owner

    @triton.jit
    def _codes_of(ptr, blk, lane, idx, mask, BITS: tl.constexpr, B: tl.constexpr):
        """The codes of block ``blk`` (int32 [B]); lane = arange(B), idx = blk * B + lane."""
        if BITS == 8:
            return tl.load(ptr + idx, mask=mask, other=0).to(tl.int32)
        byte = tl.load(ptr + blk * (B // 2) + lane // 2, mask=mask, other=0).to(tl.int32)
        return (byte >> ((lane & 1) * 4)) & 15

    @triton.jit
    def _search(mids_ptr, y, BITS: tl.constexpr):
        """The number of midpoints < y (int32, the shape of y)."""
        code = tl.zeros(y.shape, tl.int32)
        if BITS == 4:
            for k in tl.static_range(15):
                code += (tl.load(mids_ptr + k) < y).to(tl.int32)
        else:
            for lvl in tl.static_range(8):  # stride 128 >> lvl
                code += tl.where(tl.load(mids_ptr + code + ((128 >> lvl) - 1)) < y, 128 >> lvl, 0)
        return code

    @triton.jit
    def _store_codes(ptr, blk, lane, idx, mask, code, BITS: tl.constexpr, B: tl.constexpr):
        if BITS == 8:
            tl.store(ptr + idx, code.to(tl.uint8), mask=mask)
        else:
            lo, hi = tl.split(tl.reshape(tl.where(mask, code, 0), (B // 2, 2)))
            pair = tl.arange(0, B // 2)
            pmask = tl.reshape(mask, (B // 2, 2)).to(tl.int32)
            lo_ok, _ = tl.split(pmask)
            tl.store(ptr + blk * (B // 2) + pair, (lo | (hi << 4)).to(tl.uint8), mask=lo_ok != 0)

    @triton.jit(do_not_specialize=["n"])
    def _adamw_lowbit_kernel(
        table_ptr,
        n,
        qm_ptr,
        qv_ptr,
        midm_ptr,
        midv_ptr,
        lr_ptr,
        lr_value,
        gscale_ptr,
        found_inf_ptr,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        ln_beta1,
        ln_beta2,
        eps,
        weight_decay,
        BITS: tl.constexpr,
        B: tl.constexpr,
        G_DTYPE: tl.constexpr,
        MASTER: tl.constexpr,
        LR_ON_DEVICE: tl.constexpr,
        HAS_GSCALE: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = _owner(table_ptr, n, pid)
        blk = pid - tl.load(table_ptr + t)
        p_ptr = tl.load(table_ptr + 1 * n + t).to(tl.pointer_type(tl.bfloat16 if MASTER else tl.float32))
        g_ptr = tl.load(table_ptr + 2 * n + t).to(tl.pointer_type(G_DTYPE))
        mc_ptr = tl.load(table_ptr + 3 * n + t).to(tl.pointer_type(tl.uint8))
        ms_ptr = tl.load(table_ptr + 4 * n + t).to(tl.pointer_type(tl.float32))
        vc_ptr = tl.load(table_ptr + 5 * n + t).to(tl.pointer_type(tl.uint8))
        vs_ptr = tl.load(table_ptr + 6 * n + t).to(tl.pointer_type(tl.float32))
        x_ptr = tl.load(table_ptr + 7 * n + t).to(tl.pointer_type(tl.float32))
        step = tl.load(tl.load(table_ptr + 8 * n + t).to(tl.pointer_type(tl.float32)))
        numel = tl.load(table_ptr + 9 * n + t)
        if HAS_FOUND_INF:  # skip: every lane masked off
            numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)
        lane = tl.arange(0, B)
        idx = blk * B + lane
        mask = idx < numel
        live = blk * B < numel
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float32)
        else:
            lr = lr_value
        step_size = tl.math.div_rn(lr, _one_minus_pow(ln_beta1, step))
        bc2_rsqrt = tl.math.div_rn(1.0, tl.math.sqrt_rn(_one_minus_pow(ln_beta2, step)))

        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_GSCALE:
            g = g * tl.load(gscale_ptr)
        m = tl.load(qm_ptr + _codes_of(mc_ptr, blk, lane, idx, mask, BITS, B)) * tl.load(
            ms_ptr + blk, mask=live, other=0.0
        )
        v = tl.load(qv_ptr + _codes_of(vc_ptr, blk, lane, idx, mask, BITS, B)) * tl.load(
            vs_ptr + blk, mask=live, other=0.0
        )
        if MASTER:
            p = tl.load(x_ptr + idx, mask=mask, other=0.0)
        else:
            p = tl.load(p_ptr + idx, mask=mask, other=0.0)
        p = p * (1.0 - lr * weight_decay)
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * (g * g)
        p = p - step_size * tl.math.div_rn(m, tl.math.sqrt_rn(v) * bc2_rsqrt + eps)
        if MASTER:
            tl.store(x_ptr + idx, p, mask=mask)
            tl.store(p_ptr + idx, _bf16_bits(p, 0, True).to(tl.bfloat16), mask=mask)
        else:
            tl.store(p_ptr + idx, p, mask=mask)

        m_abs = tl.max(tl.where(mask, tl.abs(m), 0.0), axis=0)
        v_abs = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0)
        y_m = m * tl.math.div_rn(1.0, tl.where(m_abs == 0.0, 1.0, m_abs))  # s == 0: m == 0, y = 0 (entry nearest 0)
        y_v = v * tl.math.div_rn(1.0, tl.where(v_abs == 0.0, 1.0, v_abs))
        _store_codes(mc_ptr, blk, lane, idx, mask, _search(midm_ptr, y_m, BITS), BITS, B)
        _store_codes(vc_ptr, blk, lane, idx, mask, _search(midv_ptr, y_v, BITS), BITS, B)
        tl.store(ms_ptr + blk, m_abs, mask=live)
        tl.store(vs_ptr + blk, v_abs, mask=live)


def step(
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    masters,
    steps,
    qmap_m,
    qmap_v,
    *,
    bits: int,
    lr,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale=None,
    found_inf=None,
) -> None:
    """One low-bit AdamW step over all tensors in one launch (module docstring). Flat contiguous tensors on one
    device: params float32 (masters None) or bfloat16 (masters float32); grads one float dtype; steps float32 scalars,
    already incremented; maps float32 [2^bits]. lr: float or a float32 device scalar; gscale / found_inf: float32
    device scalars or None. Checks are the caller's (llmpar/ops/lowbit_kernels.py)."""
    import torch

    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    n = len(params)
    if n == 0:
        return
    block = BLOCK[bits]
    first, programs = first_programs([p.numel() for p in params], block)
    ptr = lambda ts: [t.data_ptr() for t in ts]  # noqa: E731
    rows = (
        first
        + ptr(params)
        + ptr(grads)
        + ptr(m_codes)
        + ptr(m_scales)
        + ptr(v_codes)
        + ptr(v_scales)
        + (ptr(masters) if masters is not None else [0] * n)
        + ptr(steps)
        + [p.numel() for p in params]
    )
    device = params[0].device
    table = table_to_device(rows, device, "adamw_lowbit_step")
    mid_m = ((qmap_m[:-1] + qmap_m[1:]) / 2).contiguous()  # float32, as the contract computes them
    mid_v = ((qmap_v[:-1] + qmap_v[1:]) / 2).contiguous()
    lr_on_device = isinstance(lr, torch.Tensor)
    _adamw_lowbit_kernel[(programs,)](
        table,
        n,
        qmap_m,
        qmap_v,
        mid_m,
        mid_v,
        lr if lr_on_device else table,
        0.0 if lr_on_device else float(lr),
        gscale if gscale is not None else table,
        found_inf if found_inf is not None else table,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        log_beta(beta1),
        log_beta(beta2),
        eps,
        weight_decay,
        BITS=int(bits),
        B=block,
        G_DTYPE=_tl(grads[0].dtype),
        MASTER=masters is not None,
        LR_ON_DEVICE=lr_on_device,
        HAS_GSCALE=gscale is not None,
        HAS_FOUND_INF=found_inf is not None,
    )
