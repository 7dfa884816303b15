"""The quantization maps and block sizes of the low-bit AdamW states (``lowbit.py``'s docstring says why these
maps: Dettmers et al. 2022's dynamic tree at 8 bits, Li et al. 2023's at 4 bits, the signed maps holding -1)."""

from __future__ import annotations

from functools import lru_cache

import torch

BLOCK: dict[int, int] = {8: 256, 4: 128}
BITS: tuple[int, ...] = (8, 4)


def check_bits(bits: object) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; use 8 or 4")
    return int(bits)


# ------------------------------------------------------------------------------------------------------ the maps


def dynamic_map(*, signed: bool, exponent_bits: int, total_bits: int) -> list[float]:
    """Dettmers' dynamic (tree) map: for e = 0 .. exponent_bits-1, the centres of equal bins of [0.1, 1] scaled by
    10^(e - exponent_bits + 1); 2^e bins per sign when signed (the sign bit spends one bit), 2^(e+1) unsigned; then
    0 and 1. Signed: the negative entry of smallest magnitude gives its code to -1 (module docstring: both signs'
    absmax then dequantize exactly). Sorted ascending, 2^total_bits entries."""
    values: list[float] = [0.0, 1.0]
    data_bits = total_bits - 1  # the sign bit (signed), or the bit the unsigned map gives to the fraction instead
    for e in range(exponent_bits):
        bins = 2 ** (e + data_bits - exponent_bits + (0 if signed else 1))
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float64)
        centres = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - exponent_bits + 1)).tolist()
        values += centres + ([-c for c in centres] if signed else [])
    if signed:
        values.remove(max(v for v in values if v < 0))
        values.append(-1.0)
    if len(values) != 2**total_bits:
        raise AssertionError(f"dynamic map has {len(values)} entries, not {2**total_bits}")
    return sorted(values)


@lru_cache(maxsize=None)
def _qmap_cpu(bits: int, signed: bool) -> torch.Tensor:
    if bits == 8:
        values = dynamic_map(signed=signed, exponent_bits=7, total_bits=8)
    elif signed:
        values = dynamic_map(signed=True, exponent_bits=3, total_bits=4)
    else:
        values = [(k + 1) / 16 for k in range(16)]  # linear, no zero (Li et al. 2023)
    return torch.tensor(values, dtype=torch.float32)


def qmap(bits: int, signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The quantization map for m (signed) or v (unsigned) at ``bits``: float32 [2^bits], ascending (a fresh copy)."""
    return _qmap_cpu(check_bits(bits), bool(signed)).to(device or "cpu", copy=True)


def midpoints(q: torch.Tensor) -> torch.Tensor:
    """mid[k] = (q[k] + q[k+1]) / 2 in float32: the decision boundaries of round-to-nearest."""
    q = q.to(torch.float32)
    return (q[:-1] + q[1:]) / 2


__all__ = ["BITS", "BLOCK", "check_bits", "dynamic_map", "midpoints", "qmap"]
