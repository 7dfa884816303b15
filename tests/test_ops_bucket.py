"""llmpar.ops.pack_bucket / unpack_bucket: torch path (and CUDA extension, marked gpu) vs a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmpar.ops import pack_bucket, unpack_bucket

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = ((1,), (5,), (3, 41), (4097,), (2, 3, 7), (123,))


def make_tensors(shapes, dtype, *, device="cpu", seed=0):
    """Fresh random data over a few magnitudes, never zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        x = torch.randn(shape, generator=g, dtype=torch.float64) * (10.0 ** (i % 5 - 2))
        x = torch.where(x == 0, torch.ones_like(x), x)
        out.append(x.to(dtype).to(device))
    return out


def f32(scale: float) -> float:
    """The kernels (and torch on float32 data) apply the scale as a float32 number."""
    return float(torch.tensor(scale, dtype=torch.float32))


def ref_flat(tensors, scale):
    return torch.cat([t.detach().double().cpu().reshape(-1) for t in tensors]) * scale


def assert_rounded_once(got: torch.Tensor, ref: torch.Tensor):
    """got (any float dtype) is ref rounded to got.dtype: within one unit of its precision."""
    fi = torch.finfo(got.dtype)
    torch.testing.assert_close(got.double().cpu(), ref.cpu(), rtol=fi.eps, atol=fi.tiny * fi.eps)


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")


@pytest.mark.parametrize("scale", [1.0, 0.37, 1.0 / 4096])
@pytest.mark.parametrize("dtype_out", DTYPES)
@pytest.mark.parametrize("dtype_in", DTYPES)
def test_pack_unpack_torch_vs_float64(torch_backend, dtype_in, dtype_out, scale):
    tensors = make_tensors(SIZES, dtype_in, seed=hash((str(dtype_in), str(dtype_out))) % 1000)
    flat = pack_bucket(tensors, scale=scale, dtype=dtype_out)
    assert flat.dtype == dtype_out and flat.shape == (sum(t.numel() for t in tensors),)
    ref = ref_flat(tensors, f32(scale))
    assert_rounded_once(flat, ref)
    outs = [torch.full_like(t, float("nan")) for t in tensors]
    assert unpack_bucket(flat, outs, scale=1.0 / scale) == outs
    for o, t, r in zip(outs, tensors, ref.split([t.numel() for t in tensors])):
        # two roundings (into the bucket, back out); compare against the reference of that math
        back = (r.to(dtype_out).double() * f32(1.0 / scale)).reshape(t.shape)
        assert_rounded_once(o, back)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_torch_path_rounds_the_float32_product_once(torch_backend, dtype):
    """The torch path is bitwise the documented math (what the CUDA / Triton kernels compute): out =
    dtype(float32(x) * float32(scale)) for 16-bit -> same 16-bit dtype too. (torch's CPU _foreach_mul_ on bfloat16 /
    float16 tensors rounded the scale to the tensors' dtype first: ~3% of the elements one unit off.)"""
    tensors = make_tensors([(4097,), (3, 41), (123,)], dtype, seed=5)
    for scale in (1 / 0.37, 0.37, 1 / 3):
        want = torch.cat([(t.reshape(-1).float() * scale).to(dtype) for t in tensors])
        assert torch.equal(pack_bucket(tensors, scale=scale), want), scale
        flat = torch.cat([t.reshape(-1) for t in tensors])
        outs = unpack_bucket(flat, [torch.empty_like(t) for t in tensors], scale=scale)
        assert torch.equal(torch.cat([o.reshape(-1) for o in outs]), want), scale


def test_many_tensors_into_larger_out(torch_backend):
    shapes = [(k % 37 + 1,) for k in range(300)]
    tensors = make_tensors(shapes, torch.float32)
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 11,), 7.5)
    assert pack_bucket(tensors, out, scale=0.5) is out
    assert_rounded_once(out[:total], ref_flat(tensors, 0.5))
    assert torch.equal(out[total:], torch.full((11,), 7.5)), "elements past the tensors must stay untouched"


def test_float64_and_mixed_dtypes(torch_backend):
    tensors = make_tensors([(5,), (123,)], torch.float64) + make_tensors([(7,)], torch.bfloat16, seed=1)
    flat = pack_bucket(tensors, scale=3.0)
    assert flat.dtype == torch.float64  # promoted
    torch.testing.assert_close(flat, ref_flat(tensors, 3.0), rtol=1e-15, atol=0)
    outs = [torch.empty_like(t) for t in tensors]
    unpack_bucket(flat, outs, scale=1 / 3.0)
    for o, t in zip(outs, tensors):
        torch.testing.assert_close(o, t, rtol=torch.finfo(t.dtype).eps, atol=0)


