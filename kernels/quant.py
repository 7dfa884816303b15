"""Triton twin of csrc/quant_kernels.cu: blockwise symmetric int8 / int4 quantization on a "wire" buffer, fused with
bucket packing (and error feedback) on the way out and with the rank-order sum on the way in.

Wire layout (``uint8 [rows, row_bytes]``, one row of ``m`` values per peer; llmpar/ops/quant.py is the contract):
    bytes [0, code_bytes)          codes: int8 per byte (bits=8), or value j in the low (j even) / high (j odd) nibble
                                   of byte j // 2 as c + 8 (bits=4; a missing last value: 8); zeros up to code_bytes
    bytes [code_bytes, row_bytes)  float32 scale of each group of ``block`` values of the row
One program per quantization block (``BLOCK`` consecutive values of one row; BLOCK a power of two, 2..MAX_BLOCK):
    gather x (float32): pack: from the source tensors straight, through an int64 table (below); quantize_rows: from
        x [rows, m]; then x = x * scale (+ residual)                      (float32, one rounding each)
    s = absmax(x) / qmax                                                   (correctly rounded: tl.math.div_rn)
    c = clamp(round_half_even(x / s), -qmax, qmax), 0 where s == 0         (div_rn, then an exact floor-based RNE)
    store the codes, s, residual = x - c * s (error feedback), and zeros in the row's alignment bytes (last block).
Launches use ``enable_fp_fusion=False``: no FMA contraction, so the kernel rounds exactly like the torch path
(x * scale + residual and x - c * s are two roundings each there). The rounding helper is a floor-based round half to
even, not libdevice.rint, because the CPU interpreter has no libdevice; every step of it is exact for |q| < 2^23.

Pack table (int64, on the wire's device): [addr_i (n), start_i (n), numel_i (n), t0_p (P), t1_p (P)], where tensor i
covers flat values [start_i, start_i + numel_i) of the rows * m values and program p = row * nb + block reads the
tensors t0_p <= i < t1_p, the ones that overlap its block (a block may straddle many small tensors).
Dequantize: one program per block of a row (dequantize_rows) or per block of the m columns, looping over the rows in
order with a float32 accumulator (dequantize_sum). Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, pinned_to_device, tl, triton  # noqa: F401

MAX_BLOCK = 4096  # largest quantization block a program holds (values in registers)
QMAX = {8: 127, 4: 7}

if HAS_TRITON:

    @triton.jit
    def _round_half_even(q):
        r = tl.floor(q)
        d = q - r  # exact: q and floor(q) are within 1 of each other
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)

    @triton.jit
    def _quantize_kernel(
        src_ptr,  # x [rows, m] (SINGLE) or any typed pointer (unused) for a pack
        table_ptr,  # int64 pack table (see module docstring); unused when SINGLE
        n,  # tensors in the table
        programs,  # rows * nb
        wire_ptr,  # uint8 [rows, row_bytes]
        res_ptr,  # float32 [rows * m] (HAS_RES)
        m,
        nb,
        row_bytes,
        code_bytes,
        used_bytes,  # used_bytes = ceil(m * BITS / 8)
        scale,
        SINGLE: tl.constexpr,
        SRC_DTYPE: tl.constexpr,
        HAS_RES: tl.constexpr,
        UNIT_SCALE: tl.constexpr,
        BITS: tl.constexpr,
        QMAX_F: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = pid // nb
        b = pid - row * nb
        j = b * BLOCK + tl.arange(0, BLOCK)
        in_row = j < m
        flat = row.to(tl.int64) * m + j
        if SINGLE:
            x = tl.load(src_ptr + flat, mask=in_row, other=0.0).to(tl.float32)
        else:
            x = tl.zeros([BLOCK], dtype=tl.float32)
            t0 = tl.load(table_ptr + 3 * n + pid)
            t1 = tl.load(table_ptr + 3 * n + programs + pid)
            for t in range(t0, t1):
                addr = tl.load(table_ptr + t)
                start = tl.load(table_ptr + n + t)
                numel = tl.load(table_ptr + 2 * n + t)
                idx = flat - start
                mask = in_row & (idx >= 0) & (idx < numel)
                v = tl.load(addr.to(tl.pointer_type(SRC_DTYPE)) + idx, mask=mask, other=0.0)
                x = tl.where(mask, v.to(tl.float32), x)
        if not UNIT_SCALE:
            x = x * scale
        if HAS_RES:
            x = x + tl.load(res_ptr + flat, mask=in_row, other=0.0)
        s = tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX_F)
        safe = tl.where(s > 0.0, s, 1.0)
        c = _round_half_even(tl.math.div_rn(x, safe))
        c = tl.minimum(tl.maximum(c, -QMAX_F), QMAX_F)  # 0 where s == 0: x is 0 there (or underflowed: |x| < qmax*s)
        if HAS_RES:
            tl.store(res_ptr + flat, x - c * safe, mask=in_row)
        row_ptr = wire_ptr + row.to(tl.int64) * row_bytes
        ci = c.to(tl.int32)
        if BITS == 8:
            tl.store(row_ptr + j, (ci & 255).to(tl.uint8), mask=in_row)
        else:
            lo, hi = tl.split(tl.reshape(ci + 8, (BLOCK // 2, 2)))  # past m: c = 0 -> nibble 8
            jb = b * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
            tl.store(row_ptr + jb, (lo | (hi << 4)).to(tl.uint8), mask=jb < used_bytes)
        tl.store((row_ptr + code_bytes).to(tl.pointer_type(tl.float32)) + b, s)
        pad = used_bytes + tl.arange(0, 4)  # alignment bytes of the codes: zeros, written by the row's last block
        pad_end = tl.where(b == nb - 1, code_bytes, 0)
        tl.store(row_ptr + pad, tl.zeros([4], dtype=tl.uint8), mask=pad < pad_end)

    @triton.jit
    def _codes(row_ptr, b, j, m, used_bytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
        """float32 codes of block b of a row at its positions j = b * BLOCK + arange(BLOCK) (0 past m)."""
        if BITS == 8:
            v = tl.load(row_ptr + j, mask=j < m, other=0).to(tl.int32)
            c = tl.where(v > 127, v - 256, v)
        else:
            jb = b * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
            v = tl.load(row_ptr + jb, mask=jb < used_bytes, other=136).to(tl.int32)  # 136 = 0x88: two zero codes
            c = tl.reshape(tl.join((v & 15) - 8, (v >> 4) - 8), (BLOCK,))
            c = tl.where(j < m, c, 0)
        return c.to(tl.float32)

    @triton.jit
    def _dequantize_kernel(
        wire_ptr,
        out_ptr,
        rows,
        m,
        nb,
        row_bytes,
        code_bytes,
        used_bytes,
        SUM: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if SUM:  # out[m] (+)= sum_r c_r * s_r in rank order, float32
            b = pid
            j = b * BLOCK + tl.arange(0, BLOCK)
            if ACCUMULATE:
                acc = tl.load(out_ptr + j, mask=j < m, other=0.0).to(tl.float32)
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
            row_ptr = wire_ptr
            for _ in range(0, rows):
                c = _codes(row_ptr, b, j, m, used_bytes, BITS, BLOCK)
                s = tl.load((row_ptr + code_bytes).to(tl.pointer_type(tl.float32)) + b)
                acc = acc + c * s
                row_ptr += row_bytes  # pointer arithmetic is 64-bit: no overflow past 2 GiB of wire
            tl.store(out_ptr + j, acc.to(out_ptr.dtype.element_ty), mask=j < m)
        else:  # out[row, j] = c * s
            row = pid // nb
            b = pid - row * nb
            row_ptr = wire_ptr + row.to(tl.int64) * row_bytes
            j = b * BLOCK + tl.arange(0, BLOCK)
            c = _codes(row_ptr, b, j, m, used_bytes, BITS, BLOCK)
            s = tl.load((row_ptr + code_bytes).to(tl.pointer_type(tl.float32)) + b)
            tl.store(out_ptr + row.to(tl.int64) * m + j, (c * s).to(out_ptr.dtype.element_ty), mask=j < m)


def _geometry(m: int, bits: int, block: int) -> tuple[int, int, int, int]:
    """(nb, used_bytes, code_bytes, row_bytes) of a wire row; see the module docstring."""
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is not supported: expected 8 or 4")
    if block < 2 or block > MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two in [2, {MAX_BLOCK}] for the Triton kernels")
    nb = -(-m // block)
    used = (m * bits + 7) // 8
    code = (used + 3) // 4 * 4
    return nb, used, code, code + 4 * nb


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def _tl_dtype(dtype):
    import torch

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _pack_table(srcs, device, rows: int, m: int, block: int, nb: int):
    """int64 pack table (module docstring) on ``device``."""
    import torch

    numels = torch.tensor([t.numel() for t in srcs], dtype=torch.int64)
    ends = torch.cumsum(numels, 0)
    starts = ends - numels
    pid = torch.arange(rows * nb, dtype=torch.int64)
    row, b = pid // nb, pid % nb
    bstart = row * m + b * block
    bend = row * m + torch.clamp((b + 1) * block, max=m)
    t0 = torch.searchsorted(ends, bstart, right=True)  # first tensor ending after the block's start
    t1 = torch.searchsorted(starts, bend, right=False)  # first tensor starting at or after its end
    addrs = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64)
    table = torch.cat([addrs, starts, numels, t0, t1])
    return pinned_to_device(table, device, "pack_quantize")


def _launch_quantize(src, srcs, wire, rows: int, m: int, bits: int, block: int, scale: float, residual) -> None:
    import torch

    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    nb, used, code, rb = _geometry(m, bits, block)
    programs = rows * nb
    if programs == 0:
        return
    single = src is not None
    if single:
        table, n, dtype = wire, 0, src.dtype
    else:
        table, n = _pack_table(srcs, wire.device, rows, m, block, nb), len(srcs)
        dtype = srcs[0].dtype if srcs else torch.float32
    _quantize_kernel[(programs,)](
        src if single else wire,
        table,
        n,
        programs,
        wire,
        residual if residual is not None else wire,
        m,
        nb,
        rb,
        code,
        used,
        float(scale),
        SINGLE=single,
        SRC_DTYPE=_tl_dtype(dtype),
        HAS_RES=residual is not None,
        UNIT_SCALE=float(scale) == 1.0,
        BITS=bits,
        QMAX_F=float(QMAX[bits]),
        BLOCK=block,
        num_warps=_warps(block),
        enable_fp_fusion=False,
    )


def quantize_rows(x, wire, m: int, bits: int, block: int) -> None:
    """wire [rows, row_bytes] := the quantized rows of x [rows, m] (contiguous float32/float16/bfloat16, on wire's
    device). Checks are the caller's (llmpar/ops/quant.py)."""
    _launch_quantize(x, None, wire, x.shape[0], m, bits, block, 1.0, None)


