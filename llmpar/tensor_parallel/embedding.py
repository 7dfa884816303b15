"""Vocabulary-parallel embedding.

``W: [V_pad/tp, d]`` where ``V_pad = ceil(V / tp) * tp``; rank r holds rows ``[r * V_pad/tp, (r + 1) * V_pad/tp)``
(the padded rows are zero and never looked up). ``ids: [...]`` (int) -> ``[..., d]``: each rank looks up the ids
in its range, writes zeros for the others, and the partial results are summed over the group (all-reduce; a
reduce-scatter along dim 0 under ``sequence_parallel``, giving this rank's ``[s/tp, ..., d]`` shard).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.distributed.collectives import GroupRef
from llmpar.tensor_parallel._utils import Group, check_positive, pad_to_multiple, resolve_tp_group, tp_size_rank
from llmpar.tensor_parallel.comm import reduce_from_tensor_region, reduce_scatter_to_sequence_region
from llmpar.tensor_parallel.linear import _tag

_SKIP_INIT = object()


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary split across ``group``; same init as ``nn.Embedding(V, d)``.

    ``padding_idx`` behaves as in ``nn.Embedding`` (zero row at init, no gradient).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        _init: object = None,
    ) -> None:
        super().__init__()
        self.group = GroupRef(resolve_tp_group(group))  # by name: see GroupRef
        self.tp, self.tp_rank = tp_size_rank(self.group)
        self.num_embeddings = check_positive("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive("embedding_dim", embedding_dim)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} is outside [-{num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.sequence_parallel = bool(sequence_parallel)
        self.padded_num_embeddings = pad_to_multiple(num_embeddings, self.tp)
        self.num_embeddings_per_rank = self.padded_num_embeddings // self.tp
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = _tag(nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device,
                                                    dtype=dtype)), 0)
        if _init is not _SKIP_INIT:
            ref = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
            self.load_full_(ref.weight.detach())

    @property
    def _local_padding_idx(self) -> int | None:
        p = self.padding_idx
        return None if p is None or not self.vocab_start <= p < self.vocab_end else p - self.vocab_start

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full ``[V, d]`` table into the layer."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected [{self.num_embeddings}, "
                             f"{self.embedding_dim}]")
        padded = F.pad(weight, (0, 0, 0, self.padded_num_embeddings - self.num_embeddings))
        self.weight.copy_(padded[self.vocab_start : self.vocab_end])

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, *, group: Group, **kwargs) -> "VocabParallelEmbedding":
        """This rank's slice of ``emb`` (not changed). ``max_norm`` and sparse embeddings are not supported."""
        if not isinstance(emb, nn.Embedding):
            raise TypeError(f"emb must be an nn.Embedding, got {type(emb).__name__}")
        if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise ValueError("VocabParallelEmbedding does not support max_norm, sparse or scale_grad_by_freq")
        w = emb.weight
        layer = cls(emb.num_embeddings, emb.embedding_dim, group=group, padding_idx=emb.padding_idx,
                    device=w.device, dtype=w.dtype, _init=_SKIP_INIT, **kwargs)
        layer.load_full_(w.detach())
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [...] int -> [..., d] (or this rank's dim-0 shard [s/tp, ..., d] under sequence_parallel)."""
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        if self.sequence_parallel and (ids.dim() < 1 or ids.shape[0] % self.tp):
            raise ValueError(f"sequence_parallel needs ids dim 0 divisible by tp={self.tp}, got {tuple(ids.shape)}")
        if self.tp == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group)
        return reduce_from_tensor_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, padding_idx={self.padding_idx}, "
                f"sequence_parallel={self.sequence_parallel}")
