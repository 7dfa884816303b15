"""Blockwise symmetric int8 / int4 quantization on a "wire" buffer, fused with bucket packing and with the reduction
of what arrives: the compute half of ZeRO's compressed collectives (``llmpar/zero/compressed.py`` sends the bytes).

A wire buffer is ``uint8 [rows, row_bytes]``: one independent quantized row of ``m`` values per peer rank.

    row r, bytes [0, code_bytes):                  codes; bits=8: int8 c in [-127, 127], one per byte;
                                                   bits=4: value j in the low (j even) / high (j odd) nibble of byte
                                                   j // 2, stored as c + 8 with c in [-7, 7] (a missing last value: 8)
                                                   (bytes past the codes, up to code_bytes: 0)
    row r, bytes [code_bytes, row_bytes):          float32 scales, one per group of ``block`` values (the last one
                                                   may be short): scale_g = absmax(x_g) / qmax  (qmax 127 or 7)
    code_bytes = round_up(ceil(m * bits / 8), 4);   row_bytes = code_bytes + 4 * ceil(m / block)

    c_j = clamp(round_half_even(x_j / scale_g), -qmax, qmax)   (scale 0: c = 0);   x_j ~ c_j * scale_g
    round trip: |x_j - c_j * scale_g| <= scale_g / 2 (+ the rounding of the division), per block

Ops (each with a torch path for any device; the fused kernels of ``llmpar.kernels.quant`` / ``csrc/quant_*`` take
the same wire format):
    quantize_rows(x [rows, m])                                    -> wire
    pack_quantize(tensors, rows, m, scale, residual)              -> wire   (packs the tensors back to back,
        zero past their end, times ``scale``, plus ``residual`` [rows*m] fp32 when given; the residual then holds
        x - dequant(wire): error feedback, the compression error carried to the next call)
    dequantize_rows(wire, m, out [rows, m])                       -> out    (unpack of a gathered buffer)
    dequantize_sum(wire, m, out [m], accumulate)                  -> out    out (+)= sum_r dequant(row r), in rank
                                                                            order, in float32 (float64 for float64 out)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from llmpar.ops._dispatch import select_backend
from llmpar.ops.bucket import _check_list, _check_scale

BITS = (8, 4)
QMAX = {8: 127, 4: 7}
DEFAULT_BLOCK = 256
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KERNEL_MAX_BLOCK = 4096  # MAX_BLOCK of llmpar.kernels.quant and LLMPAR_QUANT_MAX_BLOCK of csrc/quant.cuh


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")
    return int(v)


def _check_layout(m: object, bits: object, block: object) -> tuple[int, int, int]:
    m_, block_ = _positive_int("m", m), _positive_int("block", block)
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported: expected 8 or 4")
    return m_, BITS[BITS.index(bits)], block_  # the int equal to bits


def code_bytes(m: int, bits: int) -> int:
    """Bytes of one row's codes (rounded up to 4, so that the scales after them are aligned)."""
    n = (m * bits + 7) // 8
    return (n + 3) // 4 * 4


