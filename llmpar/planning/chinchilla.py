"""Compute-optimal sizing (Hoffmann et al. 2022, "Chinchilla"), FLOPs per token and time to train.

Training compute for a dense transformer of N parameters on D tokens is C ~= 6 N D (2 N FLOPs per token forward,
4 N backward). At the compute-optimal point D ~= 20 N, so

    C = 6 N (20 N) = 120 N**2   =>   N = sqrt(C / 120),   D = 20 N = sqrt(10 C / 3).

(C / 120 is N squared, not N.) For C = 5.76e23 (Chinchilla's budget) this gives N = 6.93e10 and D = 1.39e12.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

TOKENS_PER_PARAM = 20.0
FLOPS_PER_PARAM_TOKEN = 6.0


@dataclass(kw_only=True, frozen=True)
class ChinchillaResult:
    """Training compute ``compute`` (FLOPs), parameters ``params`` (N) and tokens ``tokens`` (D), with C = 6 N D."""

    compute: float
    params: float
    tokens: float
    compute_optimal: bool  # True when N and D were placed at D = tokens_per_param * N

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    def to_dict(self) -> dict[str, float | bool]:
        return {**asdict(self), "tokens_per_param": self.tokens_per_param}


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a positive finite number")


def chinchilla(
    *,
    compute: float | None = None,
    params: float | None = None,
    tokens: float | None = None,
    tokens_per_param: float = TOKENS_PER_PARAM,
) -> ChinchillaResult:
    """Fill in C = 6 N D.

    - one of (compute, params, tokens) given: the compute-optimal point with D = tokens_per_param * N,
      i.e. N = sqrt(C / (6 r)), D = r N (r = 20: N = sqrt(C / 120));
    - two given: the third from C = 6 N D (the ratio D / N is whatever follows);
    - zero or three given: ValueError.
    """
    given = {k: v for k, v in (("compute", compute), ("params", params), ("tokens", tokens)) if v is not None}
    for name, value in given.items():
        _check_positive(name, value)
    _check_positive("tokens_per_param", tokens_per_param)
    k = FLOPS_PER_PARAM_TOKEN
    if len(given) == 1:
        if compute is not None:
            params = math.sqrt(compute / (k * tokens_per_param))
        elif params is None:
            assert tokens is not None
            params = tokens / tokens_per_param
        tokens = tokens_per_param * params
        return ChinchillaResult(compute=k * params * tokens, params=params, tokens=tokens, compute_optimal=True)
    if len(given) == 2:
        if compute is None:
            assert params is not None and tokens is not None
            compute = k * params * tokens
        elif params is None:
            assert tokens is not None
            params = compute / (k * tokens)
        else:
            tokens = compute / (k * params)
        return ChinchillaResult(compute=compute, params=params, tokens=tokens, compute_optimal=False)
    raise ValueError(
        f"give one or two of compute, params, tokens (got {sorted(given) or 'none'}); "
        "with one the other two are placed at the compute-optimal D = 20 N, with two the third follows from C = 6 N D"
    )


def flops_per_token(*, params: float, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token including attention (PaLM, Chowdhery et al. 2022, appendix B):

        6 N + 12 L h s

    ``6 N``: every weight is used in one multiply-add forward (2 N) and two backward (4 N).
    ``12 L h s``: per layer, Q K^T and (softmax) V each cost 2 s h FLOPs per token forward (h = heads x head_dim),
    4 s h forward, x3 with backward. The causal mask is not subtracted (the usual MFU convention).
    ``params`` should be the parameters that do matmuls (exclude the input-embedding lookup; see
    ``ModelSpec.matmul_params``).
    """
    for name, value in (("params", params), ("n_layers", n_layers), ("hidden", hidden), ("seq_len", seq_len)):
        _check_positive(name, value)
    return 6.0 * params + 12.0 * n_layers * hidden * seq_len


def time_to_train(*, compute: float, gpus: int, peak_flops: float, mfu: float) -> float:
    """Seconds to spend ``compute`` FLOPs on ``gpus`` devices of ``peak_flops`` FLOP/s each at a model-FLOPs
    utilisation ``mfu``: t = C / (gpus x peak x MFU)."""
    _check_positive("compute", compute)
    _check_positive("peak_flops", peak_flops)
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} must be a positive integer")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]")
    return compute / (gpus * peak_flops * mfu)
