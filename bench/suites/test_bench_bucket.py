"""pack_bucket / unpack_bucket (a gradient bucket to and from one flat buffer, with a cast and a scale) vs what DDP
and ZeRO do in plain torch: ``_flatten_dense_tensors`` (or ``torch.cat`` + ``.to`` + ``mul_`` when casting or
scaling) and ``_unflatten_dense_tensors`` + a ``copy_`` per tensor. Inputs: the tests' ``make_tensors``
(tests/test_ops_bucket.py: fresh random data over a few magnitudes) at uneven sizes, a few big tensors and many small.
"""

from __future__ import annotations

import torch
from suite_util import IMPLS, bucket_ident, bucket_tensors, grid, require, run
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from llmpar.ops import pack_bucket, unpack_bucket

SIZES = {"cpu": [(1 << 20, 64), (1 << 22, 64)], "cuda": [(1 << 24, 200), (1 << 26, 200)]}  # (elements, tensors)
CASES = {"fp32": (torch.float32, torch.float32, 1.0), "bf16->fp32 x1/8": (torch.bfloat16, torch.float32, 0.125)}


def _bucket(device, size, case):
    dtype_in, dtype_out, scale = CASES[case]
    tensors = bucket_tensors(device, size, dtype_in)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype_out, device=device)
    return tensors, flat, scale


@grid(SIZES, bucket_ident, case=CASES, impl=IMPLS)
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

    run(benchmark, fn, device=device, group=f"pack_bucket {case} {bucket_ident(size)}", impl=impl)


@grid(SIZES, bucket_ident, case=CASES, impl=IMPLS)
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

    run(benchmark, fn, device=device, group=f"unpack_bucket {case} {bucket_ident(size)}", impl=impl)
