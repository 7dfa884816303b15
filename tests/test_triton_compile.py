"""The Triton kernels compile to sm_80 and sm_90 machine code as their launchers specialise them, without a GPU.

The interpreter (TRITON_INTERPRET=1) checks the kernels' numerics on CPU but accepts code that the real compiler
rejects, and it applies none of the launch-time specialisations. Here each launcher (adamw.step, adamw.sum_squares,
bucket.pack/unpack) runs on CPU tensors with its kernel swapped for a recorder, and the recorded arguments are compiled
through Triton's own binder (tests/triton_aot.py): ints equal to 1 become constants unless the kernel opts out
(do_not_specialize), pointers and ints divisible by 16 get divisibility hints, exactly as on the GPU. So seed=1, one
tensor (n=1), one program and misaligned buffers are all compiled the way the first GPU would compile them.
"""

from __future__ import annotations

import pytest
import torch
from triton_aot import SMEM_LIMIT, Recorder, bind_like_launcher, compile_like_launcher, res_usage, specialised

from llmpar.kernels import adamw as adamw_kernels  # noqa: E402
from llmpar.kernels import bucket as bucket_kernels  # noqa: E402
from llmpar.ops.adamw import MODES, mode_code  # noqa: E402

if bucket_kernels.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: kernels are interpreted in this process", allow_module_level=True)

ARCHS = (80, 90)


def record(module, name: str, launch) -> list[tuple[tuple, dict]]:
    rec = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, name, rec)
        launch()
    return rec.calls


def _adamw_state(precision: str, sizes: list[int], *, misalign: int = 0):
    spec = MODES[precision]
    pd = spec.param_dtypes[0]
    md = spec.moment_dtype or pd

    def t(n, dt):
        return torch.randn(n + misalign).to(dt)[misalign:]

    p = [t(n, pd) for n in sizes]
    g = [t(n, pd) for n in sizes]
    m = [t(n, md) for n in sizes]
    v = [t(n, md).abs() for n in sizes]
    x = [t(n, spec.extra[1]) for n in sizes] if spec.extra else None
    s = [torch.tensor(3.0) for _ in sizes]
    return p, g, m, v, x, s


