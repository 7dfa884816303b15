"""Deterministic language-model batches, each data-parallel rank its own disjoint share.

For step ``s`` a generator seeded from ``(seed, s)`` draws ``dp * batch_size`` distinct window starts in the token
stream (the *global* batch, the same on all ranks); dp rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)``.
So the batches of the dp ranks are disjoint, and concatenated in rank order they are exactly the global batch that a
single process with ``batch_size * dp`` would draw: the property the parity tests rely on.

    x[b, t] = tokens[start_b + t],  y[b, t] = tokens[start_b + t + 1],  x, y: [batch_size, seq_len] (int64)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_STEP_STRIDE = 1_000_003  # a prime: (seed, step) pairs map to distinct generator seeds for step < stride


@dataclass(kw_only=True)
class BatchLoader:
    """``loader.batch(step) -> (x, y)`` for this dp rank; ``loader.global_batch(step)`` for all dp ranks."""

    tokens: torch.Tensor
    batch_size: int
    seq_len: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor of token ids")
        self.tokens = self.tokens.to(torch.int64)
        for name in ("batch_size", "seq_len", "dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} is outside [0, dp_size={self.dp_size})")
        if self.num_windows < self.global_batch_size:
            raise ValueError(
                f"the text has {self.tokens.numel()} tokens: too few for {self.global_batch_size} distinct windows "
                f"of seq_len={self.seq_len} + 1 (batch_size={self.batch_size} x dp={self.dp_size})"
            )

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def num_windows(self) -> int:
        """Number of possible window starts (each window holds seq_len + 1 tokens)."""
        return self.tokens.numel() - self.seq_len

    def _starts(self, step: int) -> torch.Tensor:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        gen = torch.Generator(device="cpu").manual_seed(self.seed * _STEP_STRIDE + step)
        return torch.randperm(self.num_windows, generator=gen)[: self.global_batch_size]

    def _gather(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        win = self.tokens[idx]  # [n, seq_len + 1]
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All dp ranks' batches, in rank order: x, y: [dp * batch_size, seq_len]."""
        return self._gather(self._starts(step))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's batch for ``step``: x, y: [batch_size, seq_len]."""
        lo = self.dp_rank * self.batch_size
        return self._gather(self._starts(step)[lo : lo + self.batch_size])
