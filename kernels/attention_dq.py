"""The backward's preprocess and query-side kernel of the Triton flash attention (launched by kernels/attention.py,
whose docstring states the math): ``_delta_kernel`` (delta = rowsum(dout * out) in fp32) and ``_dq_kernel`` (per
query block, p recomputed over the key blocks: dq = scale * sum_j ds k), FlashAttention-2's split."""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .attention_parts import _POS_MIN, _dot, _visible

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
