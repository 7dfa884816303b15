"""Ring attention: every rank keeps its queries and passes its key / value block around the ring.

With R ranks, at step i rank r holds the k / v block of rank ``(r - i) mod R``: it posts the send of that block to
rank r+1 and the receive of the next one from rank r-1 *before* computing attention on the current block, so the
transfer overlaps the compute. Each step gives a partial ``(out, lse)`` over one key block, merged with the
log-sum-exp rule (:func:`llmpar.ops.attention.merge_partials`) in float32 (float64 for float64 inputs).

Causality is by global token index. Every rank's positions are ascending (see :mod:`.shard`), so the visible part of
a block is a suffix of the query rows times a prefix of the keys (found by bisection): a block that no query sees
is skipped, and with the zigzag split every off-diagonal block costs half of a full one.

Backward runs the same ring: dq accumulates locally; the (dk, dv) accumulator of a block travels with it, each rank
adding its contribution (``attention_bwd`` given the *final* out / lse), and after R steps one more hop brings it
home (in float32 for half-precision inputs, float64 for float64). Key padding (``k_valid``, the user's mask) travels
with its block; padding added to reach ``padded_len``
(positions >= seq_len) is masked from the positions, which every rank knows.

:class:`RingStats` records, per step, the host seconds spent computing and waiting on the exchange.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llmpar.distributed.exchange import exchange
from llmpar.distributed.groups import GroupRef
from llmpar.ops.attention import attention_bwd, attention_fwd, merge_partials


@dataclass
class RingStats:
    """Per ring step, host seconds computing and waiting on communication (forward and backward), accumulated over
    calls until :meth:`reset`. On CUDA, times are meaningful only with ``sync=True`` (the device is synchronised at
    each measurement, which itself costs some overlap)."""

    sync: bool = False
    forward_compute_s: list[float] = field(default_factory=list)
    forward_wait_s: list[float] = field(default_factory=list)
    backward_compute_s: list[float] = field(default_factory=list)
    backward_wait_s: list[float] = field(default_factory=list)

    def reset(self) -> None:
        for values in (self.forward_compute_s, self.forward_wait_s, self.backward_compute_s, self.backward_wait_s):
            values.clear()

    def exposed_fraction(self) -> float:
        """Seconds waited on communication / (waited + computed), forward and backward together (0 when empty)."""
        wait = sum(self.forward_wait_s) + sum(self.backward_wait_s)
        total = wait + sum(self.forward_compute_s) + sum(self.backward_compute_s)
        return wait / total if total > 0 else 0.0


@dataclass(frozen=True)
class RingSpec:
    """What a ring attention call needs besides tensors. ``positions`` [R, S] int64 (CPU): ring rank s's global
    token indices (ascending), bisected on the host; ``device_positions``: the same on the tensors' device (None:
    copied at each call); ``seq_len``: indices >= it are padding."""

    group: GroupRef
    positions: torch.Tensor
    seq_len: int
    causal: bool
    scale: float
    stats: RingStats
    device_positions: torch.Tensor | None = None

    def on(self, device: torch.device) -> torch.Tensor:
        """``positions`` on ``device``."""
        dp = self.device_positions
        return dp if dp is not None and dp.device == device else self.positions.to(device)


def _clock(device: torch.device, stats: RingStats) -> float:
    if stats.sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> tuple[slice, slice]:
    """Rows of q and columns of k that can see / be seen under causality (both ascending)."""
    if not causal:
        return slice(0, q_pos.numel()), slice(0, k_pos.numel())
    q0 = int(torch.searchsorted(q_pos, k_pos[:1]).item())
    k1 = int(torch.searchsorted(k_pos, q_pos[-1:], right=True).item())
    return slice(q0, q_pos.numel()), slice(0, k1)


def _part(x: torch.Tensor, span: slice) -> torch.Tensor:
    """``x[:, :, span]`` as a contiguous tensor (the kernels take contiguous blocks; a full span is not copied)."""
    return x[:, :, span].contiguous()


def _key_mask(
    valid: torch.Tensor | None, k_pos: torch.Tensor, seq_len: int, batch: int, padded: bool
) -> torch.Tensor | None:
    """[B, Sk] bool of the keys that are real and not masked by the user's ``valid`` (uint8), or None if all are
    (``padded``: whether any of ``k_pos`` is >= seq_len, decided on the CPU copy so no device sync is needed)."""
    if valid is None and not padded:
        return None
    mask = (k_pos < seq_len)[None].expand(batch, -1)
    return mask if valid is None else mask & valid.bool()


def _ring(spec: RingSpec) -> tuple[dist.ProcessGroup, int, int]:
    pg = spec.group.get()
    return pg, dist.get_world_size(pg), dist.get_rank(pg)


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, spec: RingSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D] in q's dtype, lse [B, Hq, S])`` of this rank's queries over every rank's keys."""
    pg, R, r = _ring(spec)
    B, Hq, S, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, Hq, S, D, dtype=acc, device=q.device)
    lse = torch.full((B, Hq, S), -float("inf"), dtype=acc, device=q.device)
    pos = spec.on(q.device)
    block, bvalid = torch.stack([k, v]).contiguous(), valid
    for step in range(R):
        src = (r - step) % R
        t0 = _clock(q.device, spec.stats)
        handle = None
        if step + 1 < R:  # the next block travels while this one is computed
            nblock = torch.empty_like(block)
            nvalid = None if bvalid is None else torch.empty_like(bvalid)
            sends = [(block, (r + 1) % R)] + ([] if bvalid is None else [(bvalid, (r + 1) % R)])
            recvs = [(nblock, (r - 1) % R)] + ([] if nvalid is None else [(nvalid, (r - 1) % R)])
            handle = exchange(sends, recvs, pg, what=f"ring attention forward step {step} (k/v block of rank {src})")
        rows, cols = _visible(spec.positions[r], spec.positions[src], spec.causal)
        if rows.start < rows.stop and cols.start < cols.stop:
            mask = _key_mask(
                None if bvalid is None else bvalid[:, cols],
                pos[src, cols],
                spec.seq_len,
                B,
                bool(spec.positions[src, cols.stop - 1] >= spec.seq_len),
            )
            o, o_lse = attention_fwd(
                _part(q, rows),
                _part(block[0], cols),
                _part(block[1], cols),
                scale=spec.scale,
                causal=spec.causal,
                q_pos=pos[r, rows],
                k_pos=pos[src, cols],
                k_valid=mask,
            )
            out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows], o, o_lse)
        t1 = _clock(q.device, spec.stats)
        if handle is not None:
            handle.wait()
            block, bvalid = nblock, nvalid
        spec.stats.forward_compute_s.append(t1 - t0)
        spec.stats.forward_wait_s.append(_clock(q.device, spec.stats) - t1)
    return out.to(q.dtype), lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: RingSpec,
) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` of this rank's q / k / v, by the ring (see the module docstring)."""
    pg, R, r = _ring(spec)
    B = q.shape[0]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=acc, device=q.device)  # accumulator of the block held now
    pos = spec.on(q.device)
    block, bvalid = torch.stack([k, v]).contiguous(), valid
    acc_handle = nacc = None
    for step in range(R):
        src = (r - step) % R
        t0 = _clock(q.device, spec.stats)
        kv_handle = None
        if step + 1 < R:
            nblock = torch.empty_like(block)
            nvalid = None if bvalid is None else torch.empty_like(bvalid)
            sends = [(block, (r + 1) % R)] + ([] if bvalid is None else [(bvalid, (r + 1) % R)])
            recvs = [(nblock, (r - 1) % R)] + ([] if nvalid is None else [(nvalid, (r - 1) % R)])
            kv_handle = exchange(sends, recvs, pg, what=f"ring attention backward step {step} (k/v of rank {src})")
        rows, cols = _visible(spec.positions[r], spec.positions[src], spec.causal)
        part = None
        if rows.start < rows.stop and cols.start < cols.stop:
            mask = _key_mask(
                None if bvalid is None else bvalid[:, cols],
                pos[src, cols],
                spec.seq_len,
                B,
                bool(spec.positions[src, cols.stop - 1] >= spec.seq_len),
            )
            dq_c, dk_c, dv_c = attention_bwd(
                _part(q, rows),
                _part(block[0], cols),
                _part(block[1], cols),
                _part(out, rows),
                lse[:, :, rows].contiguous(),
                _part(dout, rows),
                scale=spec.scale,
                causal=spec.causal,
                q_pos=pos[r, rows],
                k_pos=pos[src, cols],
                k_valid=mask,
            )
            dq[:, :, rows] += dq_c
            part = (dk_c, dv_c)
        t1 = _clock(q.device, spec.stats)
        if acc_handle is not None:  # the accumulator of this block, from the rank that held it one step ago
            acc_handle.wait()
            dkv = nacc
        t2 = _clock(q.device, spec.stats)
        if part is not None:
            dkv[0][:, :, cols] += part[0]
            dkv[1][:, :, cols] += part[1]
        if R > 1:
            nacc = torch.empty_like(dkv)
            acc_handle = exchange(
                [(dkv, (r + 1) % R)],
                [(nacc, (r - 1) % R)],
                pg,
                what=f"ring attention backward step {step} (dk/dv of rank {src})",
            )
        t3 = _clock(q.device, spec.stats)
        if kv_handle is not None:
            kv_handle.wait()
            block, bvalid = nblock, nvalid
        spec.stats.backward_compute_s.append((t1 - t0) + (t3 - t2))
        spec.stats.backward_wait_s.append((t2 - t1) + (_clock(q.device, spec.stats) - t3))
    if acc_handle is not None:  # the last hop brings this rank's own block's accumulator home
        t0 = _clock(q.device, spec.stats)
        acc_handle.wait()
        dkv = nacc
        spec.stats.backward_wait_s.append(_clock(q.device, spec.stats) - t0)
        spec.stats.backward_compute_s.append(0.0)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, valid, spec):
        out, lse = ring_forward(q, k, v, valid, spec)
        ctx.save_for_backward(q, k, v, out, lse, *(() if valid is None else (valid,)))
        ctx.spec, ctx.has_valid = spec, valid is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        valid = rest[0] if ctx.has_valid else None
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, valid, out, lse, ctx.spec)
        return dq, dk, dv, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, spec: RingSpec
) -> torch.Tensor:
    """Differentiable ring attention of this rank's ``q`` [B, Hq, S, D] over every ring rank's ``k`` / ``v``
    [B, Hkv, S, D]; ``valid``: this rank's key mask [B, S] as uint8 (1 = a key that may be seen), or None."""
    return _RingAttention.apply(q, k, v, valid, spec)


__all__ = ["RingSpec", "RingStats", "ring_attention", "ring_backward", "ring_forward"]
