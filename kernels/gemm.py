"""Triton GEMM with a fused epilogue, and the backward pair with the activation's derivative fused into the loads.

One kernel, ``_gemm_kernel``, computes C[M, N] = A[M, K] @ B[K, N] over arbitrary strides (fp32 accumulate), with:
    prologue (GATE_ACT):  A <- A * act'(Z)  elementwise on each A tile (Z strided like A), rounded to B's dtype
    row sums (ROWSUM):    rowsum[m] = sum_k A[m, k]  (fp32; written by the programs of the first column block)
    epilogue:             acc (+ bias[n]) -> store pre (SAVE_PRE) -> act(acc) (+ residual) (+ C when ACCUMULATE)
                          -> cast to C's dtype
It serves three roles (x: [M, K], W: [N, K], y/dY/pre: [M, N]):
    forward:      y  = act(x @ W^T + b) (+ r)       A = x,       B = W^T,  C = y,  pre = x @ W^T + b
    input grad:   dX = dY' @ W                      A = dY,      B = W,    C = dX, Z = pre
    weight grad:  dW = dY'^T @ X (+= main_grad)     A = dY^T,    B = x,    C = dW, Z = pre^T, rowsum = db
where dY' = dY * act'(pre). dY' is never written to memory: both backward GEMMs recompute it from dY and the saved
pre-activation (an elementwise product, cheap next to the GEMM; saving pre costs M*N elements, the same as what
torch autograd keeps for the unfused composition, and avoids re-running the forward GEMM: 4 GEMMs -> 3).

Program order is grouped (GROUP_M row blocks share a column sweep) for L2 reuse. On CUDA the launch is autotuned
from a per-architecture config list (Hopper: sm_90+, Ampere: sm_80/86/89); under TRITON_INTERPRET=1 one small fixed
config runs; configs, their shared-memory bound and the autotune key: kernels/gemm_configs.py. fp32 inputs use IEEE
fp32 products (no tensor cores) unless ``allow_tf32`` is passed (TF32 tensor cores; llmpar/ops/gemm.py passes torch's
TF32 setting and sends fp32 calls that may not use TF32 to cuBLAS). Every tile offset is formed in int64.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton  # noqa: F401
from .gemm_configs import (  # noqa: F401
    AMPERE_CONFIGS,
    HOPPER_CONFIGS,
    INTERPRET_CONFIG,
    SMEM_LIMIT,
    TUNE_KEY,
    autotune_limit,
    fitting,
)

# activation codes shared with llmpar/ops/gemm.py
ACTS = {"none": 0, "gelu_tanh": 1, "gelu_erf": 2, "silu": 3, "relu": 4}

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


_TUNED: dict = {}
_SMEM: dict = {}


def _arch_family(device) -> str:
    import torch

    major, _ = torch.cuda.get_device_capability(device)
    return "hopper" if major >= 9 else "ampere"


def smem_limit(device) -> int:
    """Max dynamic shared memory per block of ``device`` (bytes): torch's device properties, else Triton's driver,
    else the family's value (SMEM_LIMIT)."""
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMEM:
        value = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
        if not value:
            try:
                value = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
            except Exception:  # noqa: BLE001 - any driver trouble: the table
                value = SMEM_LIMIT[_arch_family(device)]
        _SMEM[index] = int(value)
    return _SMEM[index]


def _fitting_rows(table, a, b, z, c, flags):
    """The rows of ``table`` whose shared memory fits this call's device, dtypes and flags (kernels/gemm_configs.py),
    cut to LLMPAR_AUTOTUNE_CONFIGS."""
    return fitting(
        table,
        smem_limit(c.device),
        a.element_size(),
        b.element_size(),
        z.element_size(),
        gate=flags.get("GATE_ACT", 0) != 0,
        rowsum=bool(flags.get("ROWSUM", False)),
    )


def _prune(table):
    """early_config_prune for Triton's autotuner: ``_fitting_rows`` of ``table`` as the autotuner's configs."""

    def prune(configs, named_args, **kwargs):
        rows = _fitting_rows(
            table, named_args["a_ptr"], named_args["b_ptr"], named_args["z_ptr"], named_args["c_ptr"], kwargs
        )
        by_row = {
            (
                cf.kwargs["BLOCK_M"],
                cf.kwargs["BLOCK_N"],
                cf.kwargs["BLOCK_K"],
                cf.kwargs["GROUP_M"],
                cf.num_stages,
                cf.num_warps,
            ): cf
            for cf in configs
        }
        return [by_row[r] for r in rows]

    return prune


def _tuned_kernel(family: str, role: str):
    """An autotuner over ``_gemm_kernel`` per (architecture family, role): layouts differ per role. Keyed on the
    sizes and every flag (a config tuned for one variant never serves another), configs pruned to what fits."""
    key = (family, role)
    if key not in _TUNED:
        table = HOPPER_CONFIGS if family == "hopper" else AMPERE_CONFIGS
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}, num_stages=s, num_warps=w)
            for bm, bn, bk, g, s, w in table
        ]
        # the weight-grad role may accumulate into C: restore it between benchmark runs
        restore = ["c_ptr"] if role == "wgrad" else None
        _TUNED[key] = triton.autotune(
            configs=configs,
            key=list(TUNE_KEY),
            restore_value=restore,
            prune_configs_by={"early_config_prune": _prune(table)},
        )(_gemm_kernel)
    return _TUNED[key]


