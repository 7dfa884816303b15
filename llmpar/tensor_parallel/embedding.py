"""Vocabulary-parallel embedding.

``W: [V_pad/tp, d]`` where ``V_pad = ceil(V / tp) * tp``; rank r holds rows ``[r * V_pad/tp, (r + 1) * V_pad/tp)``
(the padded rows are zero and never looked up). ``ids: [...]`` (int) -> ``[..., d]``: each rank looks up the ids
in its range, writes zeros for the others, and the partial results are summed over the group (all-reduce; a
reduce-scatter along dim 0 under ``sequence_parallel``, giving this rank's ``[s/tp, ..., d]`` shard).

Riding in that reduction (``_agree`` rank table, a few elements, every call): each rank's flag for ids outside
``[0, V)`` and a hash of its ``ids`` shape. An id outside the vocabulary, or ids of different shapes on the tp ranks,
raise on every rank: a :class:`TokenIdError` (an IndexError like ``nn.Embedding``'s, and a ValueError) or a
ValueError naming the shapes on CPU; a device-side assert on accelerators (no host sync; the first time a rank sees
an ids shape it reads the table, so a shape mismatch there raises the clear ValueError too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.distributed.collectives import GroupRef, all_reduce, reduce_scatter_flat
from llmpar.tensor_parallel import _agree
from llmpar.tensor_parallel._agree import (
    TABLE_COLS,
    ShapeGuard,
    TokenIdError,
    assert_table_ok,
    raise_for_table,
    rank_table,
    table_problems,
)
from llmpar.tensor_parallel._utils import Group, check_positive, pad_to_multiple, resolve_tp_group, tp_size_rank
from llmpar.tensor_parallel.comm import all_gather_dim0
from llmpar.tensor_parallel.linear import _tag

_SKIP_INIT = object()


class _ReduceWithTable(torch.autograd.Function):
    """Sum the partial embedding ``out: [s, ..., d]`` over the group with a rank ``table: [T]`` appended, in the one
    collective (a reduce-scatter along dim 0 under sequence parallelism, every chunk carrying the table). Returns
    ``(reduced, table)``: ``reduced`` [s, ..., d] (or [s/tp, ..., d]) lives in the collective's buffer, set as a plain
    tensor (not a view) so that the gradient arrives without a copy and in-place ops on it stay legal. Backward:
    identity (an all-gather along dim 0 under sequence parallelism)."""

    @staticmethod
    def forward(ctx, out, table, group, sequence_parallel):
        tp, k = table.numel() // TABLE_COLS, table.numel()
        ctx.group, ctx.sp = group, sequence_parallel
        if not sequence_parallel:
            shape, n = out.shape, out.numel()
            flat = torch.empty(n + k, dtype=out.dtype, device=out.device)
            flat[:n] = out.reshape(-1)
            flat[n:] = table
            all_reduce(flat, group)
        else:
            shape = torch.Size((out.shape[0] // tp, *out.shape[1:]))
            n = shape.numel()
            buf = torch.empty(tp, n + k, dtype=out.dtype, device=out.device)
            buf[:, :n] = out.reshape(tp, n)
            buf[:, n:] = table
            flat = torch.empty(n + k, dtype=out.dtype, device=out.device)
            reduce_scatter_flat(flat, buf.view(-1), group)
        reduced_table = flat[n:].clone()
        ctx.mark_non_differentiable(reduced_table)
        return flat.new_empty(0).set_(flat.untyped_storage(), 0, shape), reduced_table

    @staticmethod
    def backward(ctx, grad, _grad_table):
        return (all_gather_dim0(grad, ctx.group) if ctx.sp else grad), None, None, None


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
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if self.tp == 1:
            if _agree.host_checks(ids) and bool(bad.any()):  # elsewhere F.embedding's device-side assert
                raise self._id_error([0], ids[bad])
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        table = rank_table(bad.any(), tuple(ids.shape), self.tp, self.tp_rank, out.dtype)
        out, table = _ReduceWithTable.apply(out, table, self.group, self.sequence_parallel)
        self._check(table, ids, bad)
        return out

    def _id_error(self, ranks: list[int], mine: torch.Tensor | None) -> TokenIdError:
        where = f" on tp group rank(s) {ranks} (this is group rank {self.tp_rank})" if self.tp > 1 else ""
        ids = f": {sorted(set(mine.tolist()))[:8]}" if mine is not None and mine.numel() else ""
        return TokenIdError(f"token ids outside [0, {self.num_embeddings}) (VocabParallelEmbedding of "
                            f"{self.num_embeddings} rows, tp={self.tp}){where}{ids}")

    def _check(self, table: torch.Tensor, ids: torch.Tensor, bad: torch.Tensor) -> None:
        """Raise (CPU) / assert (accelerators) on every rank if the reduced ``table`` shows bad ids or shapes."""
        what = type(self).__name__
        fault = lambda ranks: self._id_error(ranks, ids[bad] if self.tp_rank in ranks else None)  # noqa: E731
        if _agree.host_checks(table):
            raise_for_table(table, self.tp, self.group, tuple(ids.shape), what=what, fault_error=fault)
            return
        if ids.shape not in self._shapes:  # a new ids shape: read the table once (host sync) for a clear error
            if len(table_problems(table, self.tp)[1]) > 1:  # no collective here: the other ranks may not read
                raise_for_table(table, self.tp, self.group, tuple(ids.shape), what=what, fault_error=fault,
                                every_rank_reads=False)
            self._shapes.add(ids.shape)
        assert_table_ok(table, self.tp, f"{what}: token ids outside [0, {self.num_embeddings}), or ids of "
                                        "different shapes on the tp ranks")

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, padding_idx={self.padding_idx}, "
                f"sequence_parallel={self.sequence_parallel}")
