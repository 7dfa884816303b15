"""The Triton flash-attention kernels (llmpar.kernels.attention) against float64, under the interpreter on CPU and on
a GPU (``-m gpu``: bench/gpu_check.sh).

The checks and bounds are tests/test_attention.py's (its module docstring derives them), with the kernels' extra
roundings: p is rounded to v's dtype before P @ V and dS to q's before dS @ K (out: 2 roundings, dv 2, dq / dk 3).
Under TRITON_INTERPRET=1 the conversion fp32 -> bf16 truncates instead of rounding to nearest, so there one rounding is
a whole ulp (``truncates=True``), not half of one. The interpreted tests run in one TRITON_INTERPRET=1 subprocess
started by the main-process test below (tests/interp.py), on tiny shapes with 16 x 16 blocks so that every loop
(key blocks, query blocks, the heads of a GQA group) and the causal block skipping run more than once.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_attention import Case, check_case, check_no_keys, check_split_keys, zigzag

from interp import run_interpreted

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")

interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
KERNEL = dict(fwd_roundings=2, bwd_roundings=3)


@pytest.mark.skipif(INTERPRET, reason="already under TRITON_INTERPRET=1: the tests below run in-process")
def test_attention_kernels_under_interpreter_subprocess():
    run_interpreted(__file__, timeout=400, select="interp", what="interpreted attention kernels")


INTERP_CASES = [  # (case, dtype, seq_major)
    (Case(b=1, hq=4, hkv=1, sq=37, sk=37, d=24, pad="some"), torch.bfloat16, True),  # GQA 4:1, D padded to 32
    (Case(b=2, hq=2, hkv=2, sq=7, sk=20, d=16, causal=False, pad="row"), torch.float32, False),
    (
        Case(b=1, hq=6, hkv=2, sq=20, sk=20, d=16, q_pos=zigzag(40, 2, 0), k_pos=zigzag(40, 2, 1)),
        torch.float16,
        False,
    ),  # zigzag blocks, empty rows
    # one row, head_dim 128, whose position equals the key block's first (min k_pos == max q_pos: not skipped)
    (Case(b=1, hq=1, hkv=1, sq=1, sk=9, d=128, q_pos=[6], k_pos=list(range(6, 15))), torch.bfloat16, False),
]


@interpreted
@pytest.mark.parametrize(
    "case, dtype, seq_major",
    INTERP_CASES,
    ids=lambda x: (
        str(x) if isinstance(x, Case) else str(x).replace("torch.", "") if isinstance(x, torch.dtype) else None
    ),
)
def test_interp_kernels_vs_float64(case, dtype, seq_major, monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    check_case(case, dtype, truncates=True, seq_major=seq_major, **KERNEL)


@interpreted
def test_interp_split_key_blocks_backward_from_final_lse(monkeypatch):
    """The ring's use of the kernels: per key block forward, merged; per block backward given the final out / lse."""
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    case = Case(b=1, hq=2, hkv=1, sq=20, sk=40, d=16, q_pos=zigzag(40, 2, 1), pad="some")
    check_split_keys(case, torch.bfloat16, cut=17, truncates=True, **KERNEL)


@interpreted
def test_interp_dispatch(monkeypatch):
    """Under the interpreter CPU tensors go to Triton by default; a forced triton refuses what the kernels cannot
    take (float64, head_dim > 128) with a TypeError naming it; unforced, those run the torch path."""
    from llmpar.kernels import attention as kernels
    from llmpar.ops import attention_fwd
    from llmpar.ops.attention import _backend

    monkeypatch.delenv("LLMPAR_BACKEND", raising=False)
    q = torch.randn(1, 2, 3, 16)
    assert kernels.INTERPRETED and _backend(q, q, q, "attention_fwd") == "triton"
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    for bad, words in ((q.double(), "float64"), (torch.randn(1, 2, 3, 256), "head_dim 256 > 128")):
        with pytest.raises(TypeError, match=words):
            attention_fwd(bad, bad, bad)
    check_no_keys()  # Sk = 0 on the Triton path: the launchers return empty rows without launching
    monkeypatch.delenv("LLMPAR_BACKEND")
    assert _backend(q.double(), q.double(), q.double(), "attention_fwd") == "torch"


