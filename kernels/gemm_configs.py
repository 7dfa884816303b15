"""Autotune configs of the Triton GEMM (kernels/gemm.py), the shared-memory bound that prunes them, and the switch
that limits autotuning during checks. Torch- and triton-free: the compile tests import it to check every config.

Shared memory of one program (bytes), an upper bound of what Triton allocates (checked against the compiled kernels
for sm_90, every config x flag variant x dtype, in tests/test_gemm_compile.py):
    stages * (BLOCK_M * BLOCK_K * (a + z) + BLOCK_K * BLOCK_N * b)  +  16 * BLOCK_M if ROWSUM
with a, b, z the element sizes of the A, B and gating (pre-activation, only when GATE_ACT) operands. A config whose
bound passes the device's limit (227 KB per block on Hopper) is dropped before tuning, so no variant ever launches
one that does not fit; the autotune key holds every flag (``TUNE_KEY``), so a config chosen for one variant is never
reused for another.

``LLMPAR_AUTOTUNE_CONFIGS=N`` keeps only the first N fitting configs of the list: a check run that compiles many
variants (bench/gpu_check.sh) spends seconds instead of minutes in autotuning. N=1 means no tuning at all: the kernel
is launched straight with the first fitting config, past Triton's autotuner (which counts its configs before pruning
them, so on some versions, triton 3.6 among them, it still benchmarks the one config left).
"""

from __future__ import annotations

import os

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps), most preferred first
HOPPER_CONFIGS = [
    (128, 256, 64, 8, 3, 8),
    (256, 128, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 4),
    (128, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 32, 8, 4, 4),
    (64, 64, 64, 8, 4, 4),
    (128, 64, 32, 8, 4, 4),  # fits fp32 with the gated (act') operand stream of the backward
]
AMPERE_CONFIGS = [
    (128, 256, 32, 8, 3, 8),
    (256, 128, 32, 8, 3, 8),
    (128, 128, 32, 8, 4, 4),
    (128, 64, 32, 8, 4, 4),
    (64, 128, 32, 8, 4, 4),
    (128, 32, 32, 8, 4, 4),
    (64, 32, 32, 8, 5, 2),
    (64, 64, 64, 8, 3, 4),
]
# the fixed config used under the interpreter (tl.dot needs every block dim >= 16)
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}

# constexpr flags of _gemm_kernel that select code (and shared memory): all of them are in the autotune key
FLAGS = ("ACT", "GATE_ACT", "HAS_BIAS", "HAS_RES", "SAVE_PRE", "ROWSUM", "ACCUMULATE", "IEEE")
TUNE_KEY = ["M", "N", "K", *FLAGS]
# max dynamic shared memory per block when the device cannot be asked: A100 (164 KB), H100/H200 (227 KB)
SMEM_LIMIT = {"ampere": 166912, "hopper": 232448}
AUTOTUNE_ENV = "LLMPAR_AUTOTUNE_CONFIGS"


def smem_bound(cfg: tuple, a_bytes: int, b_bytes: int, z_bytes: int, *, gate: bool, rowsum: bool) -> int:
    """Upper bound of one program's shared memory (module docstring) for ``cfg`` (a row of the tables)."""
    bm, bn, bk, _, stages, _ = cfg
    per_stage = bm * bk * (a_bytes + (z_bytes if gate else 0)) + bk * bn * b_bytes
    return stages * per_stage + (16 * bm if rowsum else 0)


def autotune_limit() -> int | None:
    """N of ``LLMPAR_AUTOTUNE_CONFIGS`` (None when unset, empty or 0: every fitting config)."""
    value = os.environ.get(AUTOTUNE_ENV, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{AUTOTUNE_ENV}={value!r} must be a number of configs (1, 2, ...; 0 or unset: all)") from None
    if n < 0:
        raise ValueError(f"{AUTOTUNE_ENV}={n} must be >= 0")
    return n or None


def fitting(
    table: list[tuple], limit: int, a_bytes: int, b_bytes: int, z_bytes: int, *, gate: bool, rowsum: bool
) -> list[tuple]:
    """The rows of ``table`` whose shared-memory bound is within ``limit``, in order, cut to ``autotune_limit()``.
    Never empty: the last row (the smallest tile) stays when nothing fits."""
    keep = [c for c in table if smem_bound(c, a_bytes, b_bytes, z_bytes, gate=gate, rowsum=rowsum) <= limit]
    keep = keep or [table[-1]]
    n = autotune_limit()
    return keep[:n] if n else keep
