"""llmpar.ops.quant (blockwise int8/int4 wire format): every backend vs a float64 reference written here.

The reference, from the contract of llmpar/ops/quant.py: for block g of a row, s = float32(float32(absmax x_g) / qmax)
and c = clamp(round_half_even(x / s), -qmax, qmax) with x / s in float64. The wire is decoded here from its byte
layout (``decode``), independently of the op module. What is checked against it:
  * scales: bitwise equal to the reference when x is exactly the input (quantize_rows, pack with scale 1 and no
    residual); within 4 float32 ulps when x is formed in float32 (x * scale + residual: two roundings);
  * codes: equal to the reference, except a code may differ by one where the float64 ratio x / s lies within TIE of a
    half-integer (|frac(|x / s|) - 0.5| <= TIE). TIE = 2^-16 when x is exact (the only float32 rounding is the
    division's, half an ulp of |q| <= 127.5: 2^-18), 2^-13 when x is formed in float32 (|x32 - x64| <= 2 ulps of x
    moves q by <= 127.5 * 2^-22 < 2^-14). A block's largest |c| is qmax (0 for an all-zero block, whose scale is 0);
  * round trip: |x - c * s| <= s / 2 * (1 + 2^-10) per value;
  * residual (error feedback): equals x - c * s within 4 float32 ulps of the block's absmax;
  * dequantize_rows: c * s rounded once to out's dtype (within one ulp of it: the interpreter's float32 -> bf16 cast
    truncates where GPUs round to nearest, and the float32 -> float16 double rounding may differ from a direct one);
  * dequantize_sum: within the float32 accumulation bound (rows + 1) * eps32 * sum |terms| of the float64 sum, plus
    one rounding to out's dtype.
Backends: torch always; Triton under TRITON_INTERPRET=1 in a subprocess (small shapes; its wire is also bitwise equal
to the torch path's: same roundings); Triton compiled for sm_80/sm_90 without a GPU (no FMA, div.rn); the CUDA
extension and Triton on CUDA when a GPU is there (marked gpu: bitwise equal to the torch path).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from llmpar.ops import quant as Q

from interp import run_interpreted

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
QMAX = {8: 127, 4: 7}
EPS32 = 2.0**-23
TIE_EXACT, TIE_FORMED = 2.0**-16, 2.0**-13
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (m, rows, block): odd sizes, one value, blocks straddling nothing / everything, a short last block
SHAPES = ((1, 1, 32), (5, 4, 32), (123, 3, 64), (257, 2, 256), (4097, 1, 256), (4097, 2, 64))
SMALL = ((1, 1, 32), (5, 2, 32), (123, 3, 64), (257, 2, 256), (4097, 2, 64))  # under the interpreter (slow)

gpu = pytest.mark.gpu
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
main_only = pytest.mark.skipif(INTERPRET, reason="main process only")


# ------------------------------------------------------------------------------------------ data and reference


def rand(shape, dtype=torch.float32, *, seed=0, device="cpu"):
    """Fresh random data over a few magnitudes per row, never zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = torch.where(x == 0, torch.full_like(x, 0.5), x)
    if x.dim() == 2:
        x = x * 10.0 ** (torch.arange(x.shape[0], dtype=torch.float64) % 4 - 2).unsqueeze(1)
    return x.to(dtype).to(device)


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def decode(wire: torch.Tensor, m: int, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64 [rows, m], scales float64 [rows, nb]) from the wire's bytes; checks the padding bytes."""
    w = wire.cpu()
    rows, nb, used = w.shape[0], math.ceil(m / block), math.ceil(m * bits / 8)
    cb = (used + 3) // 4 * 4
    assert w.dtype == torch.uint8 and w.shape == (rows, cb + 4 * nb)
    assert (w[:, used:cb] == 0).all(), "alignment bytes must be zero"
    scales = w[:, cb:].contiguous().view(torch.float32).double()
    if bits == 8:
        codes = w[:, :m].contiguous().view(torch.int8).long()
    else:
        b = w[:, :used].long()
        nib = torch.stack((b & 15, b >> 4), dim=2).reshape(rows, -1)
        if m % 2:
            assert (nib[:, m] == 8).all(), "a missing last value is nibble 8"
        codes = nib[:, :m] - 8
    return codes, scales


