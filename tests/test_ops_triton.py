"""Triton twin of the bucket kernels (llmpar.kernels.bucket) under TRITON_INTERPRET=1 on CPU, vs float64 and torch.

triton.jit picks its interpreter when a kernel is decorated, so TRITON_INTERPRET must be set before llmpar.kernels
is imported, and setting it in the main pytest process would send every other CPU op to the slow interpreter. So:
run without TRITON_INTERPRET=1, this module runs itself under pytest in a subprocess that has it set; run with
TRITON_INTERPRET=1 from the start (that subprocess, or a whole suite run that way), the tests below run in-process.
"""

from __future__ import annotations

import os

import pytest
import torch

from interp import run_interpreted

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.skipif(INTERPRET, reason="already under TRITON_INTERPRET=1: the tests below run in-process")
def test_triton_kernels_under_interpreter_subprocess():
    run_interpreted(__file__, timeout=300)


interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")


def _make(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        x = torch.randn(s, generator=g, dtype=torch.float64) * 10.0 ** (i % 3 - 1)
        out.append(torch.where(x == 0, torch.ones_like(x), x).to(dtype))
    return out


def _close_to(got, ref):
    fi = torch.finfo(got.dtype)
    torch.testing.assert_close(got.double(), ref, rtol=fi.eps, atol=fi.tiny * fi.eps)


@interpreted
def test_interpreter_mode_recorded():
    from llmpar.kernels import bucket
    from llmpar.ops import select_backend

    assert bucket.INTERPRETED and bucket.HAS_TRITON
    assert select_backend("cpu") == "triton"


@interpreted
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype_out", DTYPES)
@pytest.mark.parametrize("dtype_in", DTYPES)
def test_triton_pack_unpack_vs_float64_and_torch(monkeypatch, dtype_in, dtype_out, scale):
    from llmpar.ops import pack_bucket, unpack_bucket

    # odd sizes; 1030 and 2049 cross the 1024-element program boundary; a misaligned view
    tensors = _make([(1,), (5,), (3, 41), (1030,), (2049,)], dtype_in) + [_make([(9,)], dtype_in, 1)[0][1:]]
    total = sum(t.numel() for t in tensors)
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    out = torch.full((total + 2,), 3.0, dtype=dtype_out)
    pack_bucket(tensors, out[1:], scale=scale)
    scale32 = float(torch.tensor(scale, dtype=torch.float32))
    ref = torch.cat([t.double().reshape(-1) for t in tensors]) * scale32
    _close_to(out[1 : total + 1], ref)
    assert out[0] == 3.0 and out[-1] == 3.0
    outs = unpack_bucket(out[1:], [torch.empty_like(t) for t in tensors], scale=2.0)

    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    expect = pack_bucket(tensors, scale=scale, dtype=dtype_out)
    # same math, one rounding each; allow one unit in the last place where rounding of ties may differ
    fi = torch.finfo(dtype_out)
    torch.testing.assert_close(out[1 : total + 1], expect, rtol=fi.eps, atol=fi.tiny * fi.eps)
    expect_outs = unpack_bucket(out[1:], [torch.empty_like(t) for t in tensors], scale=2.0)
    for o, e in zip(outs, expect_outs):
        fo = torch.finfo(o.dtype)
        torch.testing.assert_close(o, e, rtol=fo.eps, atol=fo.tiny * fo.eps)


@interpreted
def test_triton_many_tensors_and_empty(monkeypatch):
    from llmpar.ops import pack_bucket, unpack_bucket

    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    tensors = _make([(k % 13 + 1,) for k in range(60)], torch.float32) + [torch.empty(0)]
    flat = pack_bucket(tensors, scale=0.5)
    _close_to(flat, torch.cat([t.double().reshape(-1) for t in tensors]) * 0.5)
    outs = unpack_bucket(flat, [torch.empty_like(t) for t in tensors], scale=2.0)
    for o, t in zip(outs, tensors):
        torch.testing.assert_close(o, t, rtol=0, atol=0)


@interpreted
def test_forced_triton_falls_to_error_for_float64(monkeypatch):
    from llmpar.ops import pack_bucket

    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    with pytest.raises(TypeError, match="cannot use the triton kernel: dtype torch.float64"):
        pack_bucket([torch.randn(3, dtype=torch.float64)])
    monkeypatch.setenv("LLMPAR_BACKEND", "")
    assert pack_bucket([torch.randn(3, dtype=torch.float64)]).dtype == torch.float64  # auto: torch path
