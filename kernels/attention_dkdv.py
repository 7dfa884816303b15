"""The backward's key-side kernel of the Triton flash attention (launched by kernels/attention.py, whose docstring
states the math): ``_dkdv_kernel``, per key block of one key/value head, p recomputed over the query heads of its
group and the query blocks from m_start: dv = sum p^T dout, dk = scale * sum ds^T q (GQA's sums in one program)."""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .attention_parts import _POS_MAX, _POS_MIN, _dot

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
