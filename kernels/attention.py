"""Triton flash attention: forward (online softmax over key blocks, writes out and the row log-sum-exp) and backward.

Math and layout: llmpar/ops/attention.py (q: [B, Hq, Sq, D], k / v: [B, Hkv, Sk, D], any strides; Hq % Hkv == 0;
masks by global index q_pos / k_pos and key padding k_valid [B, Sk]; empty rows give out 0 and lse -inf).
Scores use exp2 with log2(e) folded into the scale; every product accumulates in fp32; the probabilities are rounded
to v's dtype before the P @ V product (as FlashAttention does: 16-bit tensor cores); fp32 inputs use IEEE fp32 products
unless ``allow_tf32``. head_dim is padded to a power of two >= 16 (masked loads), at most 128.

Kernels (grid: one program per (batch x head, row block); batch x head on axis 0, which takes 2^31 - 1 programs where
axes 1 / 2 stop at 65535), launched from here (``attention_fwd`` / ``attention_bwd``), each in its module:
    _fwd_kernel:   per query block, loop over key blocks: m, l, acc (online softmax) -> out, lse    attention_fwd.py
    _delta_kernel: delta = rowsum(dout * out) in fp32 (the backward's preprocess)                    attention_dq.py
    _dq_kernel:    per query block, loop over key blocks: dq = scale * sum_j ds k                    attention_dq.py
    _dkdv_kernel:  per key block of one key/value head, loop over the query heads of its group and   attention_dkdv.py
                   the query blocks: dv = sum p^T dout, dk = scale * sum ds^T q
(the product and visibility helpers all three use: attention_parts.py; tiles and causal bounds: attention_tiles.py)
Two backward kernels that each recompute p (FlashAttention-2's split), not one with fp32 atomics for dq: no fp32 dq
scratch, deterministic sums, GQA's dk / dv summed in one program. out / lse are taken as given: the final ones over
all key blocks (a ring step's backward), not this block's own.

Causal blocks: loop bounds, no per-block test (kernels/attention_tiles.py computes them from the positions on the
device, no host sync). The forward and dq loops are FlashAttention-2's split: per query block, the leading n_full key
blocks every row sees whole run without the position compare, then [n_full, n_end) (the diagonal) with it; dk / dv
loops over the query blocks [m_start, end) with the compare (one loop: a second body pushed sm_90's dkdv over 255
registers). The same blocks in the same order as one masked loop, so the sums are the same bits. No branch around
the K / V loads, so Triton pipelines every loop (num_stages buffers in shared memory, as in the non-causal kernels).
With sorted positions (contiguous, zigzag, ring) the ranges are exactly the blocks a diagonal touches; unsorted
positions stay correct (a masked block in range that no row sees adds exact zeros).
Under TRITON_INTERPRET=1 (CPU) 16 x 16 blocks run and dot operands are widened to fp32 (the interpreter's dot
mishandles 16-bit; the rounding of p to v's dtype is kept).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton  # noqa: F401
from .attention_tiles import INTERPRET_CONFIG, POS_MAX, POS_MIN, _block_tables, config, row_blocks  # noqa: F401

MAX_HEAD_DIM = 128
LOG2E = 1.4426950408889634

if HAS_TRITON:
    from .attention_dkdv import _dkdv_kernel
    from .attention_dq import _delta_kernel, _dq_kernel
    from .attention_fwd import _fwd_kernel


def _arch(device) -> int:
    """sm version of a CUDA ``device`` (80, 90, ...), 0 elsewhere (the interpreter's config then)."""
    return 0 if device.type != "cuda" else int("%d%d" % torch.cuda.get_device_capability(device))


def _common(q, k, v, causal, q_pos, k_pos, k_valid, allow_tf32):
    """Flags, positions and the key-padding view shared by the forward and backward launches."""
    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    (B, H, Sq, D), Sk = q.shape, k.shape[2]
    block_d = max(16, triton.next_power_of_2(D))
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} > {MAX_HEAD_DIM}: the Triton attention kernels hold a row in registers")
    qp, kp = (
        None
        if not causal
        else torch.arange(n, dtype=torch.int32, device=q.device)
        if p is None
        else p.to(device=q.device, dtype=torch.int32).contiguous()
        for p, n in ((q_pos, Sq), (k_pos, Sk))
    )
    valid = k_valid.view(torch.uint8) if k_valid is not None else None
    flags = dict(
        CAUSAL=bool(causal),
        HAS_VALID=k_valid is not None,
        IEEE=q.element_size() == 4 and not allow_tf32,
        INTERPRETER=INTERPRETED,
    )
    return B, H, Sq, Sk, D, block_d, qp, kp, valid, flags


