"""Triton twin of csrc/bucket_kernels.cu: multi-tensor pack/unpack of a gradient bucket with scale and dtype cast.

A bucket is one flat buffer of n tensors back to back: tensor i lives in ``flat[offsets[i] : offsets[i] + numels[i]]``.
    pack:   flat[offsets[i] + j] = Out(float32(tensor_i[j]) * scale)
    unpack: tensor_i[j]          = Out(float32(flat[offsets[i] + j]) * scale)
One launch covers all tensors: program b handles ``BLOCK`` elements of one tensor, found through an int64 table
(addresses, numels, offsets, per-program tensor index and start): 4n numbers copied from the host, the per-program
rows formed on the device with tensor ops, and the table cached per bucket layout (``_table``).
All tensors of one launch share a dtype (the ops layer groups them). Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import functools

from ._triton import HAS_TRITON, INTERPRETED, TRITON_IMPORT_ERROR, pinned_to_device, tl, triton  # noqa: F401

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


TABLE_CACHE = 64  # launch tables kept (one per bucket layout: the flat buffers of ZeRO never change theirs)


def table_rows(ptrs, numels, device):
    """The launch table of tensors at addresses ``ptrs`` with ``numels`` elements, on ``device`` (int64 [3n + 2P], P
    programs of BLOCK elements): ``ptrs | numels | offsets | owner[P] | start[P]`` where program b handles elements
    ``start[b] : start[b] + BLOCK`` of tensor ``owner[b]``. No Python loop over blocks: on a GPU only the 4n
    per-tensor numbers cross from the host and the per-program rows are formed there with tensor ops
    (``_rows_torch``); on the CPU (the interpreter) numpy forms them in one thread (``_rows_numpy``: torch's
    two-thread elementwise ops cost more than they save at this size on a busy machine)."""
    if device.type == "cpu":
        return _rows_numpy(ptrs, numels)
    return _rows_torch(ptrs, numels, device)


def _per_tensor(numels):
    blocks = [-(-k // BLOCK) for k in numels]
    offsets, acc = [], 0
    for k in numels:
        offsets.append(acc)
        acc += k
    return blocks, offsets


def _rows_numpy(ptrs, numels):
    import numpy as np
    import torch

    n = len(numels)
    blocks, offsets = _per_tensor(numels)
    programs = sum(blocks)
    table = np.empty(3 * n + 2 * programs, dtype=np.int64)
    table[: 3 * n] = list(ptrs) + list(numels) + offsets
    owner = table[3 * n : 3 * n + programs]
    owner[:] = np.repeat(np.arange(n, dtype=np.int64), blocks)
    first = np.cumsum(blocks, dtype=np.int64) - blocks  # each tensor's first program
    start = table[3 * n + programs :]
    start[:] = (np.arange(programs, dtype=np.int64) - first[owner]) * BLOCK
    return torch.from_numpy(table), programs


def _rows_torch(ptrs, numels, device):
    import torch

    n = len(numels)
    blocks, offsets = _per_tensor(numels)
    programs = sum(blocks)
    head = torch.tensor(list(ptrs) + list(numels) + offsets + blocks, dtype=torch.int64)
    head = pinned_to_device(head, device, "pack_bucket / unpack_bucket")
    i64 = dict(dtype=torch.int64, device=device)
    per_tensor = head[3 * n :]
    first = torch.cumsum(per_tensor, 0) - per_tensor  # each tensor's first program
    table = torch.empty(3 * n + 2 * programs, **i64)
    table[: 3 * n] = head[: 3 * n]
    # owner[b] = how many tensors start at or before program b, minus one: a +1 at every later tensor's first program,
    # summed (index_add_: empty tensors share their neighbour's start; the extra slot takes a start past the end;
    # repeat_interleave would do, but its CPU kernel is ~100x slower and on CUDA it needs the output size anyway)
    marks = torch.zeros(programs + 1, **i64).index_add_(0, first[1:], torch.ones(max(n - 1, 0), **i64))
    owner = table[3 * n : 3 * n + programs]
    torch.cumsum(marks[:programs], 0, out=owner)
    start = table[3 * n + programs :]
    torch.arange(programs, out=start)
    start.sub_(first[owner]).mul_(BLOCK)
    return table, programs


@functools.lru_cache(maxsize=TABLE_CACHE)
def _cached_table(ptrs, numels, device):
    """(table, programs, (stream, event) of the build on CUDA, else None)."""
    table, programs = table_rows(ptrs, numels, device)
    built = None
    if device.type == "cuda":
        import torch

        event = torch.cuda.Event()
        event.record()
        built = (torch.cuda.current_stream(device), event)
    return table, programs, built


def _table(flat, tensors):
    """The launch table on ``flat.device`` and the number of programs, cached per layout (addresses and sizes: the
    table is a function of them alone, so a reused address with the same sizes reuses a table that is still right).
    A call on another CUDA stream than the one that built the table waits for the build (its event, not the whole
    stream) and marks the table in use there. Under CUDA graph capture no table is built or cached (a captured one
    would live in the graph's memory pool): :func:`pinned_to_device` refuses the call, naming the op."""
    import torch

    device = flat.device
    ptrs, numels = tuple(t.data_ptr() for t in tensors), tuple(t.numel() for t in tensors)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        pinned_to_device(None, device, "pack_bucket / unpack_bucket")  # raises: see the docstring
    table, programs, built = _cached_table(ptrs, numels, device)
    if built is not None:
        stream = torch.cuda.current_stream(device)
        if stream != built[0]:
            stream.wait_event(built[1])
            table.record_stream(stream)
    return table, len(tensors), programs


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
        flat,
        table,
        n,
        programs,
        float(scale),
        UNPACK=unpack,
        LIST_DTYPE=_tl_dtype(tensors[0].dtype),
        UNIT_SCALE=float(scale) == 1.0,
        BLOCK=BLOCK,
    )


def pack(tensors, flat, scale: float = 1.0) -> None:
    """flat[:sum(numel)] = cat(t.flatten() for t in tensors) * scale, cast to flat.dtype.

    tensors: contiguous, one dtype (float32/float16/bfloat16), on flat's device. flat: 1-D contiguous, big enough.
    Checks are the caller's (llmpar/ops/bucket.py).
    """
    _launch(flat, list(tensors), scale, unpack=False)


def unpack(flat, tensors, scale: float = 1.0) -> None:
    """tensors[i][...] = flat[offset_i : offset_i + numel_i] * scale, cast to the tensors' dtype (one for all)."""
    _launch(flat, list(tensors), scale, unpack=True)
