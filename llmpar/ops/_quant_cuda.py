"""The CUDA backend of llmpar/ops/quant.py: the ``llmpar::`` quantization ops of the extension (csrc/quant_ops.cpp,
csrc/quant_kernels.cu), with the argument order of ``llmpar.kernels.quant``. Checks are the caller's (the op layer
has already checked shapes, dtypes, devices, and that the block suits the kernels); the C++ side checks again."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def quantize_rows(x: torch.Tensor, wire: torch.Tensor, m: int, bits: int, block: int) -> None:
    """wire [rows, row_bytes] := quantized rows of x [rows, m] (contiguous float32/float16/bfloat16)."""
    torch.ops.llmpar.quantize_rows(x, wire, m, bits, block)


def pack_quantize(
    srcs: Sequence[torch.Tensor],
    wire: torch.Tensor,
    rows: int,
    m: int,
    bits: int,
    block: int,
    scale: float,
    residual: torch.Tensor | None,
) -> None:
    """wire := quantized rows of [cat(srcs), zeros][:rows * m] * scale (+ residual); residual := x - dequant."""
    torch.ops.llmpar.pack_quantize(list(srcs), wire, rows, m, bits, block, float(scale), residual)


def dequantize_rows(wire: torch.Tensor, out: torch.Tensor, m: int, bits: int, block: int) -> None:
    """out [rows, m] := dequant(wire), rounded once to out's dtype."""
    torch.ops.llmpar.dequantize_rows(wire, out, m, bits, block)


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, m: int, bits: int, block: int, accumulate: bool) -> None:
    """out [m] (+)= sum over the wire's rows, in order, of dequant(row), in float32."""
    torch.ops.llmpar.dequantize_sum(wire, out, m, bits, block, bool(accumulate))
