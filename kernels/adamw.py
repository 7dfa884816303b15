"""Triton twin of csrc/adamw_kernels.cu: one multi-tensor AdamW launch for every precision mode, and the grad-norm pass.

AdamW (decoupled weight decay, torch's formula), per element, in float32, t = the tensor's step (already incremented):
    g  = float(grad) * gscale                      (gscale: clip coefficient / loss unscale, a device scalar or 1)
    p  = p * (1 - lr * wd)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps),   bcK = 1 - betaK**t = -expm1(t * ln(betaK))
Modes (MODE, an integer code chosen by the caller: llmpar/ops/adamw.py owns the table of modes and their codes, the
same as the C enum LlmparAdamwMode of csrc/adamw.cuh): 0 "fp32" (p, m, v float32); 1 "fp32_master" (x = float32 master
is p; the bf16/fp16 param is rewritten from it, round to nearest); 2 "bf16_sr" (p, m, v bfloat16, every write
stochastically rounded); 3 "bf16_kahan" (p, m, v bfloat16 round to nearest, x = bfloat16 Kahan compensation of p).
A nonzero found_inf skips the whole step.

One launch covers all tensors. The int64 ``table`` has 9 rows of n entries (row-major, see TABLE_ROWS): program b
finds its tensor by binary search in row 0 (first program of each tensor; kernels/multi_tensor.py), then handles BLOCK
elements of it.
Stochastic rounding adds a 16-bit hash of (seed, step, salt, element index) below the bfloat16 mantissa and truncates:
the same bits as csrc/adamw_kernels.cu, so a run is reproducible. Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import math

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton
from .multi_tensor import first_programs, table_to_device

__all__ = ["HAS_TRITON", "INTERPRETED", "TRITON_IMPORT_ERROR", "BLOCK", "TABLE_ROWS", "log_beta", "step", "sum_squares"]

BLOCK = 1024
# rows of the table: first program, param, grad, exp_avg, exp_avg_sq, extra (master / compensation / 0), step, numel,
# salt (a stable per-tensor id for the random stream)
TABLE_ROWS = ("first", "param", "grad", "exp_avg", "exp_avg_sq", "extra", "step", "numel", "salt")

if HAS_TRITON:
    from .multi_tensor import _owner

    @triton.jit
    def _hash32(x):
        """A 32-bit integer mixer (Wellons' hash-prospector, constants < 2**31). x: uint32 -> uint32."""
        x = x ^ (x >> 16)
        x = x * 0x21F0AAAD
        x = x ^ (x >> 15)
        x = x * 0x735A2D97
        x = x ^ (x >> 15)
        return x

    @triton.jit
    def _bf16_bits(x, r, NEAREST: tl.constexpr):
        """float32 x rounded to a bfloat16 value (returned as float32, exactly representable in bfloat16).

        NEAREST: round to nearest even; else stochastic with r (uint32, low 16 bits used). NaN stays NaN. Done on the
        bits so that the compiled kernel and the interpreter (numpy has no bfloat16) round alike."""
        bits = x.to(tl.uint32, bitcast=True)
        if NEAREST:
            add = 0x7FFF + ((bits >> 16) & 1)
        else:
            add = r & 0xFFFF
        out = ((bits + add) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, out)

    @triton.jit
    def _one_minus_pow(ln_b, t):
        """1 - b**t = -expm1(t * ln b), with Kahan's expm1 from exp and log (accurate for tiny t * ln b)."""
        x = t * ln_b
        u = tl.exp(x)
        em1 = tl.where(u == 1.0, x, tl.math.div_rn((u - 1.0) * x, tl.log(u)))  # IEEE: see adamw_lowbit.py
        em1 = tl.where(u == 0.0, -1.0, em1)
        return -em1

    # seed and n are plain runtime values: without do_not_specialize, Triton turns an int argument equal to 1 into a
    # constant (seed=1: `seed.to(tl.uint32)` then fails to compile) and compiles a variant per value class of each
    @triton.jit(do_not_specialize=["n", "seed"])
    def _adamw_kernel(
        table_ptr,
        n,
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
        seed,
        MODE: tl.constexpr,
        P_DTYPE: tl.constexpr,
        G_DTYPE: tl.constexpr,
        S_DTYPE: tl.constexpr,
        X_DTYPE: tl.constexpr,
        LR_ON_DEVICE: tl.constexpr,
        HAS_GSCALE: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = _owner(table_ptr, n, pid)
        first = tl.load(table_ptr + t)
        p_ptr = tl.load(table_ptr + 1 * n + t).to(tl.pointer_type(P_DTYPE))
        g_ptr = tl.load(table_ptr + 2 * n + t).to(tl.pointer_type(G_DTYPE))
        m_ptr = tl.load(table_ptr + 3 * n + t).to(tl.pointer_type(S_DTYPE))
        v_ptr = tl.load(table_ptr + 4 * n + t).to(tl.pointer_type(S_DTYPE))
        x_ptr = tl.load(table_ptr + 5 * n + t).to(tl.pointer_type(X_DTYPE))
        step = tl.load(tl.load(table_ptr + 6 * n + t).to(tl.pointer_type(tl.float32)))
        numel = tl.load(table_ptr + 7 * n + t)
        salt = tl.load(table_ptr + 8 * n + t)

        if HAS_FOUND_INF:  # skip: every lane masked off, so nothing is read or written
            numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)
        idx = (pid - first) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < numel
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float32)
        else:
            lr = lr_value
        bc1 = _one_minus_pow(ln_beta1, step)
        bc2 = _one_minus_pow(ln_beta2, step)
        step_size = lr / bc1
        bc2_sqrt = tl.sqrt(bc2)

        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_GSCALE:
            g = g * tl.load(gscale_ptr)
        if MODE == 1:
            p = tl.load(x_ptr + idx, mask=mask, other=0.0)
        else:
            p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)

        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * (g * g)
        denom = tl.sqrt(v) / bc2_sqrt + eps
        upd = step_size * (m / denom)

        if MODE == 0:
            tl.store(p_ptr + idx, p * (1.0 - lr * weight_decay) - upd, mask=mask)
            tl.store(m_ptr + idx, m, mask=mask)
            tl.store(v_ptr + idx, v, mask=mask)
        elif MODE == 1:
            p = p * (1.0 - lr * weight_decay) - upd
            tl.store(x_ptr + idx, p, mask=mask)
            if P_DTYPE == tl.bfloat16:
                tl.store(p_ptr + idx, _bf16_bits(p, 0, True).to(P_DTYPE), mask=mask)
            else:
                tl.store(p_ptr + idx, p.to(P_DTYPE), mask=mask)
            tl.store(m_ptr + idx, m, mask=mask)
            tl.store(v_ptr + idx, v, mask=mask)
        elif MODE == 2:
            key = _hash32(_hash32(step.to(tl.uint32) * 0x3C6EF372 + salt.to(tl.uint32)) ^ seed.to(tl.uint32))
            r = _hash32(idx.to(tl.uint32) + key)
            r2 = _hash32(r ^ 0x5BD1E995)
            tl.store(p_ptr + idx, _bf16_bits(p * (1.0 - lr * weight_decay) - upd, r, False).to(P_DTYPE), mask=mask)
            tl.store(m_ptr + idx, _bf16_bits(m, r >> 16, False).to(S_DTYPE), mask=mask)
            tl.store(v_ptr + idx, _bf16_bits(v, r2, False).to(S_DTYPE), mask=mask)
        else:
            c = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            y = (-(lr * weight_decay) * p - upd) + c
            p_new = _bf16_bits(p + y, 0, True)
            c_new = _bf16_bits(y - (p_new - p), 0, True)
            tl.store(p_ptr + idx, p_new.to(P_DTYPE), mask=mask)
            tl.store(x_ptr + idx, c_new.to(X_DTYPE), mask=mask)
            tl.store(m_ptr + idx, _bf16_bits(m, 0, True).to(S_DTYPE), mask=mask)
            tl.store(v_ptr + idx, _bf16_bits(v, 0, True).to(S_DTYPE), mask=mask)

    @triton.jit(do_not_specialize=["n"])
    def _sum_squares_kernel(table_ptr, n, out_ptr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        """out[pid] = sum of squares (float32) of this program's BLOCK elements; table rows: first, address, numel."""
        pid = tl.program_id(0)
        t = _owner(table_ptr, n, pid)
        first = tl.load(table_ptr + t)
        g_ptr = tl.load(table_ptr + n + t).to(tl.pointer_type(G_DTYPE))
        numel = tl.load(table_ptr + 2 * n + t)
        idx = (pid - first) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(g * g, axis=0))