def blocks(x: torch.Tensor, m: int, block: int) -> torch.Tensor:
    """[rows, m] -> [rows, nb, block] float64, zeros past m."""
    nb = math.ceil(m / block)
    return torch.nn.functional.pad(x.double(), (0, nb * block - m)).view(x.shape[0], nb, block)


def check_wire(
    wire, x64: torch.Tensor, m: int, bits: int, block: int, *, exact: bool, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All reference checks of a quantized wire of x64 [rows, m] (float64, the values the op quantized);
    residual: the op's updated residual [rows * m]. Returns (codes, scales)."""
    qmax = QMAX[bits]
    codes, scales = decode(wire, m, bits, block)
    xb = blocks(x64, m, block)
    cbk = blocks(codes.double(), m, block)
    absmax = xb.abs().amax(dim=2)
    s_ref = (absmax.float().double() / qmax).float().double()
    if exact:
        assert torch.equal(scales, s_ref), "scales must be float32(float32(absmax) / qmax)"
    else:
        torch.testing.assert_close(scales, s_ref, rtol=4 * EPS32, atol=0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    q = xb / safe
    ref = torch.round(q).clamp(-qmax, qmax)
    near_tie = ((q.abs() % 1) - 0.5).abs() <= (TIE_EXACT if exact else TIE_FORMED)
    diff = (cbk - ref).abs()
    bad = (diff > 1) | ((diff == 1) & ~near_tie)
    assert not bad.any(), f"codes off the reference at {bad.nonzero()[:5].tolist()}"
    assert (codes.abs() <= qmax).all()
    top = cbk.abs().amax(dim=2)
    assert torch.equal(top, torch.where(scales > 0, float(qmax), 0.0)), "a block's largest |code| is qmax"
    err = (xb - cbk * scales.unsqueeze(2)).abs()
    assert (err <= scales.unsqueeze(2) / 2 * (1 + 2.0**-10)).all(), "round trip beyond s / 2"
    if residual is not None:
        want = (xb - cbk * scales.unsqueeze(2)).reshape(x64.shape[0], -1)[:, :m].reshape(-1)
        atol = (4 * EPS32 * absmax).repeat_interleave(block, dim=1)[:, :m].reshape(-1)
        assert ((residual.double().cpu() - want).abs() <= atol).all(), "residual != x - dequant"
    return codes, scales


def check_dequant(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, m: int, block: int) -> None:
    exact = codes.double() * scales.repeat_interleave(block, dim=1)[:, :m]
    got = out.double().cpu()
    fi = torch.finfo(out.dtype)
    assert ((got - exact).abs() <= exact.abs() * fi.eps + fi.tiny * fi.eps).all(), "not c * s rounded once"
    if out.dtype in (torch.float32, torch.float64):
        assert torch.equal(got, exact.to(out.dtype).double()), "float32 out: exactly c * s rounded once"


def check_sum(out, codes, scales, m: int, block: int, start: torch.Tensor | None) -> None:
    terms = codes.double() * scales.repeat_interleave(block, dim=1)[:, :m]
    exact = terms.sum(0) + (start.double().cpu() if start is not None else 0)
    mag = terms.abs().sum(0) + (start.double().cpu().abs() if start is not None else 0)
    rows = codes.shape[0]
    bound = (rows + 1) * EPS32 * mag + torch.finfo(out.dtype).eps * exact.abs() + 1e-30
    if out.dtype == torch.float64:
        bound = 1e-12 * mag + 1e-30
    assert ((out.double().cpu() - exact).abs() <= bound).all()


def pack_inputs(dtype, *, seed=0, device="cpu"):
    """Many small tensors of odd sizes (blocks straddle them) + a few bigger ones; rows * m leaves a zero tail."""
    sizes = [1, 3, 5, 2, 7, 31, 1, 64, 33, 9, 130, 1, 17, 300, 2, 5]
    g = torch.Generator().manual_seed(seed)
    tensors = [
        rand((k,), dtype, seed=seed * 100 + i, device=device) * 10.0 ** float(torch.randint(-2, 2, (1,), generator=g))
        for i, k in enumerate(sizes)
    ]
    tensors[5] = tensors[5].view(31, 1)  # any shape
    total = sum(sizes)
    rows, m = 3, (total + 40) // 3  # zero tail of ~40 values
    return tensors, rows, m


def pack_x64(tensors, rows, m, scale, residual0):
    x = torch.zeros(rows * m, dtype=torch.float64)
    flat = torch.cat([t.double().cpu().reshape(-1) for t in tensors])
    x[: flat.numel()] = flat * f32(scale)
    if residual0 is not None:
        x += residual0.double().cpu()
    return x.view(rows, m)


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv("LLMPAR_BACKEND", name)

    return use


# ------------------------------------------------------------------------------------------------ torch path


@main_only
@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("m, rows, block", SHAPES)
def test_torch_quantize_dequantize_vs_float64(backend, m, rows, block, bits, dtype):
    backend("torch")
    x = rand((rows, m), dtype, seed=m + rows)
    wire = Q.quantize_rows(x, bits=bits, block=block)
    codes, scales = check_wire(wire, x.double(), m, bits, block, exact=True)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float64):
        check_dequant(Q.dequantize_rows(wire, m=m, bits=bits, block=block, dtype=out_dtype), codes, scales, m, block)
    start = rand((m,), seed=7)
    out = start.clone()
    Q.dequantize_sum(wire, m=m, bits=bits, block=block, out=out, accumulate=True)
    check_sum(out, codes, scales, m, block, start)
    check_sum(Q.dequantize_sum(wire, m=m, bits=bits, block=block), codes, scales, m, block, None)


@main_only
@pytest.mark.parametrize("bits", (8, 4))
def test_all_zero_block_has_scale_zero(backend, bits):
    backend("torch")
    x = rand((2, 100), seed=3)
    x[1, 32:64] = 0.0
    wire = Q.quantize_rows(x, bits=bits, block=32)
    codes, scales = check_wire(wire, x.double(), 100, bits, 32, exact=True)
    assert scales[1, 1] == 0 and (codes[1, 32:64] == 0).all() and (scales[0] > 0).all()
    assert (Q.dequantize_rows(wire, m=100, bits=bits, block=32)[1, 32:64] == 0).all()


@main_only
@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,))
@pytest.mark.parametrize("bits", (8, 4))
def test_torch_pack_quantize_error_feedback(backend, bits, dtype):
    backend("torch")
    tensors, rows, m = pack_inputs(dtype)
    residual = rand((rows * m,), seed=11) * 1e-3
    for scale in (0.37, 3.0):  # the residual carries from one call to the next
        before = residual.clone()
        wire = Q.pack_quantize(tensors, rows=rows, m=m, bits=bits, block=32, scale=scale, residual=residual)
        check_wire(wire, pack_x64(tensors, rows, m, scale, before), m, bits, 32, exact=False, residual=residual)
    plain = Q.pack_quantize(tensors, rows=rows, m=m, bits=bits, block=64)
    check_wire(plain, pack_x64(tensors, rows, m, 1.0, None), m, bits, 64, exact=True)


