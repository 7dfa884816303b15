"""One launch over many tensors: the table both multi-tensor AdamW kernels (kernels/adamw.py, kernels/adamw_lowbit.py)
and the grad-norm pass index. Tensor t of n gets ceil(numel_t / block) programs, numbered on from the previous
tensor's; row 0 of the int64 ``table`` holds each tensor's first program (:func:`first_programs`), the other rows what
each kernel reads per tensor (addresses, numels, ...: its TABLE_ROWS). Program ``pid`` owns the last tensor whose first
program is <= pid (:func:`_owner`: a binary search in row 0, ceil(log2 n) loads) and handles block ``pid - first`` of
it. The table reaches the device through pinned memory (:func:`table_to_device`)."""

from __future__ import annotations

from ._triton import HAS_TRITON, pinned_to_device, tl, triton

__all__ = ["first_programs", "table_to_device"]


def first_programs(numels: list[int], block: int) -> tuple[list[int], int]:
    """(each tensor's first program, the programs of all): tensor t runs ceil(numels[t] / block) programs."""
    first, acc = [], 0
    for k in numels:
        first.append(acc)
        acc += -(-k // block)
    return first, acc


def table_to_device(rows: list[int], device, op: str):
    """``rows`` (row-major, n entries per row) as an int64 tensor on ``device`` (``op`` names the caller in the refusal
    under CUDA graph capture: see ``_triton.pinned_to_device``)."""
    import torch

    return pinned_to_device(torch.tensor(rows, dtype=torch.int64), device, op)


if HAS_TRITON:

    @triton.jit
    def _owner(table_ptr, n, pid):
        """The tensor program ``pid`` works on: the last t in [0, n) whose first program table[t] is <= pid."""
        lo = 0
        hi = n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(table_ptr + mid) <= pid:
                lo = mid
            else:
                hi = mid - 1
        return lo
