"""The Triton kernels compile to sm_80 and sm_90 machine code, on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) checks the kernels' numerics on CPU but accepts code that the real compiler
rejects; compiling every specialisation the launchers use, down to a cubin through Triton's own ptxas, catches that
here instead of on the first GPU machine.
"""
import itertools

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from llmpar.kernels import adamw as adamw_kernels  # noqa: E402
from llmpar.kernels import bucket as bucket_kernels  # noqa: E402
from llmpar.ops.adamw import mode_code  # noqa: E402

if bucket_kernels.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: kernels are interpreted in this process", allow_module_level=True)

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as err:  # pragma: no cover - depends on the triton version
    pytest.skip(f"this triton has no ahead-of-time compile API: {err}", allow_module_level=True)

ARCHS = (80, 90)
_PTR = {tl.float32: "*fp32", tl.bfloat16: "*bf16", tl.float16: "*fp16"}


def _compile(fn, sig: dict, consts: dict, arch: int):
    signature = {name: ("constexpr" if name in consts else sig[name]) for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", arch, 32))
    except RuntimeError as err:
        if "ptxas" in str(err) and ("not found" in str(err) or "No such file" in str(err)):
            pytest.skip(f"triton's ptxas is unavailable here: {err}")
        raise
    assert kernel.asm["cubin"], "no machine code produced"
    assert f".target sm_{arch}" in kernel.asm["ptx"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("unpack, list_dtype, flat_dtype", [
    (u, ld, fd) for u, ld, fd in itertools.product((False, True), (tl.float32, tl.bfloat16, tl.float16),
                                                     (tl.float32, tl.bfloat16))])
def test_bucket_kernel_compiles(arch, unpack, list_dtype, flat_dtype):
    sig = {"flat_ptr": _PTR[flat_dtype], "table_ptr": "*i64", "n": "i64", "num_programs": "i64", "scale": "fp32"}
    consts = {"UNPACK": unpack, "LIST_DTYPE": list_dtype, "UNIT_SCALE": False, "BLOCK": bucket_kernels.BLOCK}
    _compile(bucket_kernels._bucket_kernel, sig, consts, arch)


# (mode, param, grad, state, extra) dtypes as the launcher passes them for each precision mode
_ADAMW_CASES = [
    ("fp32", tl.float32, tl.float32, tl.float32, tl.float32),
    ("fp32_master", tl.bfloat16, tl.bfloat16, tl.float32, tl.float32),
    ("fp32_master", tl.float16, tl.float16, tl.float32, tl.float32),
    ("bf16_sr", tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
    ("bf16_kahan", tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode, p, g, s, x", _ADAMW_CASES)
@pytest.mark.parametrize("on_device", [False, True])
def test_adamw_kernel_compiles(arch, mode, p, g, s, x, on_device):
    scalar_ptr = "*fp32" if on_device else "*i64"  # the launcher passes the table when a scalar is not on device
    sig = {"table_ptr": "*i64", "n": "i32", "lr_ptr": scalar_ptr, "lr_value": "fp32", "gscale_ptr": scalar_ptr,
           "found_inf_ptr": scalar_ptr, "beta1": "fp32", "one_minus_beta1": "fp32", "beta2": "fp32",
           "one_minus_beta2": "fp32", "ln_beta1": "fp32", "ln_beta2": "fp32", "eps": "fp32", "weight_decay": "fp32",
           "seed": "i32"}
    consts = {"MODE": mode_code(mode), "P_DTYPE": p, "G_DTYPE": g, "S_DTYPE": s, "X_DTYPE": x,
              "LR_ON_DEVICE": on_device, "HAS_GSCALE": on_device, "HAS_FOUND_INF": on_device,
              "BLOCK": adamw_kernels.BLOCK}
    _compile(adamw_kernels._adamw_kernel, sig, consts, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("g", [tl.float32, tl.bfloat16, tl.float16])
def test_sum_squares_kernel_compiles(arch, g):
    sig = {"table_ptr": "*i64", "n": "i32", "out_ptr": "*fp32"}
    _compile(adamw_kernels._sum_squares_kernel, sig, {"G_DTYPE": g, "BLOCK": adamw_kernels.BLOCK}, arch)