def pack_quantize(srcs, wire, rows: int, m: int, bits: int, block: int, scale: float, residual) -> None:
    """wire := quantized rows of x = [cat(srcs), zeros][:rows * m] * scale (+ residual); residual (float32
    [rows * m] or None) := x - dequant(wire). srcs: contiguous, non-empty, one dtype, on wire's device."""
    _launch_quantize(None, list(srcs), wire, rows, m, bits, block, scale, residual)


def _launch_dequantize(wire, out, m: int, bits: int, block: int, total: bool, accumulate: bool) -> None:
    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    nb, used, code, rb = _geometry(m, bits, block)
    rows = wire.shape[0]
    programs = nb if total else rows * nb
    if programs == 0:
        return
    _dequantize_kernel[(programs,)](
        wire,
        out,
        rows,
        m,
        nb,
        rb,
        code,
        used,
        SUM=total,
        ACCUMULATE=accumulate,
        BITS=bits,
        BLOCK=block,
        num_warps=_warps(block),
        enable_fp_fusion=False,
    )


def dequantize_rows(wire, out, m: int, bits: int, block: int) -> None:
    """out [rows, m] (contiguous float32/float16/bfloat16) := c * s of each wire row, rounded once to out's dtype."""
    _launch_dequantize(wire, out, m, bits, block, total=False, accumulate=False)


def dequantize_sum(wire, out, m: int, bits: int, block: int, accumulate: bool) -> None:
    """out [m] (+)= sum over the wire's rows, in order, of c * s: float32 accumulation, one rounding to out's dtype at
    the end. With no rows, out is zeroed (accumulate=False) or left as it is."""
    _launch_dequantize(wire, out, m, bits, block, total=True, accumulate=accumulate)