def test_non_contiguous_and_empty_tensors():
    base = make_tensors([(9, 8)], torch.float32)[0]
    tensors = [base.t(), base[:, ::3], torch.empty(0), base[2]]
    flat = pack_bucket(tensors, scale=2.0)
    assert_rounded_once(flat, ref_flat(tensors, 2.0))
    # strided destinations: a transpose, a column slice, an empty one, every other element
    strided = [torch.empty(9, 8).t(), torch.empty(9, 8)[:, ::3], torch.empty(0), torch.empty(16)[::2]]
    assert not strided[0].is_contiguous() and not strided[3].is_contiguous()
    unpack_bucket(flat, strided, scale=0.5)
    for o, t in zip(strided, tensors):
        torch.testing.assert_close(o, t, rtol=0, atol=0)


def test_default_dtype_and_empty_list():
    tensors = make_tensors([(5,), (4,)], torch.bfloat16)
    assert pack_bucket(tensors).dtype == torch.bfloat16
    assert pack_bucket([], dtype=torch.float32).numel() == 0
    out = torch.ones(3)
    assert pack_bucket([], out) is out and torch.equal(out, torch.ones(3))


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    scale=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(sizes, scale, seed):
    tensors = make_tensors([(s,) for s in sizes], torch.float32, seed=seed)
    flat = pack_bucket(tensors, scale=scale)
    outs = unpack_bucket(flat, [torch.empty_like(t) for t in tensors], scale=1.0 / scale)
    for o, t in zip(outs, tensors):
        torch.testing.assert_close(o, t, rtol=3e-7, atol=0)


# ---- the Triton kernel's launch table (llmpar.kernels.bucket) ----

TABLE_LAYOUTS = (
    [1],
    [1024],
    [1025],
    [5, 1024, 1, 3 * 1024 + 17, 2047],
    [3] * 7,
    [2, 0, 3, 0],
    [0, 5],
    [k % 37 * 97 + 1 for k in range(300)],
)


