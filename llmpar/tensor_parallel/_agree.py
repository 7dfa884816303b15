"""Agreement between the ranks of a tensor-parallel group: same input shapes, valid token ids.

Every rank of a tp group must see the same tokens. Inputs of different shapes but the same element count pass every
collective and silently mix unrelated rows; an id outside the vocabulary is seen only by the rank(s) holding it. Both
are turned into the same clear error on every rank, in one of two ways:

* :class:`ShapeGuard` (the linear layers): a shape not seen before is all-gathered once and compared
  (:func:`check_same_shape`); shapes the group agreed on are remembered by the layer, so steady-state training pays a
  set lookup. The limit of a cache: a rank whose shape was agreed before skips the check, so if on a later step one
  rank meets a new shape while another reuses an agreed one, only the first enters the check's all-gather and the
  group hangs (until the collective timeout) instead of failing clearly; and two ranks each reusing a different agreed
  shape are not caught. In a model the always-on checks below come first (the vocab-parallel embedding in front, the
  loss behind), so the linear layers' caches only ever see shapes that agree.
* a **rank table** riding in a collective the layer issues anyway (the embedding's reduction, the loss's max
  all-reduce): each rank appends a ``[tp, k]`` table, zeros except its own row ``[fault flag, 8 bytes of a hash of
  its input shape]``, so a sum or a max over the group hands every rank every row. Every call, no extra collective,
  no host sync: on CPU the table is read and a ValueError raised; on an accelerator a device-side assert
  (``torch._assert_async``) fires instead. The values are integers <= 255, exact in every float dtype down to bf16.
"""
from __future__ import annotations

import torch

from llmpar.distributed.collectives import all_gather_flat, as_group, collective_device, group_rank, group_size

TABLE_COLS = 9  # fault flag + 8 hash bytes
_MAX_DIMS = 8  # dims a shape check sends in clear (more are folded into a hash)
_MAX_AGREED = 64  # shapes a ShapeGuard remembers before starting over


class TokenIdError(ValueError, IndexError):
    """A token / class id outside the vocabulary. A ValueError (llmpar's bad-input error) and an IndexError (what
    ``nn.Embedding`` and ``F.cross_entropy`` raise on CPU), so either ``except`` catches it."""


def _shape_code(shape: tuple[int, ...]) -> list[int]:
    dims = list(shape)
    if len(dims) > _MAX_DIMS:
        dims = dims[: _MAX_DIMS - 1] + [hash(tuple(dims[_MAX_DIMS - 1 :])) & (2**62 - 1)]
    return [len(shape)] + dims + [-1] * (_MAX_DIMS - len(dims))


def _shape_text(code: list[int]) -> str:
    ndim, dims = code[0], [d for d in code[1:] if d >= 0]
    if ndim > _MAX_DIMS:
        return "(" + ", ".join(map(str, dims[:-1])) + f", ... {ndim} dims)"
    return str(tuple(dims[:ndim]))


def check_same_shape(shape: tuple[int, ...], group: object, *, what: str) -> None:
    """All-gather ``shape`` over ``group`` (one small collective); raise the same ValueError on every rank, naming
    every rank's shape, unless they are all equal."""
    pg = as_group(group)
    mine = torch.tensor(_shape_code(tuple(shape)), dtype=torch.int64, device=collective_device(pg))
    everyone = torch.empty(group_size(pg) * mine.numel(), dtype=torch.int64, device=mine.device)
    all_gather_flat(everyone, mine, pg)
    codes = everyone.view(group_size(pg), -1).tolist()
    if any(c != codes[0] for c in codes):
        shapes = ", ".join(f"group rank {r} {_shape_text(c)}" for r, c in enumerate(codes))
        raise ValueError(f"{what}: the ranks of the tensor-parallel group got inputs of different shapes ({shapes}; "
                         f"this is group rank {group_rank(pg)}): every tp rank must get the same input")


