"""The device code of the Triton GEMM (kernels/gemm.py, whose docstring states the three roles and the epilogue):
``_gemm_kernel`` (C = A @ B over arbitrary strides, fp32 accumulate, grouped program order) with its K-loop step
``_k_step`` (the GATE_ACT prologue A <- A * act'(Z) and the ROWSUM row sums on each A tile) and the activations
``_act_fwd`` / ``_act_grad`` in fp32 (codes: kernels/gemm.py's ACTS). Tile offsets are formed in int64."""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _act_fwd(z, ACT: tl.constexpr):
        """act(z) in fp32."""
        out = z
        if ACT == 1:  # gelu, tanh approximation; tanh(u) = 2 sigmoid(2u) - 1 (exp overflow gives -1 exactly)
            u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
            out = 0.5 * z * (1.0 + t)
        elif ACT == 2:  # gelu, erf
            out = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
        elif ACT == 3:  # silu
            out = z / (1.0 + tl.exp(-z))
        elif ACT == 4:  # relu
            out = tl.where(z > 0.0, z, 0.0)
        return out

    @triton.jit
    def _act_grad(z, ACT: tl.constexpr):
        """act'(z) in fp32."""
        d = tl.full(z.shape, 1.0, tl.float32)
        if ACT == 1:
            u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
            d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
        elif ACT == 2:
            d = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
        elif ACT == 3:
            s = 1.0 / (1.0 + tl.exp(-z))
            d = s * (1.0 + z * (1.0 - s))
        elif ACT == 4:
            d = tl.where(z > 0.0, 1.0, 0.0)
        return d

    @triton.jit
    def _k_step(
        acc,
        rsum,
        a_ptrs,
        b_ptrs,
        z_ptrs,
        k0,
        K,
        mask_m,
        mask_n,
        offs_k,
        stride_ak,
        stride_bk,
        stride_zk,
        GATE_ACT: tl.constexpr,
        ROWSUM: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
    ):
        """One BLOCK_K step of the main loop: acc += gate(A tile) @ B tile; rsum += row sums of the gated A tile.

        k0 * stride is formed in int64: it passes 2**31 once K * stride does (dW = dY^T X over 64k tokens: stride
        of dY^T along k = 32k features)."""
        k_left = K - k0
        k64 = tl.cast(k0, tl.int64)
        a_mask = mask_m[:, None] & (offs_k[None, :] < k_left)
        a = tl.load(a_ptrs + k64 * stride_ak, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs + k64 * stride_bk, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if GATE_ACT != 0:
            z = tl.load(z_ptrs + k64 * stride_zk, mask=a_mask, other=0.0).to(tl.float32)
            a32 = a.to(tl.float32) * _act_grad(z, GATE_ACT)
        else:
            a32 = a.to(tl.float32)
        if ROWSUM:
            rsum += tl.sum(a32, axis=1)
        a = a32.to(b.dtype)
        if INTERPRETER:  # the interpreter's dot mishandles bf16; fp32 products of 16-bit values are exact
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc, rsum

    @triton.jit
    def _gemm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        z_ptr,  # pre-activation gating A (GATE_ACT != 0), strided like A
        bias_ptr,  # [N] (HAS_BIAS)
        r_ptr,  # residual [M, N] (HAS_RES)
        pre_ptr,  # pre-activation out [M, N] (SAVE_PRE)
        rowsum_ptr,  # fp32 [M] (ROWSUM)
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_cm,
        stride_cn,
        stride_zm,
        stride_zk,
        stride_rm,
        stride_rn,
        stride_pm,
        stride_pn,
        ACT: tl.constexpr,
        GATE_ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        SAVE_PRE: tl.constexpr,
        ROWSUM: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # every tile offset (row * stride, k * stride) in int64: products of two dimensions pass 2**31 in LLM shapes
        rm = offs_m.to(tl.int64)
        rn = offs_n.to(tl.int64)
        rk = offs_k.to(tl.int64)
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        z_ptrs = z_ptr + rm[:, None] * stride_zm + rk[None, :] * stride_zk

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if INTERPRETER:  # the interpreter (numpy >= 2.4) cannot run `for` over a runtime bound; GPUs pipeline `for`
            k0 = 0
            while k0 < K:
                acc, rsum = _k_step(
                    acc,
                    rsum,
                    a_ptrs,
                    b_ptrs,
                    z_ptrs,
                    k0,
                    K,
                    mask_m,
                    mask_n,
                    offs_k,
                    stride_ak,
                    stride_bk,
                    stride_zk,
                    GATE_ACT,
                    ROWSUM,
                    IEEE,
                    INTERPRETER,
                )
                k0 += BLOCK_K
        else:
            for k0 in range(0, K, BLOCK_K):
                acc, rsum = _k_step(
                    acc,
                    rsum,
                    a_ptrs,
                    b_ptrs,
                    z_ptrs,
                    k0,
                    K,
                    mask_m,
                    mask_n,
                    offs_k,
                    stride_ak,
                    stride_bk,
                    stride_zk,
                    GATE_ACT,
                    ROWSUM,
                    IEEE,
                    INTERPRETER,
                )

        if ROWSUM:
            if pid_n == 0:  # one column of programs writes db (a scalar branch: newer interpreters reject int masks)
                tl.store(rowsum_ptr + offs_m, rsum, mask=mask_m)
        c_mask = mask_m[:, None] & mask_n[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if SAVE_PRE:
            pre_ptrs = pre_ptr + rm[:, None] * stride_pm + rn[None, :] * stride_pn
            tl.store(pre_ptrs, acc.to(pre_ptr.dtype.element_ty), mask=c_mask)
        acc = _act_fwd(acc, ACT)
        if HAS_RES:
            acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=c_mask, other=0.0).to(
                tl.float32
            )
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