def _launch(
    role,
    a,
    b,
    c,
    M,
    N,
    K,
    a_strides,
    b_strides,
    c_strides,
    *,
    z=None,
    z_strides=(0, 0),
    bias=None,
    res=None,
    res_strides=(0, 0),
    pre=None,
    pre_strides=(0, 0),
    rowsum=None,
    act=0,
    gate_act=0,
    accumulate=False,
    allow_tf32=False,
):
    if M == 0 or N == 0:
        return
    dummy = c
    flags = dict(
        ACT=act,
        GATE_ACT=gate_act,
        HAS_BIAS=bias is not None,
        HAS_RES=res is not None,
        SAVE_PRE=pre is not None,
        ROWSUM=rowsum is not None,
        ACCUMULATE=accumulate,
        IEEE=(b.dtype.itemsize == 4 and not allow_tf32),
        INTERPRETER=INTERPRETED,
    )
    args = (
        a,
        b,
        c,
        dummy if z is None else z,
        dummy if bias is None else bias,
        dummy if res is None else res,
        dummy if pre is None else pre,
        dummy if rowsum is None else rowsum,
        M,
        N,
        K,
        *a_strides,
        *b_strides,
        *c_strides,
        *z_strides,
        *res_strides,
        *pre_strides,
    )

    if INTERPRETED or c.device.type != "cuda":
        cfg = INTERPRET_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _gemm_kernel[grid](*args, **flags, **cfg)
        return
    _launch_compiled(role, args, flags, M, N)


def _launch_compiled(role, args, flags, M, N):
    """Launch on a GPU: through the autotuner, or, with LLMPAR_AUTOTUNE_CONFIGS=1, straight with the first fitting
    config (Triton's autotuner counts its configs before pruning them: with several in the table it benchmarks even
    the one config left, ~0.1-0.3 s per new shape and flag set in a check run; triton 3.6 does)."""
    a, b, c, z = args[0], args[1], args[2], args[3]
    family = _arch_family(c.device)
    if autotune_limit() == 1:
        bm, bn, bk, group, stages, warps = _fitting_rows(
            HOPPER_CONFIGS if family == "hopper" else AMPERE_CONFIGS, a, b, z, c, flags
        )[0]
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _gemm_kernel[grid](
            *args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_stages=stages, num_warps=warps
        )
        return
    kernel = _tuned_kernel(family, role)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    kernel[grid](*args, **flags)


def linear_fwd(x, w, bias, residual, out, pre, act: int, *, allow_tf32: bool = False) -> None:
    """out = act(x @ w^T + bias) (+ residual); pre = x @ w^T + bias when ``pre`` is given.

    x: [M, K], w: [N, K], bias: [N] or None, residual/out/pre: [M, N] (any strides; out/pre written in their dtype).
    A row range is a slice: pass x[a:b], out[a:b], residual[a:b], pre[a:b].
    """
    M, K = x.shape
    N = w.shape[0]
    _launch(
        "fwd",
        x,
        w,
        out,
        M,
        N,
        K,
        x.stride(),
        (w.stride(1), w.stride(0)),
        out.stride(),
        bias=bias,
        res=residual,
        res_strides=residual.stride() if residual is not None else (0, 0),
        pre=pre,
        pre_strides=pre.stride() if pre is not None else (0, 0),
        act=act,
        allow_tf32=allow_tf32,
    )


def linear_bwd_input(grad_out, w, pre, act: int, grad_x, *, allow_tf32: bool = False) -> None:
    """grad_x = (grad_out * act'(pre)) @ w.  grad_out/pre: [M, N], w: [N, K], grad_x: [M, K]."""
    M, N = grad_out.shape
    K = w.shape[1]
    gate = act if pre is not None else 0
    _launch(
        "dgrad",
        grad_out,
        w,
        grad_x,
        M,
        K,
        N,
        grad_out.stride(),
        w.stride(),
        grad_x.stride(),
        z=pre,
        z_strides=pre.stride() if pre is not None else (0, 0),
        gate_act=gate,
        allow_tf32=allow_tf32,
    )


def linear_bwd_weight(
    grad_out, x, pre, act: int, grad_w, grad_b=None, *, accumulate: bool = False, allow_tf32: bool = False
) -> None:
    """grad_w (+)= (grad_out * act'(pre))^T @ x; grad_b = column sums of grad_out * act'(pre) (fp32 [N]).

    grad_out/pre: [M, N], x: [M, K], grad_w: [N, K] (fp32 main-grad buffer when ``accumulate``).
    """
    M, N = grad_out.shape
    K = x.shape[1]
    gate = act if pre is not None else 0
    go_t = (grad_out.stride(1), grad_out.stride(0))
    pre_t = (pre.stride(1), pre.stride(0)) if pre is not None else (0, 0)
    if M == 0:  # no tokens: the product is zero
        if not accumulate:
            grad_w.zero_()
        if grad_b is not None:
            grad_b.zero_()
        return
    _launch(
        "wgrad",
        grad_out,
        x,
        grad_w,
        N,
        K,
        M,
        go_t,
        x.stride(),
        grad_w.stride(),
        z=pre,
        z_strides=pre_t,
        rowsum=grad_b,
        gate_act=gate,
        accumulate=accumulate,
        allow_tf32=allow_tf32,
    )
