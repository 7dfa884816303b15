"""Agreement between the ranks of a tensor-parallel group: same input shapes, valid token ids.

Every rank of a tp group must see the same tokens. Inputs of different shapes but the same element count pass every
collective and silently mix unrelated rows; inputs of different element counts make the ranks issue collectives of
different sizes, which gloo answers by aborting the process and NCCL by hanging or reading past the data; an id outside
the vocabulary is seen only by the rank(s) holding it. All are turned into the same clear error on every rank, in one
of two ways:

* :class:`ShapeGuard` (the linear layers): a shape not seen before is all-gathered once and compared
  (:func:`check_same_shape`); shapes the group agreed on are remembered by the layer, so steady-state training pays a
  set lookup. The limit of a cache: a rank whose shape was agreed before skips the check, so if on a later step one
  rank meets a new shape while another reuses an agreed one, only the first enters the check's all-gather and the
  group hangs (until the collective timeout) instead of failing clearly; and two ranks each reusing a different agreed
  shape are not caught. In a model the always-on checks below come first (the vocab-parallel embedding in front, the
  loss behind), so the linear layers' caches only ever see shapes that agree.
* a **rank table** exchanged every call, before the layer's own (input-sized) collective: one all-gather of a fixed
  ``ROW_COLS`` int64 per rank, ``[fault flag, ndim, dims...]`` (:func:`exchange_rows`), so every rank learns every
  rank's fault flag and input shape whatever the inputs are. No host sync is needed: on CPU the table is read and a
  ValueError raised (:func:`raise_for_rows`); on an accelerator a device-side assert (``torch._assert_async``,
  :func:`assert_rows_ok`) fires instead, and a rank meeting an input shape new to it reads the table once for the
  clear error naming every rank's shape.
"""

from __future__ import annotations

import torch

from llmpar.distributed import funcol
from llmpar.distributed.collectives import all_gather_flat, as_group, collective_device, group_rank, group_size
from llmpar.tensor_parallel._traceable import tp_key

_MAX_DIMS = 8  # dims a shape check sends in clear (more are folded into a hash)
ROW_COLS = 2 + _MAX_DIMS  # a rank's row of the exchanged table: fault flag, then the shape code (ndim, dims)
_MAX_AGREED = 64  # shapes a ShapeGuard remembers before starting over


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
    _raise_if_shapes_differ(everyone.view(group_size(pg), -1).tolist(), group_rank(pg), what)


def _raise_if_shapes_differ(codes: list[list[int]], rank: int, what: str) -> None:
    """The ValueError naming every rank's shape, unless all the shape ``codes`` (one per group rank) are equal."""
    if any(c != codes[0] for c in codes):
        shapes = ", ".join(f"group rank {r} {_shape_text(c)}" for r, c in enumerate(codes))
        raise ValueError(
            f"{what}: the ranks of the tensor-parallel group got inputs of different shapes ({shapes}; "
            f"this is group rank {rank}): every tp rank must get the same input"
        )


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
    """Whether checks on ``t`` are read on the host (CPU tensors: free) rather than asserted on the device. Under
    torch.compile never: a host read would break the graph, so a traced check is the device-side assert on every
    device (a RuntimeError carrying the message, on CPU too)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def exchange_rows(fault: torch.Tensor, shape: tuple[int, ...], group: object) -> torch.Tensor:
    """Every rank's ``[fault, ndim, dims...]`` row: one all-gather of ``ROW_COLS`` int64 per rank (a fixed size
    whatever the inputs), on ``fault``'s device (a 0-d bool tensor; no host sync: the shape code travels host ->
    device asynchronously). Returns ``[tp, ROW_COLS]`` int64, row r from group rank r."""
    if torch.compiler.is_compiling():
        return _exchange_rows_traced(fault, shape, group)
    pg = as_group(group)
    row = torch.tensor([0] + _shape_code(tuple(shape)), dtype=torch.int64)
    if fault.device.type != "cpu":
        row = row.to(fault.device, non_blocking=True)
    row[0] = fault.to(torch.int64)
    rows = torch.empty(group_size(pg) * ROW_COLS, dtype=torch.int64, device=row.device)
    all_gather_flat(rows, row, pg, what=f"input agreement of {ROW_COLS} int64")
    return rows.view(-1, ROW_COLS)


def _exchange_rows_traced(fault: torch.Tensor, shape: tuple[int, ...], group: object) -> torch.Tensor:
    """:func:`exchange_rows` under torch.compile: the same row through a functional all-gather."""
    row = torch.cat([fault.to(torch.int64).reshape(1), torch.tensor(_shape_code(tuple(shape)), device=fault.device)])
    return funcol.all_gather_dim0(row.unsqueeze(0), tp_key(group))


def shapes_differ(rows: torch.Tensor) -> bool:
    """Host read of exchanged ``rows``: whether the ranks' shapes differ."""
    codes = rows[:, 1:].tolist()
    return any(c != codes[0] for c in codes)


def assert_rows_ok(rows: torch.Tensor, message: str) -> None:
    """Device-side assert (no host sync) that no rank flagged a fault and all ranks' shapes agree."""
    ok = (rows[:, 0] == 0).all() & (rows[:, 1:] == rows[:1, 1:]).all()
    torch._assert_async(ok, message)


def raise_for_rows(rows: torch.Tensor, group: object, *, what: str, fault_error) -> None:
    """Raise if the exchanged ``rows`` show inputs of different shapes (a ValueError naming every rank's shape) or a
    fault (``fault_error(ranks)``, the exception for a fault on group ``ranks``). Shapes come first: a fault seen
    under mismatched inputs may be an artifact of them. Every rank holds the same rows, so every rank raises."""
    table = rows.tolist()
    _raise_if_shapes_differ([r[1:] for r in table], group_rank(as_group(group)), what)
    faulty = [r for r, row in enumerate(table) if row[0] != 0]
    if faulty:
        raise fault_error(faulty)