@main_only
def test_pack_quantize_of_nothing_is_zeros(backend):
    backend("torch")
    wire = Q.pack_quantize([], rows=2, m=5, bits=4, block=32)
    codes, scales = decode(wire, 5, 4, 32)
    assert (codes == 0).all() and (scales == 0).all()


# ------------------------------------------------------------------------------------------------ bad inputs


def _w(rows=2, m=10, bits=8, block=32, dtype=torch.uint8):
    return torch.zeros(rows, Q.row_bytes(m, bits, block), dtype=dtype)


@main_only
@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: Q.quantize_rows(torch.ones(2, 10), bits=3), ValueError, "bits=3"),
        (lambda: Q.quantize_rows(torch.ones(2, 10), block=0), ValueError, "block=0"),
        (lambda: Q.quantize_rows(torch.ones(10)), ValueError, "x must be a floating-point [rows, m]"),
        (lambda: Q.quantize_rows(torch.ones(2, 10, dtype=torch.int32)), ValueError, "x must be a floating-point"),
        (lambda: Q.quantize_rows(torch.ones(2, 10), out=_w(m=20)), ValueError, "wire must be a contiguous uint8"),
        (lambda: Q.quantize_rows(torch.ones(2, 10), out=_w(rows=3)), ValueError, "wire has 3 rows, expected 2"),
        (lambda: Q.quantize_rows(torch.ones(2, 10), out=_w().to("meta")), ValueError, "out (the wire) is on meta"),
        (lambda: Q.dequantize_rows(_w(dtype=torch.int8), m=10), ValueError, "wire must be a contiguous uint8"),
        (lambda: Q.dequantize_rows(torch.zeros(2, 7, dtype=torch.uint8), m=10), ValueError, "wire must be"),
        (lambda: Q.dequantize_rows([1, 2], m=10), TypeError, "wire must be a torch.Tensor"),
        (lambda: Q.dequantize_rows(_w(), m=10, bits=4), ValueError, "wire must be"),
        (lambda: Q.dequantize_rows(_w(), m=10, out=torch.empty(2, 11)), ValueError, "out must be a floating [2, 10]"),
        (lambda: Q.dequantize_rows(_w(), m=10, out=torch.empty(2, 10, dtype=torch.int32)), ValueError, "out must be"),
        (lambda: Q.dequantize_sum(_w(), m=10, out=torch.empty(11)), ValueError, "out must be a floating [10]"),
        (lambda: Q.dequantize_sum(_w(), m=10, accumulate=True), ValueError, "accumulate=True needs out="),
        (lambda: Q.pack_quantize([torch.ones(25)], rows=2, m=10), ValueError, "more than rows * m"),
        (lambda: Q.pack_quantize(torch.ones(5), rows=2, m=10), TypeError, "tensors must be a list"),
        (lambda: Q.pack_quantize([torch.ones(5, dtype=torch.int64)], rows=2, m=10), TypeError, "tensors[0] has dtype"),
        (lambda: Q.pack_quantize([torch.ones(5)], rows=0, m=10), ValueError, "rows=0"),
        (lambda: Q.pack_quantize([torch.ones(5)], rows=2, m=10, scale=math.nan), ValueError, "scale must be finite"),
        (
            lambda: Q.pack_quantize([torch.ones(5)], rows=2, m=10, residual=torch.zeros(20, dtype=torch.float64)),
            ValueError,
            "residual must be a contiguous float32 [20]",
        ),
        (lambda: Q.pack_quantize([torch.ones(5)], rows=2, m=10, residual=torch.zeros(19)), ValueError, "residual must"),
        (lambda: Q.pack_quantize([torch.ones(5)], rows=2, m=10, out=_w(m=10, bits=4)), ValueError, "wire must be"),
    ],
)
def test_bad_inputs(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


@main_only
def test_blocks_the_kernels_cannot_take_fall_back_to_torch(backend):
    assert Q._block_unfit(256) is None and Q._block_unfit(2) is None
    for block in (1, 100, 8192):
        assert f"block={block}" in Q._block_unfit(block)
    backend("torch")
    x = rand((2, 300), seed=5)
    wire = Q.quantize_rows(x, bits=4, block=100)  # not a power of two: the torch path serves it
    check_wire(wire, x.double(), 300, 4, 100, exact=True)


# ------------------------------------------------------------------------- Triton, interpreted on CPU tensors


@main_only
def test_triton_kernels_under_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, timeout=240, select="interp")


