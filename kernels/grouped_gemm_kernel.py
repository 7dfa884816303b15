"""The device code of the Triton grouped GEMM (kernels/grouped_gemm.py states the math and the launches).

``_grouped_mm_kernel``: one launch over every group of rows. Program (pid_m, pid_n) takes row tile pid_m of the
schedule "group 0's tiles, then group 1's, ..." (``_locate`` finds its group and rows from the offsets: every program
reads the E offsets as one vector, so no table is built before the launch) and column tile pid_n. Programs past the
last tile (the grid is sized ``cdiv(M, BLOCK_M) + E``, a bound of the tile count that needs no host copy of the
offsets) find no rows and skip the K loop. ``_grouped_wgrad_kernel``: program (pid, e) computes tile pid of
``A[rows_e]^T @ B[rows_e]``, its K loop running over group e's rows (none: it stores zeros).
fp32 accumulate; every tile offset in int64."""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _locate(offs_ptr, pid_m, E, BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr):
        """(group, first row of row tile ``pid_m``, end row of its group) of the schedule. Past the last tile: group
        E - 1, first row >= M = end row (no rows)."""
        ge = tl.arange(0, E_BLOCK)
        ends = tl.load(offs_ptr + ge, mask=ge < E, other=0).to(tl.int32)
        prev = tl.load(offs_ptr + ge - 1, mask=(ge > 0) & (ge < E), other=0).to(tl.int32)
        counts = ends - prev
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_ends = tl.cumsum(tiles, 0)
        before = tile_ends <= pid_m  # groups whose tiles all come before pid_m (empty groups included)
        g = tl.sum(before.to(tl.int32))
        first_tile = tl.max(tl.where(before, tile_ends, 0))
        row0 = tl.sum(tl.where(ge < g, counts, 0))
        row_end = row0 + tl.sum(tl.where(ge == g, counts, 0))
        return tl.minimum(g, E - 1), row0 + (pid_m - first_tile) * BLOCK_M, row_end

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr, INTERPRETER: tl.constexpr):
        if INTERPRETER:  # the interpreter's dot mishandles bf16; fp32 products of 16-bit values are exact
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _mm_step(
        acc,
        acc_u,
        a_ptrs,
        b_ptrs,
        k0,
        K,
        up,
        mask_m,
        mask_n,
        offs_k,
        stride_ak,
        stride_bk,
        EPI: tl.constexpr,
        IEEE: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        """One BLOCK_K step: acc += A tile @ B tile (and acc_u += A tile @ B's up-half tile when EPI != 0)."""
        k_left = K - k0
        k64 = tl.cast(k0, tl.int64)
        a = tl.load(a_ptrs + k64 * stride_ak, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b_mask = (offs_k[:, None] < k_left) & mask_n[None, :]
        b = tl.load(b_ptrs + k64 * stride_bk, mask=b_mask, other=0.0)
        acc = _dot(a, b, acc, IEEE, INTERP)
        if EPI != 0:
            bu = tl.load(b_ptrs + up + k64 * stride_bk, mask=b_mask, other=0.0)
            acc_u = _dot(a, bu, acc_u, IEEE, INTERP)
        return acc, acc_u

    @triton.jit
    def _grouped_mm_kernel(
        a_ptr,  # [M, K]
        b_ptr,  # [E, K, N] (EPI 0) or [E, K, 2N] (EPI 1, 2: gate columns [0, N), up columns [N, 2N))
        c_ptr,  # [M, N] (EPI 0, 1) or [M, 2N] (EPI 2)
        d_ptr,  # dH [M, N] (EPI 2), or the product [g, u]: [M, 2N] written (EPI 1 with SAVE_PRE)
        offs_ptr,  # [E] cumulative row ends, int32 / int64
        M,
        N,
        K,
        E,
        stride_am,
        stride_ak,
        stride_be,
        stride_bk,
        stride_bn,
        stride_cm,
        stride_cn,
        stride_dm,
        stride_dn,
        EPI: tl.constexpr,  # 0 plain, 1 swiglu, 2 swiglu backward
        SAVE_PRE: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        E_BLOCK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        g, m0, m_end = _locate(offs_ptr, pid_m, E, BLOCK_M, E_BLOCK)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < m_end
        mask_n = offs_n < N
        rm = offs_m.to(tl.int64)
        rn = offs_n.to(tl.int64)
        rk = offs_k.to(tl.int64)
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + g.to(tl.int64) * stride_be + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        up = tl.cast(N, tl.int64) * stride_bn  # the up half's column offset (EPI 1, 2)
        k_stop = tl.where(m0 < m_end, K, 0)  # a tile with no rows skips the loop
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INTERPRETER:  # the interpreter (numpy >= 2.4) cannot run `for` over a runtime bound; GPUs pipeline `for`
            k0 = 0
            while k0 < k_stop:
                acc, acc_u = _mm_step(
                    acc,
                    acc_u,
                    a_ptrs,
                    b_ptrs,
                    k0,
                    K,
                    up,
                    mask_m,
                    mask_n,
                    offs_k,
                    stride_ak,
                    stride_bk,
                    EPI,
                    IEEE,
                    INTERPRETER,
                )
                k0 += BLOCK_K
        else:
            for k0 in range(0, k_stop, BLOCK_K):
                acc, acc_u = _mm_step(
                    acc,
                    acc_u,
                    a_ptrs,
                    b_ptrs,
                    k0,
                    K,
                    up,
                    mask_m,
                    mask_n,
                    offs_k,
                    stride_ak,
                    stride_bk,
                    EPI,
                    IEEE,
                    INTERPRETER,
                )
        c_mask = mask_m[:, None] & mask_n[None, :]
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        if EPI == 0:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
        else:
            sig = 1.0 / (1.0 + tl.exp(-acc))  # acc: the gate g, acc_u: the up projection u
            if EPI == 1:  # h = silu(g) * u
                tl.store(c_ptrs, (acc * sig * acc_u).to(c_ptr.dtype.element_ty), mask=c_mask)
                if SAVE_PRE:  # [g, u] kept for a backward that does not recompute them
                    p_ptrs = d_ptr + rm[:, None] * stride_dm + rn[None, :] * stride_dn
                    tl.store(p_ptrs, acc.to(d_ptr.dtype.element_ty), mask=c_mask)
                    up_d = tl.cast(N, tl.int64) * stride_dn
                    tl.store(p_ptrs + up_d, acc_u.to(d_ptr.dtype.element_ty), mask=c_mask)
            else:  # dg = dh * u * silu'(g), du = dh * silu(g)
                dh = tl.load(d_ptr + rm[:, None] * stride_dm + rn[None, :] * stride_dn, mask=c_mask, other=0.0)
                dh = dh.to(tl.float32)
                dg = dh * acc_u * (sig * (1.0 + acc * (1.0 - sig)))
                tl.store(c_ptrs, dg.to(c_ptr.dtype.element_ty), mask=c_mask)
                du = dh * (acc * sig)
                tl.store(c_ptrs + tl.cast(N, tl.int64) * stride_cn, du.to(c_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def _wgrad_step(
        acc,
        a_ptr,
        b_ptr,
        k0,
        end,
        rp,
        rq,
        mask_p,
        mask_q,
        offs_k,
        sam,
        sap,
        sbm,
        sbq,
        IEEE: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        """One BLOCK_K step over rows [k0, k0 + BLOCK_K) of the group: acc += A rows^T @ B rows."""
        rows = k0 + offs_k
        mask_k = rows < end
        r64 = rows.to(tl.int64)
        a = tl.load(a_ptr + r64[None, :] * sam + rp[:, None] * sap, mask=mask_p[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + r64[:, None] * sbm + rq[None, :] * sbq, mask=mask_k[:, None] & mask_q[None, :], other=0.0)
        return _dot(a, b, acc, IEEE, INTERP)

    @triton.jit
    def _grouped_wgrad_kernel(
        a_ptr,  # [M, P]
        b_ptr,  # [M, Q]
        c_ptr,  # [E, P, Q]
        offs_ptr,  # [E] cumulative row ends
        P,
        Q,
        stride_am,
        stride_ap,
        stride_bm,
        stride_bq,
        stride_ce,
        stride_cp,
        stride_cq,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_M: tl.constexpr,  # tile of P
        BLOCK_N: tl.constexpr,  # tile of Q
        BLOCK_K: tl.constexpr,  # rows per step
    ):
        pid = tl.program_id(0)
        e = tl.program_id(1)
        num_q = tl.cdiv(Q, BLOCK_N)
        pid_p = pid // num_q
        pid_q = pid % num_q
        end = tl.load(offs_ptr + e).to(tl.int32)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)).to(tl.int32), 0)
        offs_p = pid_p * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_q = pid_q * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_p = offs_p < P
        mask_q = offs_q < Q
        rp = offs_p.to(tl.int64)
        rq = offs_q.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INTERPRETER:
            k0 = start
            while k0 < end:
                acc = _wgrad_step(
                    acc,
                    a_ptr,
                    b_ptr,
                    k0,
                    end,
                    rp,
                    rq,
                    mask_p,
                    mask_q,
                    offs_k,
                    stride_am,
                    stride_ap,
                    stride_bm,
                    stride_bq,
                    IEEE,
                    INTERPRETER,
                )
                k0 += BLOCK_K
        else:
            for k0 in range(start, end, BLOCK_K):
                acc = _wgrad_step(
                    acc,
                    a_ptr,
                    b_ptr,
                    k0,
                    end,
                    rp,
                    rq,
                    mask_p,
                    mask_q,
                    offs_k,
                    stride_am,
                    stride_ap,
                    stride_bm,
                    stride_bq,
                    IEEE,
                    INTERPRETER,
                )
        c_ptrs = c_ptr + tl.cast(e, tl.int64) * stride_ce + rp[:, None] * stride_cp + rq[None, :] * stride_cq
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_q[None, :])
