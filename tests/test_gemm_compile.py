"""The fused GEMM kernel (llmpar.kernels.gemm) compiles to sm_80 and sm_90 machine code, on a machine without a GPU.

Same approach as test_triton_compile.py: the interpreter checks numerics but accepts code the real compiler rejects.
Each role (forward with epilogue, input grad, weight grad) is compiled with the first (largest-tile) config of the
architecture's autotune list, for every activation in bf16 and a few dtype/flag variants.
"""
import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from llmpar.kernels import gemm  # noqa: E402

if gemm.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: kernels are interpreted in this process", allow_module_level=True)

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as err:  # pragma: no cover - depends on the triton version
    pytest.skip(f"this triton has no ahead-of-time compile API: {err}", allow_module_level=True)

_SMEM = {80: 166912, 90: 232448}  # max dynamic shared memory per block: A100, H100
_PTR = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
_STRIDES = ("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn",
            "stride_zm", "stride_zk", "stride_rm", "stride_rn", "stride_pm", "stride_pn")


def _compile(arch: int, ptrs: dict, flags: dict, cfg: tuple):
    fn = gemm._gemm_kernel
    bm, bn, bk, g, stages, warps = cfg
    consts = {**flags, "INTERPRETER": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}
    sig = {name: _PTR[dt] for name, dt in ptrs.items()}
    sig.update({name: "i32" for name in ("M", "N", "K", *_STRIDES)})
    signature = {name: ("constexpr" if name in consts else sig[name]) for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                              "num_stages": stages})
    except RuntimeError as err:
        if "ptxas" in str(err) and ("not found" in str(err) or "No such file" in str(err)):
            pytest.skip(f"triton's ptxas is unavailable here: {err}")
        raise
    assert kernel.asm["cubin"], "no machine code produced"
    assert f".target sm_{arch}" in kernel.asm["ptx"]
    assert kernel.metadata.shared <= _SMEM[arch], f"{kernel.metadata.shared} B of shared memory > sm_{arch}'s"


def _cfg(arch: int, dtype: str):
    table = gemm.HOPPER_CONFIGS if arch >= 90 else gemm.AMPERE_CONFIGS
    if dtype == "fp32":  # fp32 tiles of the largest configs overflow shared memory (the autotuner skips those)
        return table[-1] if arch >= 90 else table[3]
    return table[0]


def _flags(**kw):
    base = dict(ACT=0, GATE_ACT=0, HAS_BIAS=False, HAS_RES=False, SAVE_PRE=False, ROWSUM=False, ACCUMULATE=False,
                IEEE=False)
    base.update(kw)
    return base


# (role, activation code, input dtype, output/main-grad dtype, extra flag)
_CASES = ([("fwd", a, "bf16", "bf16", None) for a in range(5)]
          + [("dgrad", a, "bf16", "bf16", None) for a in (2, 4)]
          + [("fwd", 1, "fp16", "fp32", "res"), ("fwd", 2, "fp32", "fp32", None), ("dgrad", 0, "fp32", "fp32", None),
             ("wgrad", 1, "bf16", "fp32", "accumulate"), ("wgrad", 0, "bf16", "bf16", None),
             ("wgrad", 3, "fp32", "fp32", None)])


@pytest.mark.parametrize("arch", (80, 90))
@pytest.mark.parametrize("role, act, dt, out, extra", _CASES)
def test_gemm_kernel_compiles(arch, role, act, dt, out, extra):
    ieee = dt == "fp32"
    if role == "fwd":  # A = x, B = W^T, C = y, pre in x's dtype
        ptrs = dict(a_ptr=dt, b_ptr=dt, c_ptr=out, z_ptr=out, bias_ptr=dt, r_ptr=out if extra == "res" else dt,
                    pre_ptr=dt, rowsum_ptr=out)
        flags = _flags(ACT=act, HAS_BIAS=True, HAS_RES=extra == "res", SAVE_PRE=act != 0, IEEE=ieee)
    elif role == "dgrad":  # A = dY, B = W, C = dX, Z = pre
        ptrs = dict(a_ptr=out, b_ptr=dt, c_ptr=dt, z_ptr=dt, bias_ptr=dt, r_ptr=dt, pre_ptr=dt, rowsum_ptr=dt)
        flags = _flags(GATE_ACT=act, IEEE=ieee)
    else:  # A = dY^T, B = x, C = dW (fp32 main grad when accumulating), Z = pre^T, rowsum = db (fp32)
        ptrs = dict(a_ptr=dt, b_ptr=dt, c_ptr=out, z_ptr=dt, bias_ptr=out, r_ptr=out, pre_ptr=out,
                    rowsum_ptr="fp32")
        flags = _flags(GATE_ACT=act, ROWSUM=True, ACCUMULATE=extra == "accumulate", IEEE=ieee)
    _compile(arch, ptrs, flags, _cfg(arch, dt))
