"""Triton flash attention: forward (online softmax over key blocks, writes out and the row log-sum-exp) and backward.

Math and layout: llmpar/ops/attention.py (q: [B, Hq, Sq, D], k / v: [B, Hkv, Sk, D], any strides; Hq % Hkv == 0;
masks by global index q_pos / k_pos and key padding k_valid [B, Sk]; empty rows give out 0 and lse -inf).
Scores use exp2 with log2(e) folded into the scale; every product accumulates in fp32; the probabilities are rounded
to v's dtype before the P @ V product (as FlashAttention does: 16-bit tensor cores); fp32 inputs use IEEE fp32 products
unless ``allow_tf32``. head_dim is padded to a power of two >= 16 (masked loads), at most 128.

Kernels (grid: one program per (batch x head, row block); batch x head on axis 0, which takes 2^31 - 1 programs where
axes 1 / 2 stop at 65535):
    _fwd_kernel:   per query block, loop over key blocks: m, l, acc (online softmax) -> out, lse
    _delta_kernel: delta = rowsum(dout * out) in fp32 (the backward's preprocess)
    _dq_kernel:    per query block, loop over key blocks: dq = scale * sum_j ds k
    _dkdv_kernel:  per key block of one key/value head, loop over the query heads of its group and the query blocks:
                   dv = sum p^T dout, dk = scale * sum ds^T q
Two backward kernels that each recompute p (FlashAttention-2's split), not one with fp32 atomics for dq: no fp32 dq
scratch, deterministic sums, GQA's dk / dv summed in one program. out / lse are taken as given: the final ones over
all key blocks (a ring step's backward), not this block's own.

Causal blocks: loop bounds, no per-block test (kernels/attention_tiles.py computes them from the positions on the
device, no host sync). The forward and dq loops are FlashAttention-2's split: per query block, the leading n_full key
blocks every row sees whole run without the position compare, then [n_full, n_end) (the diagonal) with it; dk / dv
loops over the query blocks [m_start, end) with the compare (one loop: a second body pushed sm_90's dkdv over 255
registers). The same blocks in the same order as one masked loop, so the sums are the same bits. No branch around
the K / V loads, so Triton pipelines every loop (num_stages buffers in shared memory, as in the non-causal kernels).
With sorted positions (contiguous, zigzag, ring) the ranges are exactly the blocks a diagonal touches; unsorted
positions stay correct (a masked block in range that no row sees adds exact zeros).
Under TRITON_INTERPRET=1 (CPU) 16 x 16 blocks run and dot operands are widened to fp32 (the interpreter's dot
mishandles 16-bit; the rounding of p to v's dtype is kept).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton  # noqa: F401
from .attention_tiles import INTERPRET_CONFIG, POS_MAX, POS_MIN, _block_tables, config, row_blocks  # noqa: F401

MAX_HEAD_DIM = 128
LOG2E = 1.4426950408889634

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

    @triton.jit
    def _fwd_step(
        acc,
        m_i,
        l_i,
        q,
        qp,
        j,
        offs_m,
        offs_n0,
        offs_d,
        Sq,
        Sk,
        D,
        k_base,
        v_base,
        s_kn,
        s_kd,
        s_vn,
        s_vd,
        kp_ptr,
        valid_row_ptr,
        s_ln,
        qk_scale,
        CAUSAL: tl.constexpr,
        HAS_VALID: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One key block j of the online softmax; CAUSAL: compare positions (the diagonal blocks only)."""
        offs_n = j * BLOCK_N + offs_n0
        rn = offs_n.to(tl.int64)
        kv_mask = (offs_n < Sk)[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_base + rn[:, None] * s_kn + offs_d[None, :] * s_kd, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE, INTERPRETER) * qk_scale
        ok = _visible(offs_m, offs_n, Sq, Sk, qp, kp_ptr, valid_row_ptr, s_ln, CAUSAL, HAS_VALID)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no inf - inf
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + rn[:, None] * s_vn + offs_d[None, :] * s_vd, mask=kv_mask, other=0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, INTERPRETER)
        return acc, m_new, l_i

    @triton.jit
    def _fwd_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        lse_ptr,
        qpos_ptr,
        kpos_ptr,
        valid_ptr,
        nend_ptr,
        nfull_ptr,
        qk_scale,
        Sq,
        Sk,
        H,
        G,
        D,
        s_qb,
        s_qh,
        s_qm,
        s_qd,
        s_kb,
        s_kh,
        s_kn,
        s_kd,
        s_vb,
        s_vh,
        s_vn,
        s_vd,
        s_ob,
        s_oh,
        s_om,
        s_od,
        s_lb,
        s_ln,
        CAUSAL: tl.constexpr,
        HAS_VALID: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        hk = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        rm = offs_m.to(tl.int64)
        q_mask = (offs_m < Sq)[:, None] & (offs_d < D)[None, :]
        q = tl.load(q_ptr + b * s_qb + h * s_qh + rm[:, None] * s_qm + offs_d[None, :] * s_qd, mask=q_mask, other=0.0)
        k_base = k_ptr + b * s_kb + hk * s_kh
        v_base = v_ptr + b * s_vb + hk * s_vh
        valid_row_ptr = valid_ptr + b * s_lb
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qp = offs_m
        n_full = tl.cdiv(Sk, BLOCK_N)
        n_end = n_full
        if CAUSAL:
            qp = tl.load(qpos_ptr + offs_m, mask=offs_m < Sq, other=_POS_MIN)
            n_full = tl.load(nfull_ptr + pid_m)
            n_end = tl.load(nend_ptr + pid_m)
        for j in range(0, n_full):  # key blocks every row sees whole: no causal compare
            acc, m_i, l_i = _fwd_step(
                acc,
                m_i,
                l_i,
                q,
                qp,
                j,
                offs_m,
                offs_n0,
                offs_d,
                Sq,
                Sk,
                D,
                k_base,
                v_base,
                s_kn,
                s_kd,
                s_vn,
                s_vd,
                kpos_ptr,
                valid_row_ptr,
                s_ln,
                qk_scale,
                False,
                HAS_VALID,
                IEEE,
                INTERPRETER,
                BLOCK_N,
            )
        if CAUSAL:
            for j in range(n_full, n_end):  # the diagonal: masked by position
                acc, m_i, l_i = _fwd_step(
                    acc,
                    m_i,
                    l_i,
                    q,
                    qp,
                    j,
                    offs_m,
                    offs_n0,
                    offs_d,
                    Sq,
                    Sk,
                    D,
                    k_base,
                    v_base,
                    s_kn,
                    s_kd,
                    s_vn,
                    s_vd,
                    kpos_ptr,
                    valid_row_ptr,
                    s_ln,
                    qk_scale,
                    True,
                    HAS_VALID,
                    IEEE,
                    INTERPRETER,
                    BLOCK_N,
                )
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        tl.store(
            o_ptr + b * s_ob + h * s_oh + rm[:, None] * s_om + offs_d[None, :] * s_od,
            out.to(o_ptr.dtype.element_ty),
            mask=q_mask,
        )
        tl.store(lse_ptr + bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)

    @triton.jit
    def _delta_kernel(
        o_ptr,
        do_ptr,
        delta_ptr,
        Sq,
        H,
        D,
        s_ob,
        s_oh,
        s_om,
        s_od,
        s_db,
        s_dh,
        s_dm,
        s_dd,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        rm = offs_m.to(tl.int64)
        mask = (offs_m < Sq)[:, None] & (offs_d < D)[None, :]
        o = tl.load(o_ptr + b * s_ob + h * s_oh + rm[:, None] * s_om + offs_d[None, :] * s_od, mask=mask, other=0.0)
        do = tl.load(do_ptr + b * s_db + h * s_dh + rm[:, None] * s_dm + offs_d[None, :] * s_dd, mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + bh.to(tl.int64) * Sq + offs_m, delta, mask=offs_m < Sq)

    @triton.jit
    def _dq_step(
        dq,
        q,
        do,
        lse2,
        delta,
        qp,
        j,
        offs_m,
        offs_n0,
        offs_d,
        Sq,
        Sk,
        D,
        k_base,
        v_base,
        s_kn,
        s_kd,
        s_vn,
        s_vd,
        kp_ptr,
        valid_row_ptr,
        s_ln,
        qk_scale,
        CAUSAL: tl.constexpr,
        HAS_VALID: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        offs_n = j * BLOCK_N + offs_n0
        rn = offs_n.to(tl.int64)
        kv_mask = (offs_n < Sk)[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_base + rn[:, None] * s_kn + offs_d[None, :] * s_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + rn[:, None] * s_vn + offs_d[None, :] * s_vd, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE, INTERPRETER) * qk_scale
        ok = _visible(offs_m, offs_n, Sq, Sk, qp, kp_ptr, valid_row_ptr, s_ln, CAUSAL, HAS_VALID)
        p = tl.where(ok, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE, INTERPRETER)
        ds = p * (dp - delta[:, None])
        return _dot(ds.to(k.dtype), k, dq, IEEE, INTERPRETER)

    @triton.jit
    def _dq_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        do_ptr,
        dq_ptr,
        lse_ptr,
        delta_ptr,
        qpos_ptr,
        kpos_ptr,
        valid_ptr,
        nend_ptr,
        nfull_ptr,
        qk_scale,
        sm_scale,
        Sq,
        Sk,
        H,
        G,
        D,
        s_qb,
        s_qh,
        s_qm,
        s_qd,
        s_kb,
        s_kh,
        s_kn,
        s_kd,
        s_vb,
        s_vh,
        s_vn,
        s_vd,
        s_db,
        s_dh,
        s_dm,
        s_dd,
        s_lb,
        s_ln,
        CAUSAL: tl.constexpr,
        HAS_VALID: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """dq shares q's strides (a fresh tensor like q); dout shares s_d*."""
        bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        hk = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        rm = offs_m.to(tl.int64)
        mask_m = offs_m < Sq
        q_mask = mask_m[:, None] & (offs_d < D)[None, :]
        q_off = b * s_qb + h * s_qh + rm[:, None] * s_qm + offs_d[None, :] * s_qd
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        do = tl.load(do_ptr + b * s_db + h * s_dh + rm[:, None] * s_dm + offs_d[None, :] * s_dd, mask=q_mask, other=0.0)
        row = bh.to(tl.int64) * Sq + offs_m
        lse = tl.load(lse_ptr + row, mask=mask_m, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # empty row: p = 0
        delta = tl.load(delta_ptr + row, mask=mask_m, other=0.0)
        k_base = k_ptr + b * s_kb + hk * s_kh
        v_base = v_ptr + b * s_vb + hk * s_vh
        valid_row_ptr = valid_ptr + b * s_lb
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qp = offs_m
        n_full = tl.cdiv(Sk, BLOCK_N)
        n_end = n_full
        if CAUSAL:
            qp = tl.load(qpos_ptr + offs_m, mask=mask_m, other=_POS_MIN)
            n_full = tl.load(nfull_ptr + pid_m)
            n_end = tl.load(nend_ptr + pid_m)
        for j in range(0, n_full):  # as in _fwd_kernel: whole blocks unmasked, then the diagonal
            dq = _dq_step(
                dq,
                q,
                do,
                lse2,
                delta,
                qp,
                j,
                offs_m,
                offs_n0,
                offs_d,
                Sq,
                Sk,
                D,
                k_base,
                v_base,
                s_kn,
                s_kd,
                s_vn,
                s_vd,
                kpos_ptr,
                valid_row_ptr,
                s_ln,
                qk_scale,
                False,
                HAS_VALID,
                IEEE,
                INTERPRETER,
                BLOCK_N,
            )
        if CAUSAL:
            for j in range(n_full, n_end):
                dq = _dq_step(
                    dq,
                    q,
                    do,
                    lse2,
                    delta,
                    qp,
                    j,
                    offs_m,
                    offs_n0,
                    offs_d,
                    Sq,
                    Sk,
                    D,
                    k_base,
                    v_base,
                    s_kn,
                    s_kd,
                    s_vn,
                    s_vd,
                    kpos_ptr,
                    valid_row_ptr,
                    s_ln,
                    qk_scale,
                    True,
                    HAS_VALID,
                    IEEE,
                    INTERPRETER,
                    BLOCK_N,
                )
        tl.store(dq_ptr + q_off, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _dkdv_step(
        dk,
        dv,
        k,
        v,
        kp,
        i,
        bh,
        q_base,
        do_base,
        lse_ptr,
        delta_ptr,
        qpos_ptr,
        offs_n,
        offs_m0,
        offs_d,
        Sq,
        Sk,
        D,
        s_qm,
        s_qd,
        s_dm,
        s_dd,
        vl,
        qk_scale,
        CAUSAL: tl.constexpr,
        HAS_VALID: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Query block i's share of dk / dv; CAUSAL: compare positions (the diagonal blocks only)."""
        offs_m = i * BLOCK_M + offs_m0
        rm = offs_m.to(tl.int64)
        mask_m = offs_m < Sq
        q_mask = mask_m[:, None] & (offs_d < D)[None, :]
        q = tl.load(q_base + rm[:, None] * s_qm + offs_d[None, :] * s_qd, mask=q_mask, other=0.0)
        do = tl.load(do_base + rm[:, None] * s_dm + offs_d[None, :] * s_dd, mask=q_mask, other=0.0)
        row = bh.to(tl.int64) * Sq + offs_m
        lse = tl.load(lse_ptr + row, mask=mask_m, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(delta_ptr + row, mask=mask_m, other=0.0)
        ok = mask_m[None, :] & (offs_n < Sk)[:, None]  # [BLOCK_N, BLOCK_M]: keys x queries
        if CAUSAL:
            qp = tl.load(qpos_ptr + offs_m, mask=mask_m, other=_POS_MIN)
            ok = ok & (kp[:, None] <= qp[None, :])
        if HAS_VALID:
            ok = ok & (vl != 0)[:, None]
        st = _dot(k, tl.trans(q), tl.zeros([k.shape[0], BLOCK_M], tl.float32), IEEE, INTERPRETER) * qk_scale
        pt = tl.where(ok, tl.math.exp2(st - lse2[None, :]), 0.0)
        dv = _dot(pt.to(do.dtype), do, dv, IEEE, INTERPRETER)
        dpt = _dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32), IEEE, INTERPRETER)
        dst = pt * (dpt - delta[None, :])
        dk = _dot(dst.to(q.dtype), q, dk, IEEE, INTERPRETER)
        return dk, dv

    @triton.jit
    def _dkdv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        do_ptr,
        dk_ptr,
        dv_ptr,
        lse_ptr,
        delta_ptr,
        qpos_ptr,
        kpos_ptr,
        valid_ptr,
        mstart_ptr,
        qk_scale,
        sm_scale,
        Sq,
        Sk,
        H,
        G,
        D,
        s_qb,
        s_qh,
        s_qm,
        s_qd,
        s_kb,
        s_kh,
        s_kn,
        s_kd,
        s_vb,
        s_vh,
        s_vn,
        s_vd,
        s_db,
        s_dh,
        s_dm,
        s_dd,
        s_lb,
        s_ln,
        CAUSAL: tl.constexpr,
        HAS_VALID: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Grid (B x Hkv, key blocks); dk / dv share k's / v's strides (fresh tensors like them)."""
        bhk = tl.program_id(0)
        pid_n = tl.program_id(1)
        Hkv = H // G
        b = (bhk // Hkv).to(tl.int64)
        hk = (bhk % Hkv).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        rn = offs_n.to(tl.int64)
        mask_n = offs_n < Sk
        kv_mask = mask_n[:, None] & (offs_d < D)[None, :]
        k_off = b * s_kb + hk * s_kh + rn[:, None] * s_kn + offs_d[None, :] * s_kd
        v_off = b * s_vb + hk * s_vh + rn[:, None] * s_vn + offs_d[None, :] * s_vd
        k = tl.load(k_ptr + k_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off, mask=kv_mask, other=0.0)
        kp = offs_n
        m_start = 0
        if CAUSAL:
            kp = tl.load(kpos_ptr + offs_n, mask=mask_n, other=_POS_MAX)
            m_start = tl.load(mstart_ptr + pid_n)
        vl = offs_n
        if HAS_VALID:
            vl = tl.load(valid_ptr + b * s_lb + rn * s_ln, mask=mask_n, other=0)
        m_blocks = tl.cdiv(Sq, BLOCK_M)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for g in range(0, G):  # the query heads that read this key/value head
            h = hk * G + g
            q_base = q_ptr + b * s_qb + h * s_qh
            do_base = do_ptr + b * s_db + h * s_dh
            for i in range(m_start, m_blocks):  # the loop bounds skip what no row sees; the mask does the rest
                dk, dv = _dkdv_step(
                    dk,
                    dv,
                    k,
                    v,
                    kp,
                    i,
                    b * H + h,
                    q_base,
                    do_base,
                    lse_ptr,
                    delta_ptr,
                    qpos_ptr,
                    offs_n,
                    offs_m0,
                    offs_d,
                    Sq,
                    Sk,
                    D,
                    s_qm,
                    s_qd,
                    s_dm,
                    s_dd,
                    vl,
                    qk_scale,
                    CAUSAL,
                    HAS_VALID,
                    IEEE,
                    INTERPRETER,
                    BLOCK_M,
                )
        tl.store(dk_ptr + k_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + v_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def _arch(device) -> int:
    """sm version of a CUDA ``device`` (80, 90, ...), 0 elsewhere (the interpreter's config then)."""
    return 0 if device.type != "cuda" else int("%d%d" % torch.cuda.get_device_capability(device))


def _common(q, k, v, causal, q_pos, k_pos, k_valid, allow_tf32):
    """Flags, positions and the key-padding view shared by the forward and backward launches."""
    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    (B, H, Sq, D), Sk = q.shape, k.shape[2]
    block_d = max(16, triton.next_power_of_2(D))
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} > {MAX_HEAD_DIM}: the Triton attention kernels hold a row in registers")
    qp, kp = (
        None
        if not causal
        else torch.arange(n, dtype=torch.int32, device=q.device)
        if p is None
        else p.to(device=q.device, dtype=torch.int32).contiguous()
        for p, n in ((q_pos, Sq), (k_pos, Sk))
    )
    valid = k_valid.view(torch.uint8) if k_valid is not None else None
    flags = dict(
        CAUSAL=bool(causal),
        HAS_VALID=k_valid is not None,
        IEEE=q.element_size() == 4 and not allow_tf32,
        INTERPRETER=INTERPRETED,
    )
    return B, H, Sq, Sk, D, block_d, qp, kp, valid, flags


def attention_fwd(
    q, k, v, *, scale: float, causal: bool = True, q_pos=None, k_pos=None, k_valid=None, allow_tf32: bool = False
):
    """(out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] fp32). q, k, v share one dtype (fp32 / bf16 / fp16) and a
    CUDA device (or CPU under the interpreter); checks are the caller's (llmpar/ops/attention.py)."""
    B, H, Sq, Sk, D, block_d, qp, kp, valid, flags = _common(q, k, v, causal, q_pos, k_pos, k_valid, allow_tf32)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or Sk == 0:
        return out, lse
    cfg = config("fwd", q.element_size(), block_d, _arch(q.device))
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n_end = n_full = out
    if causal:
        n_end, n_full, _ = _block_tables(qp, kp, Sq, Sk, bm, bn)
    _fwd_kernel[(B * H, row_blocks(Sq, bm, "Sq"))](
        q,
        k,
        v,
        out,
        lse,
        out if qp is None else qp,
        out if kp is None else kp,
        out if valid is None else valid,
        n_end,
        n_full,
        scale * LOG2E,
        Sq,
        Sk,
        H,
        H // k.shape[1],
        D,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *(valid.stride() if valid is not None else (0, 0)),
        **flags,
        BLOCK_D=block_d,
        **cfg,
    )
    return out, lse


def attention_bwd(
    q,
    k,
    v,
    out,
    lse,
    dout,
    *,
    scale: float,
    causal: bool = True,
    q_pos=None,
    k_pos=None,
    k_valid=None,
    allow_tf32: bool = False,
):
    """(dq, dk, dv) of this key block given the final out / lse (fp32 [B, Hq, Sq], -inf for empty rows) over all key
    blocks; in q's / k's / v's dtype. Same conditions as :func:`attention_fwd`; dout shaped like q (any strides)."""
    B, H, Sq, Sk, D, block_d, qp, kp, valid, flags = _common(q, k, v, causal, q_pos, k_pos, k_valid, allow_tf32)
    G = H // k.shape[1]
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0:
        return dq, dk, dv
    q, k, v = (t if t.stride() == d.stride() else t.contiguous() for t, d in ((q, dq), (k, dk), (v, dv)))
    lse = lse.to(torch.float32).contiguous()
    arch = _arch(q.device)
    cfg, cfg_kv = config("dq", q.element_size(), block_d, arch), config("dkdv", q.element_size(), block_d, arch)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid, grid_kv = (B * H, row_blocks(Sq, bm, "Sq")), (B * k.shape[1], row_blocks(Sk, cfg_kv["BLOCK_N"], "Sk"))
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    _delta_kernel[grid](out, dout, delta, Sq, H, D, *out.stride(), *dout.stride(), BLOCK_M=bm, BLOCK_D=block_d)
    pos = (dq if qp is None else qp, dq if kp is None else kp, dq if valid is None else valid)
    sizes = (
        scale * LOG2E,
        float(scale),
        Sq,
        Sk,
        H,
        G,
        D,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *(valid.stride() if valid is not None else (0, 0)),
    )
    n_end = n_full = m_start = dq
    if causal:
        n_end, n_full, _ = _block_tables(qp, kp, Sq, Sk, bm, bn)
        m_start = _block_tables(qp, kp, Sq, Sk, cfg_kv["BLOCK_M"], cfg_kv["BLOCK_N"])[2]
    _dq_kernel[grid](q, k, v, dout, dq, lse, delta, *pos, n_end, n_full, *sizes, **flags, BLOCK_D=block_d, **cfg)
    _dkdv_kernel[grid_kv](q, k, v, dout, dk, dv, lse, delta, *pos, m_start, *sizes, **flags, BLOCK_D=block_d, **cfg_kv)
    return dq, dk, dv
