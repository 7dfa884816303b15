"""pack_quantize (a gradient bucket packed, scaled, error-fed and quantized to int8/int4 in one pass) and
dequantize_sum (the wire rows of every peer summed back) vs the plain torch composition of the same math: pack the
bucket (``torch.cat`` + cast + ``mul_``), add the residual, then quantize / update the residual with the op's torch
path (llmpar/ops/quant.py, several passes over the buffer); dequantize every row, then ``sum(0)``.
Inputs: the tests' ``make_tensors`` (tests/test_ops_bucket.py: fresh random data over a few magnitudes) at uneven
sizes, a few big tensors and many small, split into 8 rows (one per data-parallel peer).
"""

from __future__ import annotations

import math

import torch
from suite_util import IMPLS, bucket_ident, bucket_tensors, grid, require, run

from llmpar.ops import quant as Q

SIZES = {"cpu": [(1 << 20, 64), (1 << 22, 64)], "cuda": [(1 << 24, 200), (1 << 26, 200)]}  # (elements, tensors)
ROWS, BLOCK = 8, 256
# case: (gradient dtype, scale, error feedback)
CASES = {"fp32 x1/8 ef": (torch.float32, 0.125, True), "bf16": (torch.bfloat16, 1.0, False)}
BITS = {"int8": 8, "int4": 4}
BITS_NAME = {v: k for k, v in BITS.items()}


def _bucket(device, size, case, bits):
    dtype, scale, ef = CASES[case]
    tensors = bucket_tensors(device, size, dtype)
    total = sum(t.numel() for t in tensors)
    m = math.ceil(total / ROWS)
    residual = torch.zeros(ROWS * m, device=device) if ef else None
    wire = torch.empty(ROWS, Q.row_bytes(m, bits, BLOCK), dtype=torch.uint8, device=device)
    return tensors, total, m, scale, residual, wire


@grid(SIZES, bucket_ident, case=CASES, bits=BITS, impl=IMPLS)
def test_pack_quantize(benchmark, device, size, case, bits, impl):
    require(impl, device, ("pack_quantize",))
    bits = BITS[bits]
    tensors, total, m, scale, residual, wire = _bucket(device, size, case, bits)
    if impl != "torch":

        def fn():
            return Q.pack_quantize(
                tensors, rows=ROWS, m=m, bits=bits, block=BLOCK, scale=scale, residual=residual, out=wire
            )
    else:
        flat = torch.zeros(ROWS * m, device=device)

        def fn():
            flat[:total].copy_(torch.cat([t.reshape(-1) for t in tensors]))
            if scale != 1.0:
                flat[:total].mul_(scale)
            if residual is not None:
                flat.add_(residual)
            Q._torch_quantize(
                flat.view(ROWS, m), wire, m, bits, BLOCK, residual.view(ROWS, m) if residual is not None else None
            )
            return wire

    run(benchmark, fn, device=device, group=f"pack_quantize {case} {BITS_NAME[bits]} {bucket_ident(size)}", impl=impl)


@grid(SIZES, bucket_ident, bits=BITS, impl=IMPLS)
def test_dequantize_sum(benchmark, device, size, bits, impl):
    require(impl, device, ("dequantize_sum",))
    bits = BITS[bits]
    tensors, _, m, _, _, wire = _bucket(device, size, "bf16", bits)
    Q.pack_quantize(tensors, rows=ROWS, m=m, bits=bits, block=BLOCK, out=wire)
    out = torch.zeros(m, device=device)
    if impl != "torch":

        def fn():
            return Q.dequantize_sum(wire, m=m, bits=bits, block=BLOCK, out=out, accumulate=True)
    else:
        rows = torch.empty(ROWS, m, device=device)

        def fn():
            Q._torch_dequantize(wire, m, bits, BLOCK, rows)
            return out.add_(rows.sum(0))

    run(benchmark, fn, device=device, group=f"dequantize_sum {BITS_NAME[bits]} {bucket_ident(size)}", impl=impl)
