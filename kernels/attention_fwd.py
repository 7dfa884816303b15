"""The forward kernel of the Triton flash attention (launched by kernels/attention.py, whose docstring states the math):
per (batch x head, query block), an online softmax over the key blocks (m, l, acc), the unmasked whole blocks of a
causal row first, then the diagonal with the position compare; writes out and the row log-sum-exp."""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .attention_parts import _POS_MIN, _dot, _visible

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
