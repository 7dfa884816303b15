"""Parsing and printing of byte sizes, FLOP counts and durations for the planning tools.

Sizes follow the SI convention used by the ZeRO paper and by GPU vendors: 1 GB = 1e9 bytes, while
1 GiB = 2**30 bytes. A bare number is read as GB.
"""

from __future__ import annotations

import re

_UNITS: dict[str, float] = {
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2.0**10,
    "mib": 2.0**20,
    "gib": 2.0**30,
    "tib": 2.0**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | float | int, *, name: str = "size") -> float:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"1.5TB"`` -> 1.5e12, ``80`` or ``"80"`` -> 80e9 (GB)."""
    if isinstance(text, (int, float)):
        value, unit = float(text), "gb"
    else:
        match = _SIZE_RE.match(text)
        if match is None:
            raise ValueError(f"{name} {text!r} is not a size; expected a number with a unit such as '80GB' or '80GiB'")
        value, unit = float(match.group(1)), (match.group(2).lower() or "gb")
        if unit not in _UNITS:
            raise ValueError(
                f"{name} {text!r} has unknown unit {match.group(2)!r}; accepted: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
    if value <= 0:
        raise ValueError(f"{name} {text!r} must be positive")
    return value * _UNITS[unit]


def parse_count(text: str | float | int, *, name: str) -> float:
    """``"7B"`` -> 7e9, ``"1.4T"`` -> 1.4e12, ``"5.76e23"`` -> 5.76e23, ``"350M"`` -> 3.5e8."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$", text)
        if match is None:
            raise ValueError(f"{name} {text!r} is not a number; expected e.g. '7e9', '7B', '350M', '1.4T'")
        scale = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[match.group(2).lower()]
        value = float(match.group(1)) * scale
    if value <= 0:
        raise ValueError(f"{name} {text!r} must be positive")
    return value


def format_bytes(n: float) -> str:
    """SI bytes with three significant digits: ``format_bytes(31.40625e9) == "31.4 GB"``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_count(n: float) -> str:
    """``6.93e10`` -> ``"69.3B"``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def format_seconds(t: float) -> str:
    """A duration in the largest unit that keeps it >= 1: ``"3.2 ms"``, ``"1.5 s"``, ``"4.1 h"``, ``"23.5 days"``."""
    if t == 0:
        return "0 s"
    if t < 1e-3:
        return f"{t * 1e6:.3g} us"
    if t < 1.0:
        return f"{t * 1e3:.3g} ms"
    if t < 120:
        return f"{t:.3g} s"
    if t < 7200:
        return f"{t / 60:.3g} min"
    if t < 3 * 86400:
        return f"{t / 3600:.3g} h"
    return f"{t / 86400:.3g} days"