def brute_force_blocks(q_pos, k_pos, bm: int, bn: int) -> torch.Tensor:
    """[MB, NB] bool: query block i sees some key of key block j (causal by position)."""
    vis = k_pos[None, :] <= q_pos[:, None]
    mb, nb = -(-len(q_pos) // bm), -(-len(k_pos) // bn)
    return torch.stack(
        [torch.stack([vis[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].any() for j in range(nb)]) for i in range(mb)]
    )


def brute_force_whole(q_pos, k_pos, bm: int, bn: int) -> torch.Tensor:
    """[MB, NB] bool: every row of query block i sees every key of key block j."""
    vis = k_pos[None, :] <= q_pos[:, None]
    mb, nb = -(-len(q_pos) // bm), -(-len(k_pos) // bn)
    return torch.stack(
        [torch.stack([vis[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].all() for j in range(nb)]) for i in range(mb)]
    )


@pytest.mark.parametrize("order", ["sorted", "zigzag", "shuffled"])
def test_block_tables_cover_every_visible_block(order):
    """The launcher's loop bounds: every (query block, key block) pair with a visible key lies inside the ranges the
    kernels loop over ([0, n_end) per query block, [m_start, end) per key block), and the blocks the forward / dq run
    without the position mask ([0, n_full)) are seen whole by every row; for sorted positions the ranges are exactly
    the visible blocks and the whole ones."""
    from llmpar.kernels.attention import _block_tables

    g = torch.Generator().manual_seed(5)
    q_pos = {
        "sorted": torch.arange(50, 123),
        "zigzag": torch.tensor(zigzag(96, 3, 1) + [200]),
        "shuffled": torch.randperm(77, generator=g),
    }[order]
    k_pos = {
        "sorted": torch.arange(0, 130),
        "zigzag": torch.tensor(zigzag(96, 3, 2)),
        "shuffled": torch.randperm(77, generator=g) + 10,
    }[order]
    bm, bn = 16, 32
    n_end, n_full, m_start = _block_tables(q_pos, k_pos, len(q_pos), len(k_pos), bm, bn)
    need, whole = brute_force_blocks(q_pos, k_pos, bm, bn), brute_force_whole(q_pos, k_pos, bm, bn)
    mb, nb = need.shape
    in_fwd = torch.arange(nb)[None, :] < n_end[:, None].long()
    unmasked = torch.arange(nb)[None, :] < n_full[:, None].long()
    in_bwd = torch.arange(mb)[:, None] >= m_start[None, :].long()
    assert bool((in_fwd | ~need).all()) and bool((in_bwd | ~need).all())
    assert bool((whole | ~unmasked).all()), "a block run without the position mask has keys some row must not see"
    if order != "shuffled":
        assert torch.equal(in_fwd, need) and torch.equal(in_bwd, need) and torch.equal(unmasked, whole)
        assert 0 < int(need.sum()) < need.numel() and 0 < int(whole.sum())  # some skipped, some masked, some whole
        assert order != "sorted" or int(whole.sum()) < int(need.sum())


@interpreted
@pytest.mark.parametrize(
    "case",
    [
        Case(b=1, hq=2, hkv=1, sq=37, sk=53, d=16, q_pos=list(range(16, 53)), pad="some"),
        Case(b=1, hq=2, hkv=2, sq=20, sk=40, d=16, q_pos=zigzag(40, 2, 1)),
    ],
    ids=str,
)
def test_interp_unmasked_blocks_change_no_bits(case, monkeypatch):
    """The forward / dq run the blocks every row sees whole without the position compare: the results are the same
    bits as with every block of the range masked (n_full = 0)."""
    from test_attention import make

    from llmpar.kernels import attention as kernels

    q, k, v, dout, q_pos, k_pos, valid = make(case, torch.bfloat16)
    kw = dict(scale=0.3, causal=True, q_pos=q_pos, k_pos=k_pos, k_valid=valid)
    split = (*kernels.attention_fwd(q, k, v, **kw),)
    split += kernels.attention_bwd(q, k, v, *split, dout, **kw)
    tables = kernels._block_tables
    assert int(tables(q_pos, torch.arange(case.sk) if k_pos is None else k_pos, case.sq, case.sk, 16, 16)[1].sum())
    monkeypatch.setattr(
        kernels, "_block_tables", lambda *a: (lambda t: (t[0], torch.zeros_like(t[1]), t[2]))(tables(*a))
    )
    masked = (*kernels.attention_fwd(q, k, v, **kw),)
    masked += kernels.attention_bwd(q, k, v, *split[:2], dout, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), split, masked):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------------ on a GPU
gpu = pytest.mark.gpu
_GPU_A = Case(b=1, hq=4, hkv=2, sq=515, sk=515, d=128, pad="some")
_GPU_B = Case(b=2, hq=6, hkv=2, sq=300, sk=300, d=64, q_pos=zigzag(600, 2, 0), k_pos=zigzag(600, 2, 1))
GPU_CASES = [(_GPU_A, torch.bfloat16), (_GPU_B, torch.bfloat16), (_GPU_A, torch.float16), (_GPU_B, torch.float32)]


@gpu
@pytest.mark.parametrize("case, dtype", GPU_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_gpu_kernels_vs_float64(case, dtype):
    """The compiled kernels (real block sizes, tensor cores) against float64; fp32 without TF32 (torch's default).
    Case A: head_dim 128, q / k / v as [B, S, H, D] views, key padding; case B: zigzag blocks, GQA 6:2."""
    check_case(case, dtype, device="cuda", seq_major=case.d == 128, **KERNEL)


@gpu
def test_gpu_split_key_blocks_backward_from_final_lse_bf16():
    # pad "row" pads every key of batch 0: a second batch has real keys (one batch alone would check zeros)
    case = Case(b=2, hq=8, hkv=2, sq=256, sk=512, d=64, q_pos=zigzag(512, 2, 1), pad="row")
    check_split_keys(case, torch.bfloat16, cut=200, device="cuda", **KERNEL)