def attention_fwd(
    q, k, v, *, scale: float, causal: bool = True, q_pos=None, k_pos=None, k_valid=None, allow_tf32: bool = False
):
    """(out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] fp32). q, k, v share one dtype (fp32 / bf16 / fp16) and a
    CUDA device (or CPU under the interpreter); checks are the caller's (llmpar/ops/attention.py)."""
    B, H, Sq, Sk, D, block_d, qp, kp, valid, flags = _common(q, k, v, causal, q_pos, k_pos, k_valid, allow_tf32)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or Sk == 0:
        return out, lse
    cfg = config("fwd", q.element_size(), block_d, _arch(q.device))
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n_end = n_full = out
    if causal:
        n_end, n_full, _ = _block_tables(qp, kp, Sq, Sk, bm, bn)
    _fwd_kernel[(B * H, row_blocks(Sq, bm, "Sq"))](
        q,
        k,
        v,
        out,
        lse,
        out if qp is None else qp,
        out if kp is None else kp,
        out if valid is None else valid,
        n_end,
        n_full,
        scale * LOG2E,
        Sq,
        Sk,
        H,
        H // k.shape[1],
        D,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *(valid.stride() if valid is not None else (0, 0)),
        **flags,
        BLOCK_D=block_d,
        **cfg,
    )
    return out, lse


def attention_bwd(
    q,
    k,
    v,
    out,
    lse,
    dout,
    *,
    scale: float,
    causal: bool = True,
    q_pos=None,
    k_pos=None,
    k_valid=None,
    allow_tf32: bool = False,
):
    """(dq, dk, dv) of this key block given the final out / lse (fp32 [B, Hq, Sq], -inf for empty rows) over all key
    blocks; in q's / k's / v's dtype. Same conditions as :func:`attention_fwd`; dout shaped like q (any strides)."""
    B, H, Sq, Sk, D, block_d, qp, kp, valid, flags = _common(q, k, v, causal, q_pos, k_pos, k_valid, allow_tf32)
    G = H // k.shape[1]
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0:
        return dq, dk, dv
    q, k, v = (t if t.stride() == d.stride() else t.contiguous() for t, d in ((q, dq), (k, dk), (v, dv)))
    lse = lse.to(torch.float32).contiguous()
    arch = _arch(q.device)
    cfg, cfg_kv = config("dq", q.element_size(), block_d, arch), config("dkdv", q.element_size(), block_d, arch)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid, grid_kv = (B * H, row_blocks(Sq, bm, "Sq")), (B * k.shape[1], row_blocks(Sk, cfg_kv["BLOCK_N"], "Sk"))
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    _delta_kernel[grid](out, dout, delta, Sq, H, D, *out.stride(), *dout.stride(), BLOCK_M=bm, BLOCK_D=block_d)
    pos = (dq if qp is None else qp, dq if kp is None else kp, dq if valid is None else valid)
    sizes = (
        scale * LOG2E,
        float(scale),
        Sq,
        Sk,
        H,
        G,
        D,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *(valid.stride() if valid is not None else (0, 0)),
    )
    n_end = n_full = m_start = dq
    if causal:
        n_end, n_full, _ = _block_tables(qp, kp, Sq, Sk, bm, bn)
        m_start = _block_tables(qp, kp, Sq, Sk, cfg_kv["BLOCK_M"], cfg_kv["BLOCK_N"])[2]
    _dq_kernel[grid](q, k, v, dout, dq, lse, delta, *pos, n_end, n_full, *sizes, **flags, BLOCK_D=block_d, **cfg)
    _dkdv_kernel[grid_kv](q, k, v, dout, dk, dv, lse, delta, *pos, m_start, *sizes, **flags, BLOCK_D=block_d, **cfg_kv)
    return dq, dk, dv
