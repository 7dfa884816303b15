"""Ring attention as two ``torch.library`` ops, so that torch.compile holds it as graph nodes.

The ring's exchange is point to point (each rank sends its k / v block to the next, posted before the block is
computed) and picks its work on the host (the visible part of a block is bisected on the CPU copy of the positions):
neither has a functional-collective form. Under ``torch.compiler.is_compiling()`` ``ContextParallel.attention``
therefore calls :func:`ring_attention_traced`: ``llmpar::ring_attention_fwd`` / ``llmpar::ring_attention_bwd``,
opaque ops with fake implementations (shapes only) whose autograd is registered here; at run time they run the eager
ring of :mod:`.ring` unchanged. The group travels as its registered name (a ``str`` argument: no ProcessGroup in the
graph or in ``ctx``). Per-step timings
(``RingStats``) are not recorded in a compiled graph.

    llmpar::ring_attention_fwd(q [B, Hq, S, D], k, v [B, Hkv, S, D], valid [B, S] uint8?, positions [R, u*S] int64,
                               group, seq_len, causal, scale) -> (out [B, Hq, S, D], lse [B, Hq, S] fp32 / fp64)
    llmpar::ring_attention_bwd(dout, q, k, v, valid?, out, lse, positions, group, seq_len, causal, scale)
                               -> (dq, dk, dv)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmpar.context_parallel.ring import RingSpec, RingStats, ring_backward, ring_forward
from llmpar.distributed.groups import GroupRef


def _spec(positions: torch.Tensor, group: str, seq_len: int, causal: bool, scale: float) -> RingSpec:
    pg = dist.distributed_c10d._resolve_process_group(group)
    return RingSpec(
        group=GroupRef(pg), positions=positions.cpu(), seq_len=seq_len, causal=causal, scale=scale, stats=RingStats()
    )


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("llmpar::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.Tensor,
    group: str,
    seq_len: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = ring_forward(q, k, v, valid, _spec(positions, group, seq_len, causal, scale))
    return out, lse.to(_acc(q.dtype))  # the accumulators: fresh tensors, no view of an input


@ring_attention_fwd.register_fake
def _fwd_fake(q, k, v, valid, positions, group, seq_len, causal, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_acc(q.dtype))


@torch.library.custom_op("llmpar::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    positions: torch.Tensor,
    group: str,
    seq_len: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = _spec(positions, group, seq_len, causal, scale)
    grads = ring_backward(dout.contiguous(), q, k, v, valid, out, lse, spec)
    # dk and dv may be views of one [2, ...] accumulator: an op's outputs must not alias each other
    return tuple(g.clone() if g._base is not None else g for g in grads)  # type: ignore[return-value]


@ring_attention_bwd.register_fake
def _bwd_fake(dout, q, k, v, valid, out, lse, positions, group, seq_len, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, valid, positions, group, seq_len, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, positions, *(() if valid is None else (valid,)))
    ctx.args = (group, seq_len, causal, scale)
    ctx.has_valid = valid is not None


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, positions, *rest = ctx.saved_tensors
    valid = rest[0] if ctx.has_valid else None
    dq, dk, dv = ring_attention_bwd(dout, q, k, v, valid, out, lse, positions, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def ring_attention_traced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, spec: RingSpec
) -> torch.Tensor:
    """:func:`.ring.ring_attention` through the ops above (what torch.compile traces)."""
    name = spec.group.name
    if name is None:  # a torch without group names: the group itself is all there is
        name = spec.group.get().group_name
    out, _ = ring_attention_fwd(q, k, v, valid, spec.positions, name, spec.seq_len, spec.causal, spec.scale)
    return out