@interpreted
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("m, rows, block", SMALL)
def test_interp_quantize_dequantize(backend, m, rows, block, bits):
    for i, dtype in enumerate(DTYPES):
        x = rand((rows, m), dtype, seed=m + i)
        backend("triton")
        wire = Q.quantize_rows(x, bits=bits, block=block)
        codes, scales = check_wire(wire, x.double(), m, bits, block, exact=True)
        out = Q.dequantize_rows(wire, m=m, bits=bits, block=block, dtype=dtype)
        check_dequant(out, codes, scales, m, block)
        start = rand((m,), dtype, seed=3)
        total = Q.dequantize_sum(wire, m=m, bits=bits, block=block, out=start.clone(), accumulate=True)
        check_sum(total, codes, scales, m, block, start)
        backend("torch")
        assert torch.equal(wire, Q.quantize_rows(x, bits=bits, block=block)), "same roundings as the torch path"
        if dtype != torch.bfloat16:  # the interpreter truncates float32 -> bf16 (checked within an ulp above)
            assert torch.equal(out, Q.dequantize_rows(wire, m=m, bits=bits, block=block, dtype=dtype))
            assert torch.equal(
                total, Q.dequantize_sum(wire, m=m, bits=bits, block=block, out=start.clone(), accumulate=True)
            )


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (8, 4))
def test_interp_pack_quantize_error_feedback(backend, bits, dtype):
    tensors, rows, m = pack_inputs(dtype, seed=1)
    residual = rand((rows * m,), seed=12) * 1e-3
    backend("triton")
    before = residual.clone()
    wire = Q.pack_quantize(tensors, rows=rows, m=m, bits=bits, block=32, scale=0.37, residual=residual)
    check_wire(wire, pack_x64(tensors, rows, m, 0.37, before), m, bits, 32, exact=False, residual=residual)
    backend("torch")
    res_torch = before.clone()
    assert torch.equal(
        wire, Q.pack_quantize(tensors, rows=rows, m=m, bits=bits, block=32, scale=0.37, residual=res_torch)
    )
    assert torch.equal(residual, res_torch), "error feedback rounds like the torch path"
    backend("triton")
    plain = Q.pack_quantize(tensors[:3], rows=2, m=7, bits=bits, block=2)  # block 2: the smallest the kernels take
    check_wire(plain, pack_x64(tensors[:3], 2, 7, 1.0, None), 7, bits, 2, exact=True)


