"""Tiles and causal loop bounds of the Triton flash-attention kernels (kernels/attention.py): which blocks, warps and
pipeline stages each kernel runs with, and, for causal attention, which key / query blocks each program visits and
which of them need the position mask. Plain torch (device ops on the positions, no host sync); no Triton needed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import INTERPRETED

POS_MIN, POS_MAX = -(2**31) + 1, 2**31 - 1  # padding rows / keys of a block: never visible
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
MAX_GRID_Y = 65535  # CUDA's limit on grid axes 1 and 2 (the row blocks); axis 0 (batch x heads) takes 2^31 - 1


def config(kernel: str, itemsize: int, block_d: int, arch: int) -> dict:
    """Blocks, warps, stages of ``kernel`` ("fwd", "dq", "dkdv") by element size, padded head_dim, sm version (0: the
    interpreter's). Fixed, not autotuned: FlashAttention-2's tiles for 16-bit inputs and head_dim 64-128. fp32 tiles
    are small, with 8 warps and no software pipelining: an IEEE fp32 product runs on the FMA units with its operands
    and accumulators spread over the threads' registers (compute-bound: prefetching the next block buys little), and
    FlashAttention-2's fp32 halves (64 x 64, 64 x 32) spilled 0.5-8 KB of stack per thread on sm_80 / sm_90.
    tests/test_triton_compile.py compiles each for sm_80 / sm_90 and checks its shared memory and that no kernel
    spills (cuobjdump -res-usage: STACK 0, LOCAL 0)."""
    if arch == 0 or INTERPRETED:
        return dict(INTERPRET_CONFIG)
    wide = block_d > 64
    if itemsize == 2:
        stages = 3 if arch >= 90 else 2
        fwd = (128, 64) if arch >= 90 or not wide else (64, 64)  # sm_80 (fewer registers): 128 x 64 spills there,
        dkdv = (32, 64) if arch >= 90 else (32, 32)  # as dkdv's 32 x 64 (k, v, dk, dv stay in registers)
        bm, bn = {"fwd": fwd, "dq": (64, 32)}.get(kernel, dkdv)
        warps = 8 if wide or kernel != "dq" else 4  # fwd / dkdv at 4 warps: 255 registers and a spill on sm_80
        return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    bm, bn = {"fwd": (16, 32) if wide else (32, 32), "dq": (32, 16)}.get(kernel, (16, 32))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 8, "num_stages": 1}


def _block_tables(q_pos, k_pos, sq: int, sk: int, bm: int, bn: int):
    """The causal loop bounds (n_end [MB], n_full [MB], m_start [NB]) int32 on the positions' device.

    With qmin / qmax the min / max position of each query block and kmin / kmax of each key block: n_end is the end of
    the last key block whose min is <= qmax (a search in the suffix minima of kmin: no later block is visible);
    n_full <= n_end the number of leading key blocks whose max is <= qmin (a search in the prefix maxima of kmax: every
    row sees each of them whole); m_start the first query block whose max is >= kmin (prefix maxima of qmax). Device
    ops only, O(MB + NB), no host sync."""
    mb, nb = -(-sq // bm), -(-sk // bn)
    qmax = F.pad(q_pos, (0, mb * bm - sq), value=POS_MIN).view(mb, bm).amax(1)
    qmin = F.pad(q_pos, (0, mb * bm - sq), value=POS_MAX).view(mb, bm).amin(1)
    kmin = F.pad(k_pos, (0, nb * bn - sk), value=POS_MAX).view(nb, bn).amin(1)
    kmax = F.pad(k_pos, (0, nb * bn - sk), value=POS_MIN).view(nb, bn).amax(1)
    suffix_min = kmin.flip(0).cummin(0).values.flip(0).contiguous()  # nondecreasing
    n_end = torch.searchsorted(suffix_min, qmax, right=True)
    n_full = torch.minimum(torch.searchsorted(kmax.cummax(0).values.contiguous(), qmin, right=True), n_end)
    m_start = torch.searchsorted(qmax.cummax(0).values.contiguous(), kmin)
    return n_end.to(torch.int32), n_full.to(torch.int32), m_start.to(torch.int32)


def row_blocks(n: int, block: int, what: str) -> int:
    """ceil(n / block): the programs on grid axis 1; more than CUDA allows there raises a ValueError naming it."""
    blocks = -(-n // block)
    if blocks > MAX_GRID_Y:
        raise ValueError(
            f"{what}={n} needs {blocks} blocks of {block} rows on grid axis 1, over CUDA's {MAX_GRID_Y}: "
            "split the sequence (context parallelism) or use the torch path"
        )
    return blocks