def row_bytes(m: int, bits: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of one wire row of ``m`` values: codes + float32 scales."""
    m, bits, block = _check_layout(m, bits, block)
    return code_bytes(m, bits) + 4 * math.ceil(m / block)


def _check_wire(wire: object, m: int, bits: int, block: int, rows: int | None = None) -> torch.Tensor:
    if not isinstance(wire, torch.Tensor):
        raise TypeError(f"wire must be a torch.Tensor, got {type(wire).__name__}")
    want = row_bytes(m, bits, block)
    if wire.dtype != torch.uint8 or wire.dim() != 2 or wire.shape[1] != want or not wire.is_contiguous():
        raise ValueError(
            f"wire must be a contiguous uint8 [rows, {want}] tensor for m={m}, bits={bits}, "
            f"block={block}; got {wire.dtype} {tuple(wire.shape)}"
        )
    if rows is not None and wire.shape[0] != rows:
        raise ValueError(f"wire has {wire.shape[0]} rows, expected {rows}")
    return wire


def _new_wire(rows: int, m: int, bits: int, block: int, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(rows, row_bytes(m, bits, block), dtype=torch.uint8, device=device)
    _check_wire(out, m, bits, block, rows)
    if out.device != device:
        raise ValueError(f"out (the wire) is on {out.device} but the data is on {device}")
    return out


def _split(wire: torch.Tensor, m: int, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a wire buffer: codes ``uint8 [rows, code_bytes]`` and scales ``float32 [rows, nblocks]``."""
    cb = code_bytes(m, bits)
    return wire[:, :cb], wire[:, cb:].view(torch.float32)


def _padded(x: torch.Tensor, m: int, block: int) -> torch.Tensor:
    """``x [rows, m]`` as ``[rows, nblocks, block]`` (zeros after m)."""
    nb = math.ceil(m / block)
    if nb * block != m:
        x = torch.nn.functional.pad(x, (0, nb * block - m))
    return x.reshape(x.shape[0], nb, block)


# ------------------------------------------------------------------------------------------------ torch path
def _torch_quantize(
    x: torch.Tensor, wire: torch.Tensor, m: int, bits: int, block: int, residual: torch.Tensor | None
) -> None:
    """x: float [rows, m] (any strides). Writes the wire; residual (fp32 [rows, m] view) := x - dequant."""
    qmax = QMAX[bits]
    codes_out, scales_out = _split(wire, m, bits, block)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    xb = _padded(x.to(wide), m, block)
    scale = xb.abs().amax(dim=2).to(torch.float32)  # [rows, nb]: the fp32 scale every backend stores
    # divided by a tensor, not a python number: CUDA divides by a scalar as a product with its reciprocal, which is
    # not correctly rounded; the kernels' division is
    scale = scale / torch.full_like(scale, qmax)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(wide)
    c = torch.round(xb / safe.unsqueeze(2)).clamp_(-qmax, qmax)  # round half to even, as the kernels
    scales_out.copy_(scale)
    flat = c.reshape(x.shape[0], -1)[:, :m].to(torch.int16)
    if residual is not None:
        residual.copy_((xb - c * safe.unsqueeze(2) * (scale > 0).unsqueeze(2)).reshape(x.shape[0], -1)[:, :m])
    if bits == 8:
        written = m
        codes_out[:, :m].copy_(flat.to(torch.int8).view(torch.uint8))
    else:
        u = (flat + 8).to(torch.uint8)
        if m % 2:
            u = torch.nn.functional.pad(u, (0, 1), value=8)
        written = u.shape[1] // 2
        codes_out[:, :written].copy_(u[:, 0::2] | (u[:, 1::2] << 4))
    codes_out[:, written:].zero_()  # the alignment bytes: zero, so equal data gives equal wire bytes


def _torch_pack_quantize(
    tensors: list[torch.Tensor],
    wire: torch.Tensor,
    rows: int,
    m: int,
    bits: int,
    block: int,
    scale: float,
    residual: torch.Tensor | None,
) -> None:
    """x = [cat(tensors), zeros][:rows * m] * scale (+ residual), in float32 (float64 if a tensor is), quantized."""
    total = sum(t.numel() for t in tensors)
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    x = torch.zeros(rows * m, dtype=wide, device=wire.device)
    if total:
        torch.cat([t.reshape(-1).to(wide) for t in tensors], out=x[:total])
    if scale != 1.0:
        x.mul_(scale)
    if residual is not None:
        x.add_(residual)
    _torch_quantize(x.view(rows, m), wire, m, bits, block, residual.view(rows, m) if residual is not None else None)


def _torch_codes(wire: torch.Tensor, m: int, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as float32 [rows, nb, block] zero past m, scales float32 [rows, nb])."""
    codes, scales = _split(wire, m, bits, block)
    if bits == 8:
        c = codes[:, :m].view(torch.int8).to(torch.float32)
    else:
        n = (m + 1) // 2
        b = codes[:, :n]
        c = torch.stack(((b & 15), (b >> 4)), dim=2).reshape(wire.shape[0], -1)[:, :m].to(torch.float32) - 8
    return _padded(c, m, block), scales


def _torch_dequantize(wire: torch.Tensor, m: int, bits: int, block: int, out: torch.Tensor) -> None:
    c, scales = _torch_codes(wire, m, bits, block)
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    x = (c.to(wide) * scales.to(wide).unsqueeze(2)).reshape(wire.shape[0], -1)[:, :m]
    out.copy_(x)


def _torch_dequantize_sum(
    wire: torch.Tensor, m: int, bits: int, block: int, out: torch.Tensor, accumulate: bool
) -> None:
    c, scales = _torch_codes(wire, m, bits, block)
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    x = (c.to(wide) * scales.to(wide).unsqueeze(2)).reshape(wire.shape[0], -1)[:, :m]
    total = out.to(wide) if accumulate else torch.zeros(m, dtype=wide, device=out.device)
    for r in range(x.shape[0]):  # rank order, one rounding per addition (as the kernels)
        total = total + x[r]
    out.copy_(total)


# ------------------------------------------------------------------------------------------------ public ops
def _block_unfit(block: int) -> str | None:
    """Why the fused kernels cannot take this block size (None: they can): a program holds one block."""
    if block < 2 or block > KERNEL_MAX_BLOCK or block & (block - 1):
        return f"block={block} (the kernels take a power of two in [2, {KERNEL_MAX_BLOCK}])"
    return None


def _backend(
    device: torch.device, dtypes: set[torch.dtype], op: str, block: int, extra_unfit: str | None = None
) -> str:
    unfit = extra_unfit or _block_unfit(block)
    for d in sorted(dtypes, key=str):
        if d not in KERNEL_DTYPES:
            unfit = unfit or f"dtype {d} (kernels take float32, float16, bfloat16)"
    return select_backend(device, kernel_unfit=unfit, op=op)


def quantize_rows(
    x: torch.Tensor, *, bits: int = 8, block: int = DEFAULT_BLOCK, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize each row of ``x [rows, m]`` (floating point) into a wire buffer ``uint8 [rows, row_bytes]``."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(
            f"x must be a floating-point [rows, m] tensor, got "
            f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}"
        )
    rows, m = x.shape
    m, bits, block = _check_layout(m, bits, block)
    wire = _new_wire(rows, m, bits, block, x.device, out)
    backend = _backend(x.device, {x.dtype}, "quantize_rows", block)
    with torch.no_grad():
        if backend == "torch":
            _torch_quantize(x, wire, m, bits, block, None)
        else:
            _kernels(backend).quantize_rows(x.contiguous(), wire, m, bits, block)
    return wire


def pack_quantize(
    tensors: Sequence[torch.Tensor],
    *,
    rows: int,
    m: int,
    bits: int = 8,
    block: int = DEFAULT_BLOCK,
    scale: float = 1.0,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack ``tensors`` back to back into ``rows * m`` values (zeros after their end), times ``scale``, plus
    ``residual`` (float32 ``[rows * m]``, updated in place to ``x - dequant``: error feedback), and quantize each
    row of ``m`` values into a wire buffer. One pass over the data on the kernel paths."""
    tensors = _check_list(tensors, "tensors")
    scale = _check_scale(scale)
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1:
        raise ValueError(f"rows={rows!r} must be a positive int")
    m, bits, block = _check_layout(m, bits, block)
    total = sum(t.numel() for t in tensors)
    if total > rows * m:
        raise ValueError(f"tensors hold {total} elements, more than rows * m = {rows} * {m}")
    device = tensors[0].device if tensors else (residual.device if residual is not None else torch.device("cpu"))
    if residual is not None:
        if (
            not isinstance(residual, torch.Tensor)
            or residual.dtype != torch.float32
            or residual.shape != (rows * m,)
            or not residual.is_contiguous()
            or residual.device != device
        ):
            raise ValueError(
                f"residual must be a contiguous float32 [{rows * m}] tensor on {device}, got "
                f"{getattr(residual, 'dtype', None)} {tuple(getattr(residual, 'shape', ()))}"
            )
    wire = _new_wire(rows, m, bits, block, device, out)
    dtypes = {t.dtype for t in tensors}
    backend = _backend(
        device,
        dtypes,
        "pack_quantize",
        block,
        f"the list mixes dtypes {sorted(map(str, dtypes))}" if len(dtypes) > 1 else None,
    )
    with torch.no_grad():
        if backend == "torch":
            _torch_pack_quantize(tensors, wire, rows, m, bits, block, scale, residual)
        else:
            srcs = [t.contiguous() for t in tensors if t.numel() > 0]
            _kernels(backend).pack_quantize(srcs, wire, rows, m, bits, block, scale, residual)
    return wire


def _check_out(out: object, shape: tuple[int, ...], device: torch.device, op: str, block: int) -> str:
    """Checks a dequantization's ``out``; returns the backend that writes it."""
    if (
        not isinstance(out, torch.Tensor)
        or not out.is_floating_point()
        or tuple(out.shape) != shape
        or out.device != device
    ):
        raise ValueError(
            f"out must be a floating {list(shape)} tensor on {device}, got "
            f"{getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))}"
        )
    return _backend(device, {out.dtype}, op, block, None if out.is_contiguous() else "out is not contiguous")


def dequantize_rows(
    wire: torch.Tensor,
    *,
    m: int,
    bits: int = 8,
    block: int = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Each wire row back to ``m`` values: ``out [rows, m]`` (any floating dtype; allocated as ``dtype`` when None)."""
    m, bits, block = _check_layout(m, bits, block)
    wire = _check_wire(wire, m, bits, block)
    rows = wire.shape[0]
    if out is None:
        out = torch.empty(rows, m, dtype=dtype, device=wire.device)
    backend = _check_out(out, (rows, m), wire.device, "dequantize_rows", block)
    with torch.no_grad():
        if backend == "torch":
            _torch_dequantize(wire, m, bits, block, out)
        else:
            _kernels(backend).dequantize_rows(wire, out, m, bits, block)
    return out


def dequantize_sum(
    wire: torch.Tensor,
    *,
    m: int,
    bits: int = 8,
    block: int = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out[m] (+)= sum over rows r (in order) of dequant(row r)``, summed in float32 (float64 for a float64 out):
    the local half of a quantized reduce-scatter. ``out`` allocated float32 when None (then ``accumulate`` must be
    False)."""
    m, bits, block = _check_layout(m, bits, block)
    wire = _check_wire(wire, m, bits, block)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out=")
        out = torch.empty(m, dtype=torch.float32, device=wire.device)
    backend = _check_out(out, (m,), wire.device, "dequantize_sum", block)
    with torch.no_grad():
        if backend == "torch":
            _torch_dequantize_sum(wire, m, bits, block, out, bool(accumulate))
        else:
            _kernels(backend).dequantize_sum(wire, out, m, bits, block, bool(accumulate))
    return out


def _kernels(backend: str):
    """The kernel module of ``backend`` ("cuda": the extension's ops, "triton": llmpar.kernels.quant)."""
    if backend == "cuda":
        import llmpar.ops._quant_cuda as quant_cuda

        return quant_cuda
    from llmpar.kernels import quant

    return quant


__all__ = [
    "BITS",
    "DEFAULT_BLOCK",
    "QMAX",
    "code_bytes",
    "dequantize_rows",
    "dequantize_sum",
    "pack_quantize",
    "quantize_rows",
    "row_bytes",
]
