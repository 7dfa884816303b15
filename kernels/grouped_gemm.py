"""Triton grouped GEMM: one launch multiplies every group of rows by its own matrix (the experts of a MoE layer).

Groups are given by ``offs``: E cumulative row ends (int32 or int64, non-decreasing, ``offs[E - 1] = M``), group e
holding rows ``[offs[e - 1], offs[e])`` (``offs[-1] = 0``); a group may be empty. Two kernels (device code:
grouped_gemm_kernel.py):

    grouped_mm     C[rows_e] = epi(A[rows_e] @ B[e])      A: [M, K], B: [E, K, n], any strides (B a transposed view
                                                          of packed [E, n, K] weights: no copy)
        epi 0      C = A B[e]                                          n = N, C: [M, N]
        epi 1      C = silu(A B[e][:, :N]) * (A B[e][:, N:])           n = 2N, C: [M, N]   (SwiGLU; the [M, 2N]
                                                                       product is written only when ``pre`` is
                                                                       given, for a backward that keeps it)
        epi 2      g = A B[e][:, :N], u = A B[e][:, N:] (recomputed), D = dH: [M, N]:
                   C[:, :N] = D * u * silu'(g),  C[:, N:] = D * silu(g)  n = 2N, C: [M, 2N]  (SwiGLU's backward)
    grouped_wgrad  C[e] = A[rows_e]^T @ B[rows_e]          A: [M, P], B: [M, Q], C: [E, P, Q]; C[e] = 0 when empty

with silu(g) = g sigmoid(g), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g), all in fp32 from the fp32 accumulators,
rounded once to C's dtype. The schedule needs no host copy of the offsets: each program of ``grouped_mm`` finds its
group and rows from them (grouped_gemm_kernel.py).

On CUDA the launches are autotuned over a per-architecture config list (Hopper sm_90+, Ampere sm_80/86/89), pruned
by a shared-memory bound (``smem_bound``; tests/test_grouped_gemm_compile.py compiles them for sm_80 and sm_90 and
checks the bound); the autotune key holds N, K, the epilogue and the precision, not M (the tokens per step vary;
a retune per step would cost more than it wins). ``LLMPAR_AUTOTUNE_CONFIGS=N`` keeps the first N fitting configs
(kernels/gemm_configs.py). Under TRITON_INTERPRET=1 one 16 x 16 x 16 tile runs. fp32 inputs use IEEE products unless
``allow_tf32``.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton  # noqa: F401
from .gemm_configs import autotune_limit

if HAS_TRITON:
    from .grouped_gemm_kernel import _grouped_mm_kernel, _grouped_wgrad_kernel

EPILOGUES = {"none": 0, "swiglu": 1, "swiglu_backward": 2}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps), most preferred first. wgrad: BLOCK_M tiles P, BLOCK_N Q.
HOPPER_CONFIGS = [
    (128, 128, 64, 4, 8),
    (128, 256, 64, 3, 8),  # the plain GEMM and the weight grad in 16-bit only (pruned elsewhere)
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 64, 32, 4, 4),  # fits every variant in fp32
]
AMPERE_CONFIGS = [
    (128, 128, 32, 4, 8),
    (64, 128, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 64, 32, 4, 4),
]
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
SMEM_LIMIT = {"ampere": 166912, "hopper": 232448}  # when the device cannot be asked: A100, H100/H200
TUNE_KEY = ["N", "K", "EPI", "SAVE_PRE", "IEEE"]
WGRAD_TUNE_KEY = ["P", "Q", "IEEE"]

_TUNED: dict = {}


def smem_bound(cfg: tuple, a_bytes: int, b_bytes: int, *, epi: int = 0) -> int:
    """Upper bound of one program's shared memory (bytes): ``stages * (BM BK a + BK BN b * (2 if epi else 1))`` (the
    SwiGLU epilogues stream the gate and the up tiles of B)."""
    bm, bn, bk, stages, _ = cfg
    return stages * (bm * bk * a_bytes + bk * bn * b_bytes * (2 if epi else 1))


def family(device) -> str:
    import torch

    major, _ = torch.cuda.get_device_capability(device)
    return "hopper" if major >= 9 else "ampere"


def smem_limit(device) -> int:
    """Max dynamic shared memory per block of ``device`` (torch's device properties, else the family's value)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    value = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
    return int(value) or SMEM_LIMIT[family(device)]


def fitting(table: list[tuple], limit: int, a_bytes: int, b_bytes: int, *, epi: int = 0) -> list[tuple]:
    """The rows of ``table`` within ``limit``, in order, cut to ``LLMPAR_AUTOTUNE_CONFIGS``; never empty (the last row,
    the smallest tile, stays)."""
    keep = [c for c in table if smem_bound(c, a_bytes, b_bytes, epi=epi) <= limit] or [table[-1]]
    n = autotune_limit()
    return keep[:n] if n else keep