@pytest.mark.parametrize("sizes", TABLE_LAYOUTS, ids=lambda s: f"{len(s)}x{sum(s)}")
def test_launch_table_equals_the_loop_it_replaced(sizes):
    """Both builders (numpy on the CPU, the torch ops a GPU runs) give exactly the table of the old per-block loop
    (bench/bench_bucket.py:loop_table), on odd layouts: one element, one block, a block and one, empty tensors."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_bucket import loop_table

    from llmpar.kernels import bucket

    tensors = [torch.empty(k) for k in sizes]
    ptrs, numels = tuple(t.data_ptr() for t in tensors), tuple(sizes)
    want = loop_table(tensors, bucket.BLOCK)
    programs = sum(-(-k // bucket.BLOCK) for k in sizes)
    for got, p in (
        bucket.table_rows(ptrs, numels, torch.device("cpu")),
        bucket._rows_torch(ptrs, numels, torch.device("cpu")),
    ):
        assert got.dtype == torch.int64 and p == programs and torch.equal(got, want)


def test_launch_table_is_cached_per_layout(monkeypatch):
    from llmpar.kernels import bucket

    built = []
    real = bucket.table_rows
    monkeypatch.setattr(bucket, "table_rows", lambda *a: built.append(a[1]) or real(*a))
    bucket._cached_table.cache_clear()
    a, b = [torch.empty(5), torch.empty(3000)], [torch.empty(5), torch.empty(2999)]
    flat = torch.empty(0)
    first = bucket._table(flat, a)
    assert bucket._table(flat, a)[0] is first[0] and built == [(5, 3000)], "same layout: the cached table"
    assert bucket._table(flat, b)[0] is not first[0] and built == [(5, 3000), (5, 2999)], "a new size: a new table"
    bucket._cached_table.cache_clear()


# ---- bad inputs: the error names the argument ----


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: pack_bucket(torch.ones(3)), TypeError, "tensors must be a list"),
        (lambda: pack_bucket([torch.ones(3), 2.0]), TypeError, "tensors[1]"),
        (lambda: pack_bucket([torch.ones(3, dtype=torch.int32)]), TypeError, "tensors[0] has dtype torch.int32"),
        (lambda: pack_bucket([torch.ones(3), torch.ones(2, device="meta")]), ValueError, "tensors[1] is on meta"),
        (lambda: pack_bucket([torch.ones(3)], torch.empty(2)), ValueError, "out has 2 elements"),
        (lambda: pack_bucket([torch.ones(4)], torch.empty(2, 2)), ValueError, "out must be 1-D"),
        (lambda: pack_bucket([torch.ones(3)], torch.empty(3, dtype=torch.int64)), TypeError, "out has dtype"),
        (lambda: pack_bucket([torch.ones(3)], torch.empty(3), dtype=torch.float16), ValueError, "disagrees with out"),
        (lambda: pack_bucket([torch.ones(3)], dtype=torch.int8), TypeError, "dtype must be a floating"),
        (lambda: pack_bucket([torch.ones(3)], scale=True), TypeError, "scale must be a real number"),
        (lambda: pack_bucket([torch.ones(3)], scale=torch.tensor(2.0)), TypeError, "scale must be a real number"),
        (lambda: pack_bucket([torch.ones(3)], scale=math.inf), ValueError, "scale must be finite"),
        (lambda: pack_bucket([]), ValueError, "tensors is empty"),
        (lambda: unpack_bucket(torch.ones(2), [torch.empty(3)]), ValueError, "flat has 2 elements"),
        (lambda: unpack_bucket([1.0], [torch.empty(1)]), TypeError, "flat must be a torch.Tensor"),
        (lambda: unpack_bucket(torch.ones(3, 1), [torch.empty(3)]), ValueError, "flat must be 1-D"),
        (lambda: unpack_bucket(torch.ones(3), torch.empty(3)), TypeError, "tensors must be a list"),
        (lambda: unpack_bucket(torch.ones(3, device="meta"), [torch.empty(3)]), ValueError, "flat is on meta"),
    ],
)
def test_bad_inputs(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


# ---- CUDA extension (H200 machine) ----

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype_out", DTYPES)
@pytest.mark.parametrize("dtype_in", DTYPES)
def test_gpu_backend_vs_torch(monkeypatch, dtype_in, dtype_out, scale, backend):
    """The CUDA extension's and the Triton kernel's pack / unpack equal the torch path bit for bit (one rounding of
    the float32 product), on aligned and misaligned views and many small tensors."""
    monkeypatch.setenv("LLMPAR_BACKEND", backend)
    shapes = [*SIZES, (4096 * 3 + 17,), *[(k,) for k in range(1, 40)]]
    tensors = make_tensors(shapes, dtype_in, device="cuda")
    # misaligned views: the scalar (non-vectorised) path
    tensors += [make_tensors([(4101,)], dtype_in, device="cuda", seed=3)[0][1:]]
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 3,), 5.0, dtype=dtype_out, device="cuda")
    pack_bucket(tensors, out[1:], scale=scale)  # misaligned out as well
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    expect = pack_bucket(tensors, scale=scale, dtype=dtype_out)
    ref = ref_flat(tensors, f32(scale))
    assert_rounded_once(out[1 : total + 1], ref)
    torch.testing.assert_close(out[1 : total + 1], expect, rtol=0, atol=0)  # same math, same rounding
    assert out[0].item() == 5.0 and out[-2:].eq(5.0).all()
    monkeypatch.setenv("LLMPAR_BACKEND", backend)
    outs = unpack_bucket(out[1:], [torch.empty_like(t) for t in tensors], scale=1 / scale)
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    expect_outs = unpack_bucket(out[1:], [torch.empty_like(t) for t in tensors], scale=1 / scale)
    for o, e in zip(outs, expect_outs):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


@gpu
@needs_cuda
def test_cuda_ext_opcheck():
    from llmpar.ops import _ext

    status = _ext.load()
    assert status.available, status.reason
    tensors = make_tensors([(5,), (123,), (4097,)], torch.bfloat16, device="cuda")
    out = torch.empty(sum(t.numel() for t in tensors), device="cuda")
    torch.library.opcheck(torch.ops.llmpar.pack_bucket.default, (tensors, out, 0.5))
    outs = [torch.empty_like(t) for t in tensors]
    torch.library.opcheck(torch.ops.llmpar.unpack_bucket.default, (out, outs, 2.0))


def test_triton_table_refuses_graph_capture(monkeypatch):
    """The Triton launchers' per-call table goes through pinned memory: under CUDA graph capture it is refused with
    an error that says why (a replay would read the reused buffer), before anything is pinned or copied; outside a
    capture, and on CPU, the table goes through. Every launcher goes through that one function."""
    import re as _re
    from pathlib import Path

    from llmpar.kernels._triton import pinned_to_device

    table = torch.arange(7, dtype=torch.int64)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"pack_bucket \(Triton\) cannot run under CUDA graph capture.*replay"):
        pinned_to_device(table, torch.device("cuda"), "pack_bucket")
    assert pinned_to_device(table, torch.device("cpu"), "pack_bucket") is table
    kernels = Path(__file__).resolve().parents[1] / "kernels"
    pinning = {p.name for p in kernels.glob("*.py") if _re.search(r"\.pin_memory\(", p.read_text())}
    assert pinning == {"_triton.py"}, f"pinned copies outside pinned_to_device: {pinning}"
