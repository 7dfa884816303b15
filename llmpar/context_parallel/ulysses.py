"""Ulysses: trade heads for sequence with an all-to-all, attend over the group's whole token set, trade back.

Each of the u ranks of a Ulysses group holds all heads of its S tokens: ``x: [B, H, S, D]``. :func:`seq_to_heads`
sends head chunk j (heads ``[j * H/u, (j + 1) * H/u)``) to group rank j, which then holds those heads for the
group's u * S tokens in rank order: ``[B, H/u, u * S, D]``. :func:`heads_to_seq` is its inverse. Each is the other's
backward (autograd Functions), so a gradient takes the reverse all-to-all. Under torch.compile the all-to-all and the
mask's all-gather are functional collectives (:mod:`llmpar.distributed.funcol`; ``ctx`` keeps the GroupRef, which
holds a group name only) and the whole exchange traces into the graph.

Grouped-query attention (Hkv key / value heads, Hq % Hkv == 0): query head h reads kv head ``h // (Hq / Hkv)``. If
u does not divide Hkv, the kv heads are first repeated ``f = lcm(Hkv, u) / Hkv`` times each (``repeat_interleave``,
whose gradient sums the copies back): the lcm divides Hq, and query head h still reads a copy of kv head
``h // (Hq / Hkv)``, so each rank's Hq / u query heads find their kv heads among its ``lcm / u``. Hq must be a
multiple of u.
"""

from __future__ import annotations

import math

import torch

from llmpar.distributed import funcol
from llmpar.distributed.collectives import all_gather_flat
from llmpar.distributed.exchange import all_to_all_single
from llmpar.distributed.groups import GroupRef, as_group


def _all_to_all(send: torch.Tensor, group: GroupRef, what: str) -> torch.Tensor:
    """Chunk j of ``send`` ([u, ...]) to group rank j; chunk j of the result from it."""
    if torch.compiler.is_compiling():  # a functional all-to-all in the graph (the group by name)
        return funcol.all_to_all_dim0(send, funcol.group_key(group))
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group, what=what)
    return recv


def _seq_to_heads(x: torch.Tensor, group: GroupRef, u: int) -> torch.Tensor:
    B, H, S, D = x.shape
    send = x.reshape(B, u, H // u, S, D).transpose(0, 1).contiguous()  # [dst, B, H/u, S, D]
    recv = _all_to_all(send, group, f"Ulysses all-to-all (sequence -> heads) of {tuple(x.shape)}")
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // u, u * S, D)  # [B, H/u, (src, S), D]


def _heads_to_seq(y: torch.Tensor, group: GroupRef, u: int) -> torch.Tensor:
    B, Hl, US, D = y.shape
    send = y.reshape(B, Hl, u, US // u, D).permute(2, 0, 1, 3, 4).contiguous()  # [dst, B, H/u, S, D]
    recv = _all_to_all(send, group, f"Ulysses all-to-all (heads -> sequence) of {tuple(y.shape)}")
    return recv.transpose(0, 1).reshape(B, u * Hl, US // u, D)  # [B, (src, H/u), S, D]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, u):
        ctx.group, ctx.u = group, u
        return _seq_to_heads(x, group, u)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.u), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, u):
        ctx.group, ctx.u = group, u
        return _heads_to_seq(y, group, u)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.u), None, None


def seq_to_heads(x: torch.Tensor, group: GroupRef, u: int) -> torch.Tensor:
    """``[B, H, S, D]`` (all heads, this rank's S tokens) -> ``[B, H/u, u * S, D]`` (this rank's head chunk, the
    group's tokens in rank order). Differentiable; the identity for u = 1."""
    return x if u == 1 else _SeqToHeads.apply(x, group, u)


def heads_to_seq(y: torch.Tensor, group: GroupRef, u: int) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[B, H/u, u * S, D]`` -> ``[B, H, S, D]``. Differentiable."""
    return y if u == 1 else _HeadsToSeq.apply(y, group, u)


def kv_repeats(heads: int, kv_heads: int, u: int) -> int:
    """How many times each kv head is repeated so that u divides the kv head count (1 if it already does)."""
    if heads % u:
        raise ValueError(
            f"query heads {heads} (kv heads {kv_heads}) are not divisible by the Ulysses size u={u}: "
            f"Ulysses gives each of its u ranks heads/u whole heads; use a Ulysses size that divides "
            f"{heads} (ring or hybrid mode can take the rest of the sequence parallelism)"
        )
    return math.lcm(kv_heads, u) // kv_heads


def gather_valid(valid: torch.Tensor, group: GroupRef, u: int) -> torch.Tensor:
    """This rank's key mask ``[B, S]`` (uint8) -> the group's ``[B, u * S]`` in rank order (no gradient)."""
    if u == 1:
        return valid
    B, S = valid.shape
    if torch.compiler.is_compiling():
        gathered = funcol.all_gather_dim0(valid.unsqueeze(0), funcol.group_key(group))  # [u, B, S]
        return gathered.transpose(0, 1).reshape(B, u * S)
    everyone = torch.empty(u * B * S, dtype=valid.dtype, device=valid.device)
    all_gather_flat(
        everyone,
        valid.contiguous().view(-1),
        as_group(group),
        what=f"Ulysses all-gather of the key mask {tuple(valid.shape)}",
    )
    return everyone.view(u, B, S).transpose(0, 1).reshape(B, u * S)


__all__ = ["gather_valid", "heads_to_seq", "kv_repeats", "seq_to_heads"]