def _table(device) -> list[tuple]:
    return HOPPER_CONFIGS if family(device) == "hopper" else AMPERE_CONFIGS


def _prune(table, wgrad: bool):
    def prune(configs, named_args, **kwargs):
        a, b, c = named_args["a_ptr"], named_args["b_ptr"], named_args["c_ptr"]
        rows = fitting(table, smem_limit(c.device), a.element_size(), b.element_size(), epi=kwargs.get("EPI", 0))
        by_row = {
            (cf.kwargs["BLOCK_M"], cf.kwargs["BLOCK_N"], cf.kwargs["BLOCK_K"], cf.num_stages, cf.num_warps): cf
            for cf in configs
        }
        return [by_row[r] for r in rows]

    return prune


def _tuned(fam: str, wgrad: bool):
    """The autotuner over one kernel for one architecture family (configs pruned to what fits)."""
    key = (fam, wgrad)
    if key not in _TUNED:
        table = HOPPER_CONFIGS if fam == "hopper" else AMPERE_CONFIGS
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in table
        ]
        _TUNED[key] = triton.autotune(
            configs=configs,
            key=list(WGRAD_TUNE_KEY if wgrad else TUNE_KEY),
            prune_configs_by={"early_config_prune": _prune(table, wgrad)},
        )(_grouped_wgrad_kernel if wgrad else _grouped_mm_kernel)
    return _TUNED[key]


def _launch(kernel, wgrad: bool, args: tuple, flags: dict, grid_of, device, a, b, epi: int = 0) -> None:
    """Interpreter / CPU: the fixed tile. CUDA: the first fitting config when LLMPAR_AUTOTUNE_CONFIGS=1 (no tuning),
    else the autotuner."""
    if INTERPRETED or device.type != "cuda":
        kernel[grid_of(INTERPRET_CONFIG)](*args, **flags, **INTERPRET_CONFIG)
        return
    if autotune_limit() == 1:
        bm, bn, bk, stages, warps = fitting(
            _table(device), smem_limit(device), a.element_size(), b.element_size(), epi=epi
        )[0]
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        kernel[grid_of(meta)](*args, **flags, **meta, num_stages=stages, num_warps=warps)
        return
    _tuned(family(device), wgrad)[grid_of](*args, **flags)


def _ieee(t, allow_tf32: bool) -> bool:
    return t.element_size() == 4 and not allow_tf32


def grouped_mm(a, b, offs, c, *, epi: int = 0, dh=None, pre=None, allow_tf32: bool = False) -> None:
    """c := epi(a[rows_e] @ b[e]) for every group e (module docstring); a: [M, K], b: [E, K, n], offs: [E],
    c: [M, N] (epi 0, 1) or [M, 2N] (epi 2), dh: [M, N] (epi 2), pre: [M, 2N] gets the product [g, u] (epi 1, when
    given). Any strides; c and pre written in their dtypes."""
    M, K = a.shape
    E, n = b.shape[0], b.shape[2]
    N = n if epi == 0 else n // 2
    if M == 0 or N == 0:
        return
    d = dh if dh is not None else pre if pre is not None else c
    args = (
        a,
        b,
        c,
        d,
        offs,
        M,
        N,
        K,
        E,
        *a.stride(),
        *b.stride(),
        *c.stride(),
        *(d.stride() if d is not c else (0, 0)),
    )
    flags = dict(
        EPI=epi,
        SAVE_PRE=pre is not None,
        IEEE=_ieee(b, allow_tf32),
        INTERPRETER=INTERPRETED,
        E_BLOCK=max(128, triton.next_power_of_2(E)),  # one compiled kernel for every E <= 128
    )

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) + E, triton.cdiv(N, meta["BLOCK_N"]))

    _launch(_grouped_mm_kernel, False, args, flags, grid, c.device, a, b, epi)


def grouped_wgrad(a, b, offs, c, *, allow_tf32: bool = False) -> None:
    """c[e] := a[rows_e]^T @ b[rows_e] for every group e (zero for an empty group); a: [M, P], b: [M, Q],
    c: [E, P, Q]. Any strides."""
    P, Q = a.shape[1], b.shape[1]
    E = c.shape[0]
    if E == 0 or P == 0 or Q == 0:
        return
    args = (a, b, c, offs, P, Q, *a.stride(), *b.stride(), *c.stride())
    flags = dict(IEEE=_ieee(b, allow_tf32), INTERPRETER=INTERPRETED)

    def grid(meta):
        return (triton.cdiv(P, meta["BLOCK_M"]) * triton.cdiv(Q, meta["BLOCK_N"]), E)

    _launch(_grouped_wgrad_kernel, True, args, flags, grid, c.device, a, b)