class ShapeGuard:
    """The input shapes a layer's tp group has agreed on. ``check(shape, group)`` costs a set lookup for a known
    shape and one :func:`check_same_shape` for a new one. Owned by the layer (no shared state)."""

    __slots__ = ("what", "_agreed")

    def __init__(self, what: str) -> None:
        self.what = what
        self._agreed: set[tuple[int, ...]] = set()

    def __contains__(self, shape: tuple[int, ...]) -> bool:
        return tuple(shape) in self._agreed

    def add(self, shape: tuple[int, ...]) -> None:
        if len(self._agreed) >= _MAX_AGREED:
            self._agreed.clear()
        self._agreed.add(tuple(shape))

    def check(self, shape: tuple[int, ...], group: object) -> None:
        if tuple(shape) in self._agreed:
            return
        check_same_shape(shape, group, what=self.what)
        self.add(shape)

    def __getstate__(self):
        return {"what": self.what}

    def __setstate__(self, state) -> None:
        self.what, self._agreed = state["what"], set()


def host_checks(t: torch.Tensor) -> bool:
    """Whether checks on ``t`` are read on the host (CPU tensors: free) rather than asserted on the device."""
    return t.device.type == "cpu"


def _hash_bytes(shape: tuple[int, ...]) -> list[int]:
    return list(hash(tuple(shape)).to_bytes(8, "little", signed=True))


def rank_table(fault: torch.Tensor, shape: tuple[int, ...], tp: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``[tp * TABLE_COLS]`` zeros except row ``rank`` = ``[fault (a bool tensor), hash bytes of shape]``; built on
    ``fault``'s device without a host sync (the bytes travel host -> device asynchronously)."""
    table = torch.zeros(tp, TABLE_COLS, dtype=dtype, device=fault.device)
    row = torch.tensor([0] + _hash_bytes(shape), dtype=dtype)
    table[rank] = row.to(fault.device, non_blocking=True) if fault.device.type != "cpu" else row
    table[rank, 0] = fault.to(dtype)
    return table.view(-1)


def table_problems(table: torch.Tensor, tp: int) -> tuple[list[int], list[list[int]]]:
    """Host read of a reduced table: (group ranks that flagged a fault, the groups of ranks whose shape hashes agree:
    one group when all agree)."""
    rows = table.view(tp, TABLE_COLS).tolist()
    by_hash: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        by_hash.setdefault(tuple(row[1:]), []).append(r)
    return [r for r, row in enumerate(rows) if row[0] != 0], sorted(by_hash.values())


def assert_table_ok(table: torch.Tensor, tp: int, message: str) -> None:
    """Device-side assert (no host sync) that no rank flagged a fault and all shape hashes agree."""
    t = table.view(tp, TABLE_COLS)
    ok = (t[:, 0] == 0).all() & (t[:, 1:] == t[:1, 1:]).all()
    torch._assert_async(ok, message)


def raise_for_table(table: torch.Tensor, tp: int, group: object, shape: tuple[int, ...], *, what: str,
                    fault_error, every_rank_reads: bool = True) -> None:
    """Raise if the reduced ``table`` shows a shape mismatch or a fault. Shapes come first (a fault seen under
    mismatched inputs may be an artifact of them). ``every_rank_reads``: every rank of the group is reading this
    table now (CPU), so all take part in one more all-gather that names every rank's shape; otherwise (a rank's first
    read of a new shape on an accelerator) the error names this rank's shape and which ranks agree.
    ``fault_error(ranks)`` builds the exception for a fault on ``ranks``."""
    faulty, groups = table_problems(table, tp)
    if len(groups) > 1:
        if every_rank_reads:
            check_same_shape(shape, group, what=what)
        raise ValueError(f"{what}: the ranks of the tensor-parallel group got inputs of different shapes (group ranks "
                         f"{groups} agree among themselves; this is group rank {group_rank(as_group(group))} with "
                         f"{tuple(shape)}): every tp rank must get the same input")
    if faulty:
        raise fault_error(faulty)