def log_beta(beta: float) -> float:
    """ln(beta) for the bias corrections; -inf for beta == 0 (then 1 - beta**t = 1 for every t >= 1, which the kernels'
    expm1 gives from exp(-inf) = 0)."""
    return math.log(beta) if beta > 0.0 else float("-inf")


def _tl(dtype):
    import torch

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def step(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    extras,
    steps,
    salts,
    *,
    mode: int,
    lr,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale=None,
    found_inf=None,
    seed: int = 0,
) -> None:
    """One AdamW step over all tensors in one launch (see the module docstring for the math and the modes).

    mode: the integer code of the precision mode (0 fp32, 1 fp32_master, 2 bf16_sr, 3 bf16_kahan).
    All lists have the same length; tensors contiguous, non-empty, on one device, one dtype per list. extras: masters
    (fp32_master), compensations (bf16_kahan) or None. steps: float32 scalars, already incremented. lr: float or a
    float32 device scalar. gscale / found_inf: float32 device scalars or None. Checks are the caller's (llmpar/ops).
    """
    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    n = len(params)
    if n == 0:
        return
    first, programs = first_programs([p.numel() for p in params], BLOCK)
    extra_ptrs = [x.data_ptr() for x in extras] if extras is not None else [0] * n
    rows = (
        first
        + [t.data_ptr() for t in params]
        + [t.data_ptr() for t in grads]
        + [t.data_ptr() for t in exp_avgs]
        + [t.data_ptr() for t in exp_avg_sqs]
        + extra_ptrs
        + [s.data_ptr() for s in steps]
        + [p.numel() for p in params]
        + [int(s) & 0xFFFFFFFF for s in salts]
    )
    device = params[0].device
    table = table_to_device(rows, device, "adamw_step")
    lr_on_device = not isinstance(lr, float)
    x_dtype = extras[0].dtype if extras is not None else params[0].dtype
    _adamw_kernel[(programs,)](
        table,
        n,
        lr if lr_on_device else table,
        0.0 if lr_on_device else lr,
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
        int(seed) & 0x7FFFFFFF,
        MODE=int(mode),
        P_DTYPE=_tl(params[0].dtype),
        G_DTYPE=_tl(grads[0].dtype),
        S_DTYPE=_tl(exp_avgs[0].dtype),
        X_DTYPE=_tl(x_dtype),
        LR_ON_DEVICE=lr_on_device,
        HAS_GSCALE=gscale is not None,
        HAS_FOUND_INF=found_inf is not None,
        BLOCK=BLOCK,
    )


def sum_squares(grads, out_dtype=None):
    """float32 partial sums of squares over all ``grads`` (one dtype, contiguous, non-empty), one per program:
    ``sum(partials)`` is the squared L2 norm of all of them together. One launch."""
    import torch

    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    first, programs = first_programs([g.numel() for g in grads], BLOCK)
    device = grads[0].device
    table = table_to_device(first + [g.data_ptr() for g in grads] + [g.numel() for g in grads], device, "sum_squares")
    partials = torch.empty(programs, dtype=torch.float32, device=device)
    _sum_squares_kernel[(programs,)](table, len(grads), partials, G_DTYPE=_tl(grads[0].dtype), BLOCK=BLOCK)
    return partials
