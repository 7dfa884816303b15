"""Triton twin of csrc/bucket_kernels.cu: multi-tensor pack/unpack of a gradient bucket with scale and dtype cast.

A bucket is one flat buffer holding n tensors back to back: tensor i lives in ``flat[offsets[i] : offsets[i] + numels[i]]``.
    pack:   flat[offsets[i] + j] = Out(float32(tensor_i[j]) * scale)
    unpack: tensor_i[j]          = Out(float32(flat[offsets[i] + j]) * scale)
One launch covers all tensors: program b handles ``BLOCK`` elements of one tensor, found through an int64 table
(addresses, numels, offsets, per-program tensor index and start) built on the host and copied to the device.
All tensors of one launch share a dtype (the ops layer groups them). Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, tl, triton  # noqa: F401

BLOCK = 1024

if HAS_TRITON:

    @triton.jit
    def _bucket_kernel(
        flat_ptr,  # the flat buffer, typed
        table_ptr,  # int64 table, see module docstring
        n,  # number of tensors
        num_programs,
        scale,
        UNPACK: tl.constexpr,  # False: tensors -> flat, True: flat -> tensors
        LIST_DTYPE: tl.constexpr,  # element type of the tensors in the list
        UNIT_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(table_ptr + 3 * n + pid)
        start = tl.load(table_ptr + 3 * n + num_programs + pid)
        addr = tl.load(table_ptr + t)
        numel = tl.load(table_ptr + n + t)
        offset = tl.load(table_ptr + 2 * n + t)
        tensor_ptr = addr.to(tl.pointer_type(LIST_DTYPE))
        idx = start + tl.arange(0, BLOCK)
        mask = idx < numel
        if UNPACK:
            src = flat_ptr + offset + idx
            dst = tensor_ptr + idx
        else:
            src = tensor_ptr + idx
            dst = flat_ptr + offset + idx
        x = tl.load(src, mask=mask).to(tl.float32)
        if not UNIT_SCALE:
            x = x * scale
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


def _table(flat, tensors):
    """int64 table on ``flat.device`` and the number of programs (see module docstring)."""
    import torch

    n = len(tensors)
    numels = [t.numel() for t in tensors]
    offsets, acc = [], 0
    for k in numels:
        offsets.append(acc)
        acc += k
    owner, starts = [], []
    for i, k in enumerate(numels):
        for s in range(0, k, BLOCK):
            owner.append(i)
            starts.append(s)
    rows = [t.data_ptr() for t in tensors] + numels + offsets + owner + starts
    table = torch.tensor(rows, dtype=torch.int64)
    if flat.device.type != "cpu":
        table = table.pin_memory().to(flat.device, non_blocking=True)
    return table, n, len(owner)


_TL_DTYPES: dict = {}


def _tl_dtype(dtype):
    import torch

    if not _TL_DTYPES:
        _TL_DTYPES.update({torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16})
    return _TL_DTYPES[dtype]


def _launch(flat, tensors, scale: float, unpack: bool) -> None:
    if not HAS_TRITON:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return
    table, n, programs = _table(flat, tensors)
    _bucket_kernel[(programs,)](
        flat, table, n, programs, float(scale),
        UNPACK=unpack, LIST_DTYPE=_tl_dtype(tensors[0].dtype), UNIT_SCALE=float(scale) == 1.0, BLOCK=BLOCK,
    )


def pack(tensors, flat, scale: float = 1.0) -> None:
    """flat[:sum(numel)] = cat(t.flatten() for t in tensors) * scale, cast to flat.dtype.

    tensors: contiguous, one dtype (float32/float16/bfloat16), on flat's device. flat: 1-D contiguous, big enough.
    Checks are the caller's (llmpar/ops/bucket.py).
    """
    _launch(flat, list(tensors), scale, unpack=False)


def unpack(flat, tensors, scale: float = 1.0) -> None:
    """tensors[i][...] = flat[offset_i : offset_i + numel_i] * scale, cast to each tensor's dtype (one dtype for all)."""
    _launch(flat, list(tensors), scale, unpack=True)
