"""Block quantization of the low-bit AdamW states, as ``lowbit.py``'s contract states it: the sizes of a state (codes
and scales of n elements at 8 or 4 bits), the 4-bit packing (element 2i in the low nibble of byte i), quantize (round to
the nearest map entry, or stochastically with counter-based uniforms that a shard draws as the whole tensor would)
and dequantize, the checks of a state and a zero state. Float32 math on any device; the maps are ``lowbit_maps.py``'s.
"""

from __future__ import annotations

import torch

from llmpar.ops.lowbit_maps import BLOCK, check_bits, midpoints, qmap

# --------------------------------------------------------------------------------------------- sizes and packing


def num_blocks(n: int, bits: int) -> int:
    return -(-n // BLOCK[check_bits(bits)])


def code_bytes(n: int, bits: int) -> int:
    return n if check_bits(bits) == 8 else -(-n // 2)


def state_bytes(n: int, bits: int) -> int:
    """Bytes of one moment's codes + scales for n elements."""
    return code_bytes(n, bits) + 4 * num_blocks(n, bits)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 16, [n] -> [ceil(n/2)] bytes: element 2i in the low nibble, 2i+1 in the high (0 pads odd n)."""
    c = codes.reshape(-1)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    c = c.view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """[ceil(n/2)] bytes -> [n] uint8 codes (inverse of :func:`pack4`)."""
    p = packed.reshape(-1)
    return torch.stack([p & 15, p >> 4], dim=1).reshape(-1)[:n]


# ------------------------------------------------------------------------------------- quantize / dequantize


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit multiply-xorshift hash of int64 lanes < 2^32 (multipliers < 2^31: the products stay below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 16)


def uniform(key: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """float32 [n] in [0, 1): counters start .. start + n - 1 of stream ``key`` (< 2^63), each hashed on its own, so
    a counter gives its number wherever it is drawn: a shard of a tensor draws what the whole tensor draws there."""
    c = torch.arange(start, start + n, device=device, dtype=torch.int64)
    x = _hash32((c & 0xFFFFFFFF) ^ (key & 0xFFFFFFFF))
    x = _hash32(x ^ (c >> 32) ^ (key >> 32))
    return (x >> 8).to(torch.float32) * 2.0**-24


def quantize(
    x: torch.Tensor, bits: int, signed: bool, *, qmap_: torch.Tensor | None = None, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization of ``x`` (any shape, n elements, read flat, float32 math) -> (codes uint8 [n] or
    [ceil(n/2)], scale float32 [ceil(n/B)]), as the module docstring states. ``noise``: stochastic rounding with these
    uniforms in [0, 1), float32, ceil(n/B) * B of them (one per element of the padded blocks; ``uniform`` draws them):
    the code is one of the two entries around y, the upper where u < (y - lo) / (hi - lo), unbiased inside the map's
    range; None rounds to nearest. ``qmap_``: the map (default ``qmap(bits, signed)``)."""
    bits = check_bits(bits)
    if not x.is_floating_point():
        raise TypeError(f"x has dtype {x.dtype}; quantize takes floating-point tensors")
    if not signed and x.numel() and bool((x < 0).any()):
        raise ValueError("x has negative entries; the unsigned map (signed=False, for v) takes x >= 0")
    q = qmap(bits, signed, x.device) if qmap_ is None else qmap_.to(x.device, torch.float32)
    n, block = x.numel(), BLOCK[bits]
    nb = -(-n // block)
    flat = x.detach().reshape(-1).to(torch.float32)
    if nb * block != n:
        flat = torch.cat([flat, flat.new_zeros(nb * block - n)])
    xb = flat.view(nb, block)
    scale = xb.abs().amax(dim=1) if n else flat.new_zeros(0)
    r = torch.where(scale == 0, torch.ones_like(scale), scale).reciprocal()  # s == 0: x == 0, y = 0
    y = xb * r[:, None]
    if noise is None:
        codes = torch.searchsorted(midpoints(q), y, side="left")
    else:
        lo = (torch.searchsorted(q, y, side="right") - 1).clamp_(0, q.numel() - 2)
        qlo, qhi = q[lo], q[lo + 1]
        frac = ((y - qlo) / (qhi - qlo)).clamp_(0.0, 1.0)
        codes = lo + (noise.view(y.shape) < frac).to(lo.dtype)
    codes = codes.reshape(-1)[:n].to(torch.uint8)
    return (codes if bits == 8 else pack4(codes)), scale.contiguous()


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    signed: bool,
    n: int,
    *,
    qmap_: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x[i] = qmap[code[i]] * scale[i // B] -> [n] of ``dtype`` (float32; float64 for references)."""
    bits = check_bits(bits)
    check_state(codes, scale, bits, n, "codes", "scale")
    q = qmap(bits, signed, codes.device) if qmap_ is None else qmap_.to(codes.device)
    c = codes.reshape(-1) if bits == 8 else unpack4(codes, n)
    block = BLOCK[bits]
    values = q.to(dtype)[c.long()]
    return values * scale.to(dtype).repeat_interleave(block)[:n]


def check_state(
    codes: torch.Tensor, scale: torch.Tensor, bits: int, n: int, codes_name: str = "codes", scale_name: str = "scale"
) -> None:
    """TypeError/ValueError naming the argument unless codes / scale fit n elements at ``bits``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"{codes_name} has dtype {codes.dtype}; codes are torch.uint8")
    if scale.dtype != torch.float32:
        raise TypeError(f"{scale_name} has dtype {scale.dtype}; scales are torch.float32")
    if codes.numel() != code_bytes(n, bits):
        raise ValueError(
            f"{codes_name} has {codes.numel()} bytes; {n} elements at {bits} bits take {code_bytes(n, bits)}"
        )
    if scale.numel() != num_blocks(n, bits):
        raise ValueError(
            f"{scale_name} has {scale.numel()} entries; {n} elements in blocks of {BLOCK[bits]} take "
            f"{num_blocks(n, bits)}"
        )


def new_state(n: int, bits: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Zero moments for n elements: codes of 0.0 in each map and zero scales (keys m_codes, m_scale, v_codes,
    v_scale)."""
    m_codes, m_scale = quantize(torch.zeros(n, device=device), bits, True)
    v_codes, v_scale = quantize(torch.zeros(n, device=device), bits, False)
    return {"m_codes": m_codes, "m_scale": m_scale, "v_codes": v_codes, "v_scale": v_scale}
