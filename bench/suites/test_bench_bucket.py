"""pack_bucket / unpack_bucket (a gradient bucket to and from one flat buffer, with a cast and a scale) vs what DDP
and ZeRO do in plain torch: ``_flatten_dense_tensors`` (or ``torch.cat`` + ``.to`` + ``mul_`` when casting or
scaling) and ``_unflatten_dense_tensors`` + a ``copy_`` per tensor. Inputs: the tests' ``make_tensors``
(tests/test_ops_bucket.py: fresh random data over a few magnitudes) at uneven sizes, a few big tensors and many small.
"""
from __future__ import annotations

import torch
from suite_util import IMPLS, grid, once, require, run
from test_ops_bucket import make_tensors
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from llmpar.ops import pack_bucket, unpack_bucket

SIZES = {"cpu": [(1 << 20, 64), (1 << 22, 64)], "cuda": [(1 << 24, 200), (1 << 26, 200)]}  # (elements, tensors)
CASES = {"fp32": (torch.float32, torch.float32, 1.0), "bf16->fp32 x1/8": (torch.bfloat16, torch.float32, 0.125)}


def _ident(size: tuple[int, int]) -> str:
    return f"{size[0] / 2**20:g}Mx{size[1]}"


def _shapes(numel: int, n: int) -> list[tuple[int]]:
    """n odd sizes summing to about numel: a few big, many small (a model's gradients)."""
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(n, generator=g) ** 3 + 1e-3
    sizes = (weights / weights.sum() * numel).long().clamp(min=1) | 1
    return [(int(s),) for s in sizes]


@once
def _tensors(size: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    return make_tensors(_shapes(*size), dtype)


def _bucket(device, size, case):
    dtype_in, dtype_out, scale = CASES[case]
    tensors = _tensors(device, size, dtype_in)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype_out, device=device)
    return tensors, flat, scale


@grid(SIZES, _ident, case=CASES, impl=IMPLS)
def test_pack_bucket(benchmark, device, size, case, impl):
    require(impl, device, ("pack_bucket",))
    tensors, flat, scale = _bucket(device, size, case)
    if impl != "torch":
        def fn():
            return pack_bucket(tensors, flat, scale=scale)
    elif flat.dtype == tensors[0].dtype and scale == 1.0:
        def fn():
            return _flatten_dense_tensors(tensors)
    else:
        def fn():
            return torch.cat([t.reshape(-1) for t in tensors]).to(flat.dtype).mul_(scale)
    run(benchmark, fn, device=device, group=f"pack_bucket {case} {_ident(size)}", impl=impl)


@grid(SIZES, _ident, case=CASES, impl=IMPLS)
def test_unpack_bucket(benchmark, device, size, case, impl):
    require(impl, device, ("unpack_bucket",))
    tensors, flat, scale = _bucket(device, size, case)
    pack_bucket(tensors, flat, scale=scale)
    outs = [torch.empty_like(t) for t in tensors]
    if impl != "torch":
        def fn():
            return unpack_bucket(flat, outs, scale=1.0 / scale)
    else:
        def fn():
            for o, v in zip(outs, _unflatten_dense_tensors(flat, outs)):
                o.copy_(v) if scale == 1.0 else o.copy_(v).mul_(1.0 / scale)
    run(benchmark, fn, device=device, group=f"unpack_bucket {case} {_ident(size)}", impl=impl)
