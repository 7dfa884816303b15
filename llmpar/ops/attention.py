"""Attention on blocks of keys, returning the per-row log-sum-exp, so partial results over key blocks merge exactly.

Shapes (SDPA's layout): q: [B, Hq, Sq, D], k / v: [B, Hkv, Sk, D] with Hq % Hkv == 0 (grouped-query attention: query
head h reads key/value head h // (Hq / Hkv)). Masking is by global token index, not by the block's own index, so a
block of a sharded sequence (a ring step, a zigzag chunk) masks as the whole sequence would:

    visible[b, i, j] = (not causal or k_pos[j] <= q_pos[i]) and (k_valid is None or k_valid[b, j])
    s = scale * q @ k^T  (masked to -inf where not visible),   lse = logsumexp_j s,   out = softmax_j(s) @ v

q_pos: [Sq], k_pos: [Sk] integer global indices (default arange). k_valid: [B, Sk] bool (False = padding key).
A row with no visible key has out = 0 and lse = -inf (never NaN). lse is float32 (float64 for float64 inputs).

Merging two partial results (o1, lse1), (o2, lse2) over disjoint key sets: lse = logaddexp(lse1, lse2),
o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2 (:func:`merge_partials`).

Backward on a key block given the *final* out and lse (of all key blocks): with p = exp(s - lse) (0 where masked) and
delta = rowsum(dout * out): dv = p^T dout, ds = p (dout v^T - delta), dq = scale ds k, dk = scale ds^T q; for GQA, dk
and dv sum over the query heads of a group. Summing dq over key blocks and taking each block's dk / dv gives the
full-sequence gradients (the ring's backward).

Backends (``_dispatch.select_backend``; ``LLMPAR_BACKEND=triton|torch`` forces one): Triton
(``llmpar.kernels.attention``: flash attention, O(S) memory) on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1``,
for q, k, v of one dtype among fp32 / bf16 / fp16 and head_dim <= 128 (fp32 uses TF32 only where torch's matmul
setting allows it); else torch (this file: fp32 math, queries processed in chunks of ``Q_CHUNK`` rows so the score
matrix held at once is [B, Hq, Q_CHUNK, Sk]). There is no CUDA-extension kernel: forcing ``cuda`` raises.
"""

from __future__ import annotations

import math

import torch

from llmpar.ops._dispatch import select_backend, tf32_allowed

