"""Value checks shared by every typed config: each raises a ``TypeError`` / ``ValueError`` naming the setting, the
value given and what would be accepted. A floor-0 module (it imports nothing from llmpar), so any layer may use it;
the DeepSpeed JSON spelling itself is known only to ``llmpar.runtime``."""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any


def nearest(key: str, valid: list[str]) -> str:
    """' (did you mean "x"?)' for the closest valid key, or '' when nothing is close."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def check_keys(block: str, given: Any, valid: list[str], unsupported: dict[str, str] | None = None) -> None:
    """``given`` is a dict whose keys are all in ``valid``; a key of ``unsupported`` is an error giving its reason."""
    if not isinstance(given, dict):
        raise TypeError(f'"{block}" must be a JSON object (dict), got {type(given).__name__}')
    for key in given:
        if unsupported and key in unsupported:
            raise ValueError(f'"{block}.{key}" is a DeepSpeed key llmpar does not support: {unsupported[key]}')
        if key not in valid:
            raise ValueError(
                f'unknown key "{block}.{key}"{nearest(str(key), valid)}; valid keys: {", ".join(sorted(valid))}'
            )


INT64_MAX = 2**63 - 1  # the largest count a torch int64 tensor (a step counter, a numel) holds
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: hyper-parameters the fused kernels take in float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32 (below it: denormal, flushed to 0 on GPUs)


def _show(bound: float) -> str:
    return (
        "2**63 - 1 (int64)"
        if bound == INT64_MAX and isinstance(bound, int)
        else f"{bound:g}"
        if isinstance(bound, float) and bound not in (0.0, 1.0)
        else str(bound)
    )


def _range(minimum: float | None, maximum: float | None, below: float | None = None) -> str:
    """The accepted range in words: ">= 1 and <= 64"."""
    parts = (
        ([f">= {_show(minimum)}"] if minimum is not None else [])
        + ([f"<= {_show(maximum)}"] if maximum is not None else [])
        + ([f"< {_show(below)}"] if below is not None else [])
    )
    return " and ".join(parts)


def as_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = INT64_MAX) -> int:
    """An integer (integral floats such as DeepSpeed's ``5e8`` accepted) in [``minimum``, ``maximum``] (by default
    at most ``INT64_MAX``: every count ends up in a torch int64 somewhere)."""
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integral and (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or float(value) != int(value)
    ):
        raise TypeError(f'"{name}" must be an integer, got {value!r}')
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f'"{name}"={value} must be {_range(minimum, maximum)}')
    return value


def as_float(
    name: str, value: Any, *, minimum: float | None = None, below: float | None = None, maximum: float | None = None
) -> float:
    """A finite number (NaN and +-inf are refused: a training hyper-parameter is never infinite), in
    [``minimum``, ``maximum``] and below ``below``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f'"{name}" must be a number, got {value!r}')
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f'"{name}"={value} must be a finite number')
    if (
        (minimum is not None and value < minimum)
        or (below is not None and value >= below)
        or (maximum is not None and value > maximum)
    ):
        raise ValueError(f'"{name}"={value} must be {_range(minimum, maximum, below)}')
    return value


def as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f'"{name}" must be true or false, got {value!r}')
    return value


__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "INT64_MAX", "as_bool", "as_float", "as_int", "check_keys", "nearest"]