@interpreted
def test_interp_all_zero_block_and_unfit_blocks(backend):
    backend("triton")
    x = rand((2, 70), seed=4)
    x[0, :32] = 0.0
    for bits in (8, 4):
        wire = Q.quantize_rows(x, bits=bits, block=32)
        codes, scales = check_wire(wire, x.double(), 70, bits, 32, exact=True)
        assert scales[0, 0] == 0 and (codes[0, :32] == 0).all()
    with pytest.raises(TypeError, match=r"block=100 \(the kernels take a power of two"):
        Q.quantize_rows(x, bits=8, block=100)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        Q.dequantize_rows(Q.quantize_rows(x, block=32), m=70, block=32, dtype=torch.float64)
    backend("auto")  # not forced: the torch path takes what the kernels cannot
    check_wire(Q.quantize_rows(x, bits=8, block=100), x.double(), 70, 8, 100, exact=True)


# ----------------------------------------------------------- Triton compiled for the GPU, without a GPU


@main_only
@pytest.mark.parametrize("arch", (80, 90))
def test_triton_kernels_compile_as_launched(arch):
    """The launchers' real specialisations (m=1, rows=1, one tensor: constants) compile to machine code; the
    quantize kernel keeps its roundings: a correctly rounded division and no FMA contraction."""
    pytest.importorskip("triton")
    from triton_aot import Recorder, compile_like_launcher

    from llmpar.kernels import quant as K

    def record(name, launch):
        rec = Recorder()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(K, name, rec)
            launch()
        return rec.calls[0]

    for bits, m, rows in ((8, 123, 3), (4, 1, 1)):
        wire = torch.empty(rows, Q.row_bytes(m, bits, 64), dtype=torch.uint8)
        calls = [
            ("_quantize_kernel", lambda: K.quantize_rows(rand((rows, m), torch.bfloat16), wire, m, bits, 64)),
            (
                "_quantize_kernel",
                lambda: K.pack_quantize([rand((m,))], wire, rows, m, bits, 64, 0.5, torch.zeros(rows * m)),
            ),
            ("_dequantize_kernel", lambda: K.dequantize_rows(wire, torch.empty(rows, m), m, bits, 64)),
            (
                "_dequantize_kernel",
                lambda: K.dequantize_sum(wire, torch.empty(m, dtype=torch.float16), m, bits, 64, True),
            ),
        ]
        for name, launch in calls:
            kernel = compile_like_launcher(getattr(K, name), *record(name, launch), arch=arch)
            ptx = kernel.asm["ptx"]
            assert "fma.rn.f32" not in ptx, f"{name}: FMA contraction changes the roundings"
            if name == "_quantize_kernel":
                assert "div.rn.f32" in ptx


