"""Shared inputs, references and error bounds for the linear_act tests (test_ops_gemm*.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from llmpar.ops import linear_act
from llmpar.ops.gemm import _act_torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rand(shape, dtype, g, scale=1.0):
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return torch.where(x == 0, torch.full_like(x, 0.5), x).to(dtype)


def _inputs(m, k, n, dtype, seed=0, res_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = _rand((m, k), dtype, g)
    w = _rand((n, k), dtype, g, k**-0.5)
    b = _rand((n,), dtype, g, 0.5)
    r = _rand((m, n), res_dtype or dtype, g)
    dy = _rand((m, n), dtype, g)
    return x, w, b, r, dy


def _composition(x, w, b, r, act, out_dtype):
    y = _act_torch(F.linear(x, w, b), act)
    if r is not None:
        y = y + r
    return y.to(out_dtype)


def _grads(fn, tensors, dy, *, views: bool = False):
    """(fn(*leaves), their grads) for dy. The leaves are copies, or with ``views`` the tensors' own storage at their
    own offsets (detached, not copied: a misaligned view reaches ``fn`` misaligned)."""
    leaves = [None if t is None else (t.detach() if views else t.detach().clone()).requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad if t is not None else None for t in leaves]


def _err(got, ref):
    return (got.double() - ref).abs().max().item()


def _assert_within(got, ref, unfused, dtype, what):
    """got's error vs the float64 ref is <= 2x the unfused composition's, with one rounding of |ref| as floor."""
    fi = torch.finfo(dtype)
    floor = fi.eps * ref.abs().max().item()
    e_got, e_unfused = _err(got, ref), _err(unfused, ref)
    assert e_got <= 2 * e_unfused + floor, f"{what}: fused error {e_got:.3g} vs unfused {e_unfused:.3g} ({dtype})"


def _check_op(x, w, b, r, dy, act, out_dtype=None, *, check_backward=True, views=False):
    """linear_act (whatever backend dispatch picks) vs float64 and vs the torch composition in the same dtype;
    ``views``: linear_act gets x, w, b, r themselves (their storage and offsets), not aligned copies."""
    dtype = x.dtype
    out_dtype = out_dtype or dtype
    y64, g64 = _grads(
        lambda *t: _composition(*t, act, torch.float64),
        [v.double() if v is not None else None for v in (x, w, b, r)],
        dy.double(),
    )
    y_t, g_t = _grads(lambda *t: _composition(*t, act, out_dtype), [x, w, b, r], dy)
    y_f, g_f = _grads(
        lambda xx, ww, bb, rr: linear_act(xx, ww, bb, act=act, residual=rr, out_dtype=out_dtype),
        [x, w, b, r],
        dy,
        views=views,
    )
    assert y_f.dtype == out_dtype and y_f.shape == y64.shape
    _assert_within(y_f, y64, y_t, out_dtype, f"y ({act})")
    if check_backward:
        for name, gf, gt, gr, t in zip(("dx", "dw", "db", "dr"), g_f, g_t, g64, (x, w, b, r)):
            if t is None:
                continue
            assert gf.dtype == t.dtype and gf.shape == t.shape, name
            _assert_within(gf, gr, gt, dtype, f"{name} ({act})")