# (precision, tensor sizes, seed, scalars on device, misaligned): seed 1 and a single tensor are the values Triton
# would turn into constants; 16 tensors (n divisible by 16) the ones that get a divisibility hint
_ADAMW_CASES = [
    ("fp32", [5, 4097, 123], 0, False, False),
    ("fp32", [4096], 1, True, True),
    ("fp32_master", [5, 4097], 1, True, False),
    ("bf16_sr", [4097], 1, False, False),
    ("bf16_sr", [7] * 16, 1, True, True),
    ("bf16_sr", [5, 4097], 123456, True, False),
    ("bf16_kahan", [5, 4097], 1, True, False),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision, sizes, seed, on_device, misalign", _ADAMW_CASES)
def test_adamw_kernel_compiles_as_launched(arch, precision, sizes, seed, on_device, misalign):
    p, g, m, v, x, s = _adamw_state(precision, sizes, misalign=int(misalign))
    scalar = torch.tensor(0.5) if on_device else None
    lr = torch.tensor(1e-3) if on_device else 1e-3
    calls = record(
        adamw_kernels,
        "_adamw_kernel",
        lambda: adamw_kernels.step(
            p,
            g,
            m,
            v,
            x,
            s,
            list(range(len(sizes))),
            mode=mode_code(precision),
            lr=lr,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            gscale=scalar,
            found_inf=scalar,
            seed=seed,
        ),
    )
    ((args, kwargs),) = calls
    fn = adamw_kernels._adamw_kernel
    signature, constexprs, _, _ = bind_like_launcher(fn, args, kwargs, arch)
    consts = specialised(signature, constexprs, fn)
    assert "seed" not in consts and "n" not in consts, f"runtime values specialised into constants: {consts}"
    compile_like_launcher(fn, args, kwargs, arch=arch)


@pytest.mark.parametrize("beta1, beta2", [(0.0, 0.999), (0.9, 0.0)])
def test_adamw_launch_takes_zero_betas(beta1, beta2):
    p, g, m, v, x, s = _adamw_state("fp32", [5])
    ((args, kwargs),) = record(
        adamw_kernels,
        "_adamw_kernel",
        lambda: adamw_kernels.step(
            p, g, m, v, x, s, [0], mode=0, lr=1e-3, beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=0.0
        ),
    )
    named = dict(zip(adamw_kernels._adamw_kernel.arg_names, args))
    assert named["ln_beta1" if beta1 == 0 else "ln_beta2"] == float("-inf")
    compile_like_launcher(adamw_kernels._adamw_kernel, args, kwargs, arch=90)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "dtype, sizes", [(torch.float32, [5]), (torch.bfloat16, [5, 4097, 3]), (torch.float16, [16] * 16)]
)
def test_sum_squares_kernel_compiles_as_launched(arch, dtype, sizes):
    grads = [torch.randn(n).to(dtype) for n in sizes]
    ((args, kwargs),) = record(adamw_kernels, "_sum_squares_kernel", lambda: adamw_kernels.sum_squares(grads))
    signature, constexprs, _, _ = bind_like_launcher(adamw_kernels._sum_squares_kernel, args, kwargs, arch)
    assert "n" not in specialised(signature, constexprs, adamw_kernels._sum_squares_kernel)
    compile_like_launcher(adamw_kernels._sum_squares_kernel, args, kwargs, arch=arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("unpack", [False, True])
@pytest.mark.parametrize(
    "list_dtype, flat_dtype, sizes, offset, scale",
    [
        (torch.float32, torch.float32, [5], 0, 1.0),  # one tensor, one program: n = 1 constant
        (torch.bfloat16, torch.float32, [5, 4097, 123], 3, 0.125),  # flat is a misaligned slice
        (torch.float32, torch.bfloat16, [7] * 16, 0, 0.5),  # 16 tensors: divisibility hint on n
        (torch.float16, torch.float16, [2048, 1024], 8, 2.0),
    ],
)
def test_bucket_kernel_compiles_as_launched(arch, unpack, list_dtype, flat_dtype, sizes, offset, scale):
    tensors = [torch.randn(n).to(list_dtype) for n in sizes]
    flat = torch.empty(sum(sizes) + offset, dtype=flat_dtype)[offset:]
    launch = (
        (lambda: bucket_kernels.unpack(flat, tensors, scale))
        if unpack
        else (lambda: bucket_kernels.pack(tensors, flat, scale))
    )
    ((args, kwargs),) = record(bucket_kernels, "_bucket_kernel", launch)
    compile_like_launcher(bucket_kernels._bucket_kernel, args, kwargs, arch=arch)


# ------------------------------------------------------------------------------------------------ attention
from llmpar.kernels import attention as attention_kernels  # noqa: E402

_ATTN_KERNELS = ("_fwd_kernel", "_delta_kernel", "_dq_kernel", "_dkdv_kernel")


def attention_launches(
    arch: int, dtype: torch.dtype, d: int, *, causal: bool, padded: bool, grids: dict | None = None
) -> dict:
    """kernel name -> (args, kwargs) of the launches attention_fwd / attention_bwd make for sm_``arch`` (GQA 4:2,
    q / k / v as [B, S, H, D] views, odd sequence lengths); ``grids`` (a dict) receives each launch's grid."""
    q = torch.randn(2, 37, 4, d).to(dtype).transpose(1, 2)
    k, v = (torch.randn(2, 53, 2, d).to(dtype).transpose(1, 2) for _ in range(2))
    valid = torch.rand(2, 53) > 0.2 if padded else None
    kw = dict(scale=0.125, causal=causal, q_pos=torch.arange(16, 53) if causal else None, k_valid=valid)
    recs = {name: Recorder() for name in _ATTN_KERNELS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_kernels, "_arch", lambda device: arch)
        for name, rec in recs.items():
            mp.setattr(attention_kernels, name, rec)
        out, lse = attention_kernels.attention_fwd(q, k, v, **kw)
        lse.uniform_(1.0, 2.0)
        attention_kernels.attention_bwd(q, k, v, out, lse, torch.randn_like(q), **kw)
    if grids is not None:
        grids.update({name: rec.grids[0] for name, rec in recs.items()})
    return {name: rec.calls[0] for name, rec in recs.items()}


_COMPILED: dict[tuple, dict] = {}


def compiled_attention(arch: int, dtype: torch.dtype, d: int, causal: bool, padded: bool) -> dict:
    """kernel name -> the kernel compiled as attention_fwd / attention_bwd launch it (cached: the tests share them)."""
    key = (arch, dtype, d, causal, padded)
    if key not in _COMPILED:
        _COMPILED[key] = {
            name: compile_like_launcher(getattr(attention_kernels, name), args, kwargs, arch=arch)
            for name, (args, kwargs) in attention_launches(arch, dtype, d, causal=causal, padded=padded).items()
            if not (name == "_delta_kernel" and arch == 80)
        }  # no dot, no config beyond BLOCK_M: sm_90 only
    return _COMPILED[key]


@pytest.mark.parametrize(
    "arch, dtype, d, causal, padded",
    [
        (90, torch.bfloat16, 128, True, True),  # the training case: every flag, widest 16-bit tiles
        (90, torch.bfloat16, 64, False, False),
        (80, torch.bfloat16, 128, True, True),
        (90, torch.float32, 128, True, True),  # fp32 (IEEE, FMA units): the tiles that spilled 8 KB per thread
        (90, torch.float32, 64, True, False),
        (80, torch.float32, 128, True, False),
        (80, torch.float16, 24, False, True),  # head_dim padded to 32
    ],
)
def test_attention_kernels_compile_as_launched(arch, dtype, d, causal, padded):
    """Each attention kernel compiles for sm_80 / sm_90 with the launcher's specialisations and block config, within
    the architecture's shared memory, and spills nothing: no stack, no local memory (cuobjdump -res-usage)."""
    for name, kernel in compiled_attention(arch, dtype, d, causal, padded).items():
        assert kernel.metadata.shared <= SMEM_LIMIT[arch], (name, kernel.metadata.shared)
        use = res_usage(kernel)
        assert use["STACK"] == 0 and use["LOCAL"] == 0, f"{name} spills on sm_{arch} ({dtype}, d{d}): {use}"


def test_causal_attention_kernels_are_pipelined():
    """A causal kernel's key / query loop is software-pipelined like the non-causal one: num_stages buffers of K / V
    (Q / dout) in shared memory, not the single buffer a branch around the loads leaves (48 KB against 128 KB)."""
    causal, plain = (compiled_attention(90, torch.bfloat16, 128, c, True) for c in (True, False))
    for name in ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel"):
        assert causal[name].metadata.shared >= plain[name].metadata.shared, (
            name,
            causal[name].metadata.shared,
            plain[name].metadata.shared,
        )


def test_attention_grid_puts_batch_heads_on_axis_0():
    """batch x heads on grid axis 0 (2^31 - 1 programs), the row blocks on axis 1 (65535): 4096 sequences of 16 heads
    fit, and a sequence with more row blocks than axis 1 takes raises a ValueError naming it before any launch."""
    from llmpar.kernels.attention_tiles import row_blocks

    grids: dict = {}
    launches = attention_launches(90, torch.bfloat16, 64, causal=True, padded=False, grids=grids)
    for name, (_, kwargs) in launches.items():  # B = 2, Hq = 4, Hkv = 2, Sq = 37, Sk = 53
        rows, heads = (53, 2 * 2) if name == "_dkdv_kernel" else (37, 2 * 4)
        block = kwargs["BLOCK_N" if name == "_dkdv_kernel" else "BLOCK_M"]
        assert tuple(grids[name]) == (heads, -(-rows // block)), (name, grids[name])
    assert row_blocks(65535 * 16, 16, "Sq") == 65535
    with pytest.raises(ValueError, match=r"Sq=1048561 needs 65536 blocks of 16 rows on grid axis 1"):
        row_blocks(65535 * 16 + 1, 16, "Sq")