# ---------------------------------------------------------------------------------- CUDA (GPU machine only)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("impl", ("cuda", "triton"))
def test_gpu_kernels_match_torch_path_bitwise(backend, impl, bits, dtype):
    if impl == "cuda":
        from llmpar.ops._dispatch import cuda_unavailable_reason

        why = cuda_unavailable_reason(torch.device("cuda"), op="pack_quantize")
        if why:
            pytest.skip(why)
    for m, rows, block in SHAPES + ((1 << 16, 4, 4096), (1 << 16, 4, 2)):
        x = rand((rows, m), dtype, seed=m, device="cuda")
        backend(impl)
        wire = Q.quantize_rows(x, bits=bits, block=block)
        codes, scales = check_wire(wire, x.double(), m, bits, block, exact=True)
        outs = [Q.dequantize_rows(wire, m=m, bits=bits, block=block, dtype=d) for d in DTYPES]
        start = rand((m,), seed=2, device="cuda")
        total = Q.dequantize_sum(wire, m=m, bits=bits, block=block, out=start.clone(), accumulate=True)
        check_sum(total, codes, scales, m, block, start)
        backend("torch")
        assert torch.equal(wire, Q.quantize_rows(x, bits=bits, block=block)), (m, rows, block)
        for out, d in zip(outs, DTYPES):
            check_dequant(out, codes, scales, m, block)
            assert torch.equal(out, Q.dequantize_rows(wire, m=m, bits=bits, block=block, dtype=d))
        assert torch.equal(
            total, Q.dequantize_sum(wire, m=m, bits=bits, block=block, out=start.clone(), accumulate=True)
        )
    tensors, rows, m = pack_inputs(dtype, device="cuda")
    tensors.append(rand((4096 * 3 + 5,), dtype, seed=9, device="cuda")[1:])  # misaligned, many blocks
    rows, m = 4, (sum(t.numel() for t in tensors) + 100) // 4
    for block in (32, 256):
        residual = rand((rows * m,), seed=13, device="cuda") * 1e-3
        before = residual.clone()
        backend(impl)
        wire = Q.pack_quantize(tensors, rows=rows, m=m, bits=bits, block=block, scale=0.37, residual=residual)
        check_wire(wire, pack_x64(tensors, rows, m, 0.37, before), m, bits, block, exact=False, residual=residual)
        backend("torch")
        res_torch = before.clone()
        assert torch.equal(
            wire, Q.pack_quantize(tensors, rows=rows, m=m, bits=bits, block=block, scale=0.37, residual=res_torch)
        )
        assert torch.equal(residual, res_torch)


@gpu
def test_cuda_ext_opcheck():
    from llmpar.ops import _ext

    status = _ext.load()
    if not status.available:
        pytest.skip(status.reason)
    L = torch.ops.llmpar
    x = rand((3, 123), torch.bfloat16, device="cuda")
    wire = torch.zeros(3, Q.row_bytes(123, 4, 32), dtype=torch.uint8, device="cuda")
    tensors = [rand((5,), device="cuda"), rand((3, 41), seed=1, device="cuda"), rand((200,), seed=2, device="cuda")]
    torch.library.opcheck(L.quantize_rows.default, (x, wire, 123, 4, 32))
    torch.library.opcheck(
        L.pack_quantize.default, (tensors, wire, 3, 123, 4, 32, 0.37, rand((369,), seed=3, device="cuda"))
    )
    torch.library.opcheck(L.dequantize_rows.default, (wire, torch.empty(3, 123, device="cuda"), 123, 4, 32))
    torch.library.opcheck(L.dequantize_sum.default, (wire, rand((123,), device="cuda"), 123, 4, 32, True))