Q_CHUNK = 1024
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_KERNEL_HEAD_DIM = 128


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos, k_pos, k_valid) -> tuple[int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; attention takes floating-point tensors")
    B, Hq, Sq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of key/value heads {Hkv}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; q, k, v must share a device")
    for name, pos, n in (("q_pos", q_pos, Sq), ("k_pos", k_pos, k.shape[2])):
        if pos is None:
            continue
        if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
            raise TypeError(
                f"{name} must be an integer tensor of global token indices, got "
                f"{getattr(pos, 'dtype', type(pos).__name__)}"
            )
        if pos.dim() != 1 or pos.numel() != n:
            raise ValueError(
                f"{name} must be 1-D of length {'Sq' if name == 'q_pos' else 'Sk'}={n}, got shape {tuple(pos.shape)}"
            )
        if pos.device != q.device:
            raise ValueError(f"{name} is on {pos.device} but q is on {q.device}")
    if k_valid is not None:
        if (
            not isinstance(k_valid, torch.Tensor)
            or k_valid.dtype != torch.bool
            or tuple(k_valid.shape) != (B, k.shape[2])
        ):
            raise ValueError(
                f"k_valid must be a bool tensor of shape {(B, k.shape[2])}, got "
                f"{getattr(k_valid, 'dtype', type(k_valid).__name__)} "
                f"{tuple(getattr(k_valid, 'shape', ()))}"
            )
        if k_valid.device != q.device:
            raise ValueError(f"k_valid is on {k_valid.device} but q is on {q.device}")
    return Hq // Hkv, D


def _scale(scale, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (default 1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _visible(q_pos, k_pos, k_valid, causal: bool, rows: slice, Sq: int, Sk: int, device) -> torch.Tensor | None:
    """[B or 1, 1, rows, Sk] bool, or None when everything is visible."""
    mask = None
    if causal:
        qp = (q_pos if q_pos is not None else torch.arange(Sq, device=device))[rows]
        kp = k_pos if k_pos is not None else torch.arange(Sk, device=device)
        mask = (kp[None, :] <= qp[:, None])[None, None]
    if k_valid is not None:
        kv = k_valid[:, None, None, :]
        mask = kv if mask is None else mask & kv
    return mask


def _grouped(x: torch.Tensor, hkv: int, acc: torch.dtype) -> torch.Tensor:
    """[B, Hq, r, D] -> [B, Hkv, g r, D] in ``acc``: the rows of a GQA group stacked, so one matmul against the group's
    key/value head serves them all (no repeated k / v) and products with them sum over the group."""
    B, Hq, r, D = x.shape
    return x.to(acc).reshape(B, hkv, (Hq // hkv) * r, D)


def _hidden(q_pos, k_pos, k_valid, causal, rows, Sq, Sk, device) -> torch.Tensor | None:
    """~visible as [B or 1, 1, 1, r, Sk] (broadcasts over [B, Hkv, g, r, Sk]), or None."""
    mask = _visible(q_pos, k_pos, k_valid, causal, rows, Sq, Sk, device)
    return None if mask is None else ~mask[:, :, None]


def _torch_fwd(q, k, v, scale, causal, q_pos, k_pos, k_valid):
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g, acc = Hq // Hkv, _acc_dtype(q)
    kt, vv = k.to(acc).transpose(-1, -2), v.to(acc)
    out = torch.zeros(B, Hq, Sq, D, dtype=acc, device=q.device)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=acc, device=q.device)
    for r0 in range(0, Sq if Sk else 0, Q_CHUNK):  # no keys: every row is empty
        rows = slice(r0, min(Sq, r0 + Q_CHUNK))
        r = rows.stop - r0
        s = (_grouped(q[:, :, rows], Hkv, acc) * scale) @ kt  # [B, Hkv, g r, Sk]
        hidden = _hidden(q_pos, k_pos, k_valid, causal, rows, Sq, Sk, q.device)
        if hidden is not None:
            s.view(B, Hkv, g, r, Sk).masked_fill_(hidden, -math.inf)
        m = s.amax(-1, keepdim=True)
        m.masked_fill_(m == -math.inf, 0.0)  # empty rows: exp(-inf - 0) = 0, no NaN
        p = s.sub_(m).exp_()
        l_sum = p.sum(-1, keepdim=True)
        o = (p @ vv).div_(l_sum.clamp_min(torch.finfo(acc).tiny))  # empty rows: 0 / tiny = 0
        out[:, :, rows] = o.view(B, Hq, r, D)
        lse[:, :, rows] = (m + l_sum.log()).view(B, Hq, r)  # log 0 = -inf for empty rows
    return out.to(q.dtype), lse


def _torch_bwd(q, k, v, out, lse, dout, scale, causal, q_pos, k_pos, k_valid):
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g, acc = Hq // Hkv, _acc_dtype(q)
    kk, vt = k.to(acc), v.to(acc).transpose(-1, -2)
    dq = torch.empty(B, Hq, Sq, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, Hkv, Sk, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, Sk, D, dtype=acc, device=q.device)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [B, Hq, Sq]
    for r0 in range(0, Sq, Q_CHUNK):
        rows = slice(r0, min(Sq, r0 + Q_CHUNK))
        r = rows.stop - r0
        qr, dor = _grouped(q[:, :, rows], Hkv, acc), _grouped(dout[:, :, rows], Hkv, acc)
        s = (qr * scale) @ kk.transpose(-1, -2)  # [B, Hkv, g r, Sk]
        hidden = _hidden(q_pos, k_pos, k_valid, causal, rows, Sq, Sk, q.device)
        if hidden is not None:
            s.view(B, Hkv, g, r, Sk).masked_fill_(hidden, -math.inf)
        lr = lse[:, :, rows].to(acc).reshape(B, Hkv, g * r, 1)
        p = s.sub_(lr.masked_fill(lr == -math.inf, math.inf)).exp_()  # empty rows (lse -inf): exp(-inf) = 0
        dv += p.transpose(-1, -2) @ dor  # sums over the group's rows
        ds = (dor @ vt).sub_(delta[:, :, rows].reshape(B, Hkv, g * r, 1)).mul_(p)
        dq[:, :, rows] = ((ds @ kk) * scale).view(B, Hq, r, D)
        dk += (ds.transpose(-1, -2) @ qr) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _kernel_unfit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take these inputs (the torch path then runs), or None."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} (the kernels take {', '.join(map(str, KERNEL_DTYPES))})"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if q.shape[-1] > MAX_KERNEL_HEAD_DIM:
        return f"head_dim {q.shape[-1]} > {MAX_KERNEL_HEAD_DIM}"
    return None


def _backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str) -> str:
    """ "triton" or "torch" (LLMPAR_BACKEND may force either; there is no CUDA-extension kernel for attention)."""
    return select_backend(
        q.device,
        kernel_unfit=_kernel_unfit(q, k, v),
        op=op,
        cuda_unfit="attention has no CUDA-extension kernel (Triton or torch run it)",
    )


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    k_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] float32/float64)`` of q over this key block."""
    _, D = _check(q, k, v, q_pos, k_pos, k_valid)
    scale = _scale(scale, D)
    if _backend(q, k, v, "attention_fwd") == "triton":
        from llmpar.kernels import attention as kernel

        return kernel.attention_fwd(
            q, k, v, scale=scale, causal=causal, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid, allow_tf32=tf32_allowed()
        )
    return _torch_fwd(q, k, v, scale, causal, q_pos, k_pos, k_valid)


def attention_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    k_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this key block given the final ``out`` / ``lse`` over all key blocks (see module doc)."""
    _, D = _check(q, k, v, q_pos, k_pos, k_valid)
    for name, t in (("out", out), ("lse", lse), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"out/dout must have q's shape {tuple(q.shape)} and lse {tuple(q.shape[:3])}, got "
            f"{tuple(out.shape)}, {tuple(dout.shape)}, {tuple(lse.shape)}"
        )
    scale = _scale(scale, D)
    if _backend(q, k, v, "attention_bwd") == "triton":
        from llmpar.kernels import attention as kernel

        return kernel.attention_bwd(
            q,
            k,
            v,
            out,
            lse,
            dout,
            scale=scale,
            causal=causal,
            q_pos=q_pos,
            k_pos=k_pos,
            k_valid=k_valid,
            allow_tf32=tf32_allowed(),
        )
    return _torch_bwd(q, k, v, out, lse, dout, scale, causal, q_pos, k_pos, k_valid)


def merge_partials(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets: ``lse = logaddexp(lse1, lse2)``, outputs weighted by
    ``exp(lse_i - lse)`` (rows empty in both stay 0 / -inf). Returns (out in out1's dtype, lse)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    w1 = torch.exp(lse1 - safe)[..., None]
    w2 = torch.exp(lse2 - safe)[..., None]
    acc = lse.dtype
    return (w1 * out1.to(acc) + w2 * out2.to(acc)).to(out1.dtype), lse


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, q_pos, k_pos, k_valid):
        out, lse = attention_fwd(q, k, v, scale=scale, causal=causal, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, k_valid)
        ctx.scale, ctx.causal = scale, causal
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_pos, k_pos, k_valid = ctx.saved_tensors
        dq, dk, dv = attention_bwd(
            q,
            k,
            v,
            out,
            lse,
            dout.contiguous(),
            scale=ctx.scale,
            causal=ctx.causal,
            q_pos=q_pos,
            k_pos=k_pos,
            k_valid=k_valid,
        )
        return dq, dk, dv, None, None, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    k_valid: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Differentiable attention (out, and lse when ``return_lse``; lse carries no gradient)."""
    out, lse = _FlashAttention.apply(q, k, v, scale, causal, q_pos, k_pos, k_valid)
    return (out, lse) if return_lse else out
