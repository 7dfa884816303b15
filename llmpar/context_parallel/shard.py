"""Which tokens of a sequence each context-parallel rank holds.

A sequence of ``seq_len`` tokens is padded to ``padded_len`` so every rank holds the same count ``S_local =
padded_len / sp``; padding tokens have global index ``>= seq_len`` (they come last, so a causal real token never
sees one). Ranks are numbered ``cp_rank = ring_rank * ulysses_size + ulysses_rank`` (Ulysses inner).

* ulysses (sp = u): contiguous; ``padded_len`` a multiple of u; rank j holds ``[j * S_local, (j + 1) * S_local)``.
* ring (sp = R): zigzag (head-tail): the padded sequence is cut into 2R equal chunks and ring rank r holds chunks r
  and 2R-1-r, so every rank does the same causal work; ``padded_len`` a multiple of 2R.
* hybrid (sp = R * u): ring rank r's Ulysses group holds chunks r and 2R-1-r of 2R (zigzag across the ring), split
  contiguously among its u ranks; ``padded_len`` a multiple of 2 * sp.

Every rank's index is sorted ascending, and so is the concatenation of a Ulysses group's indices in rank order (the
token set its all-to-all gathers): attention uses this to find the causally visible part of a block by bisection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("ulysses", "ring", "hybrid")


@dataclass(frozen=True, kw_only=True)
class SeqShard:
    """This rank's part of a sequence: ``index`` [S_local] int64, the global token indices it holds (ascending,
    values >= ``seq_len`` are padding); ``padded_len``: the padded sequence length (sp * S_local); ``seq_len``: the
    real length."""

    index: torch.Tensor
    padded_len: int
    seq_len: int

    @property
    def local_len(self) -> int:
        """S_local, the number of tokens (real and padding) this rank holds."""
        return int(self.index.numel())

    @property
    def valid(self) -> torch.Tensor:
        """[S_local] bool: True where this rank's token is a real one (not padding)."""
        return self.index < self.seq_len


def check_seq_len(seq_len: object) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__} {seq_len!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    return seq_len


def padded_length(seq_len: int, mode: str, size: int) -> int:
    """``seq_len`` rounded up to a multiple of sp (ulysses) or 2 * sp (ring, hybrid)."""
    multiple = size if mode == "ulysses" else 2 * size
    return -(-check_seq_len(seq_len) // multiple) * multiple


def layout(seq_len: int, mode: str, ring_size: int, ulysses_size: int) -> tuple[int, torch.Tensor]:
    """``(padded_len, table)`` with ``table`` [sp, S_local] int64 on the CPU: row ``cp_rank`` is that rank's
    global token indices (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a context-parallel mode: expected one of {MODES}")
    size = ring_size * ulysses_size
    padded = padded_length(seq_len, mode, size)
    tokens = torch.arange(padded, dtype=torch.int64)
    if mode == "ulysses":
        return padded, tokens.view(size, -1)
    chunks = tokens.view(2 * ring_size, -1)
    groups = torch.stack([torch.cat([chunks[r], chunks[2 * ring_size - 1 - r]]) for r in range(ring_size)])
    return padded, groups.reshape(size, -1)  # each group's tokens split contiguously among its ulysses ranks


def shard_tensor(x: torch.Tensor, shard: SeqShard, dim: int = 1, pad_value: float | int | bool = 0) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``: ``x`` (``seq_len`` long on ``dim``) padded with ``pad_value`` to
    ``padded_len``, then the positions ``shard.index`` taken in order. Differentiable (the gradient of the padding is
    dropped). Use pad_value=-100 for labels, False for a key mask, 0 for ids."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(shard, SeqShard):
        raise TypeError(f"shard must be a SeqShard (from ContextParallel.shard), got {type(shard).__name__}")
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    if x.shape[dim] != shard.seq_len:
        raise ValueError(
            f"x has {x.shape[dim]} positions along dim {dim} (shape {tuple(x.shape)}) but the shard is of "
            f"a sequence of seq_len={shard.seq_len}"
        )
    pad = shard.padded_len - shard.seq_len
    if pad:
        filler = torch.full((*x.shape[:dim], pad, *x.shape[dim + 1 :]), pad_value, dtype=x.dtype, device=x.device)
        x = torch.cat([x, filler], dim=dim)
    return x.index_select(dim, shard.index.to(x.device))


__all__ = ["MODES", "SeqShard", "layout", "padded_length", "shard_tensor"]
