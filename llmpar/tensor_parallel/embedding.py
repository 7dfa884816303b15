"""Vocabulary-parallel embedding.

``W: [V_pad/tp, d]`` where ``V_pad = ceil(V / tp) * tp``; rank r holds rows ``[r * V_pad/tp, (r + 1) * V_pad/tp)``
(the padded rows are zero and never looked up). ``ids: [...]`` (int) -> ``[..., d]``: each rank looks up the ids
in its range, writes zeros for the others, and the partial results are summed over the group (all-reduce; a
reduce-scatter along dim 0 under ``sequence_parallel``, giving this rank's ``[s/tp, ..., d]`` shard).

Before the lookup, every call, the ranks exchange a fixed-size row each (``_agree.exchange_rows``: a flag for ids
outside ``[0, V)`` and the ids' shape, one all-gather of 10 int64 per rank), so that ids outside the vocabulary or ids
of different shapes on the tp ranks (also of different element counts, which would give the sum collectives of
different sizes) raise on every rank before the sum is issued: a :class:`TokenIdError` (an IndexError like
``nn.Embedding``'s, and a ValueError) or a ValueError naming every rank's shape on CPU; a device-side assert on
accelerators (no host sync; the first time a rank sees an ids shape it reads the rows, so a shape mismatch there raises
the clear ValueError too). Nothing is left half done: the layer stays usable after the error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.distributed.collectives import GroupRef
from llmpar.distributed.errors import TokenIdError
from llmpar.tensor_parallel import _agree
from llmpar.tensor_parallel._agree import ShapeGuard, assert_rows_ok, exchange_rows, raise_for_rows, shapes_differ
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
        self._shapes = ShapeGuard(type(self).__name__)  # ids shapes already read back from the table (accelerators)
        self.padded_num_embeddings = pad_to_multiple(num_embeddings, self.tp)
        self.num_embeddings_per_rank = self.padded_num_embeddings // self.tp
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = _tag(
            nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype)), 0
        )
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
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}, expected [{self.num_embeddings}, {self.embedding_dim}]"
            )
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
        layer = cls(
            emb.num_embeddings,
            emb.embedding_dim,
            group=group,
            padding_idx=emb.padding_idx,
            device=w.device,
            dtype=w.dtype,
            _init=_SKIP_INIT,
            **kwargs,
        )
        layer.load_full_(w.detach())
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [...] int -> [..., d] (or this rank's dim-0 shard [s/tp, ..., d] under sequence_parallel)."""
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if self.tp > 1:  # every rank's flag and shape, before anything sized by the ids is issued
            self._check(exchange_rows(bad.any(), tuple(ids.shape), self.group), ids, bad)
        if self.sequence_parallel and (ids.dim() < 1 or ids.shape[0] % self.tp):  # the same shape on every rank
            raise ValueError(f"sequence_parallel needs ids dim 0 divisible by tp={self.tp}, got {tuple(ids.shape)}")
        if self.tp == 1:
            if _agree.host_checks(ids) and bool(bad.any()):  # elsewhere F.embedding's device-side assert
                raise self._id_error([0], ids[bad])
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group)
        return reduce_from_tensor_region(out, self.group)

    def _id_error(self, ranks: list[int], mine: torch.Tensor | None) -> TokenIdError:
        where = f" on tp group rank(s) {ranks} (this is group rank {self.tp_rank})" if self.tp > 1 else ""
        ids = f": {sorted(set(mine.tolist()))[:8]}" if mine is not None and mine.numel() else ""
        return TokenIdError(
            f"token ids outside [0, {self.num_embeddings}) (VocabParallelEmbedding of "
            f"{self.num_embeddings} rows, tp={self.tp}){where}{ids}"
        )

    def _check(self, rows: torch.Tensor, ids: torch.Tensor, bad: torch.Tensor) -> None:
        """Raise (CPU) / assert (accelerators) on every rank if the exchanged ``rows`` show bad ids or shapes."""
        what = type(self).__name__
        fault = lambda ranks: self._id_error(ranks, ids[bad] if self.tp_rank in ranks else None)  # noqa: E731
        if _agree.host_checks(rows):
            raise_for_rows(rows, self.group, what=what, fault_error=fault)
            return
        if ids.shape not in self._shapes and not torch.compiler.is_compiling():  # a new ids shape: read the rows
            # once (host sync) for a clear error; a traced graph asserts only (its shapes are fixed when traced)
            if shapes_differ(rows):
                raise_for_rows(rows, self.group, what=what, fault_error=fault)
            self._shapes.add(ids.shape)
        assert_rows_ok(
            rows, f"{what}: token ids outside [0, {self.num_embeddings}), or ids of different shapes on the tp ranks"
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, padding_idx={self.padding_idx}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
