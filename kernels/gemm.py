"""Triton GEMM with a fused epilogue, and the backward pair with the activation's derivative fused into the loads.

One kernel, ``_gemm_kernel`` (its device code: gemm_kernel.py; the launches: here), computes C[M, N] = A[M, K] @
B[K, N] over arbitrary strides (fp32 accumulate), with:
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
    from .gemm_kernel import _gemm_kernel


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
