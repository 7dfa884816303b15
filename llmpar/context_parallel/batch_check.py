"""The cp ranks of a data-parallel group agree on the batch before any size-dependent exchange.

Under context parallelism every cp rank is fed the *whole* batch and keeps its slice of each sequence, so the cp ranks
of a group must be fed the same batch. A loader built over the global rank and world size (a DeepSpeed script's
default ``DistributedSampler``) feeds them different rows: same shapes, and the model trains on a blend of samples
without a word; different lengths (a ragged last batch) and attention's exchanges of different sizes abort inside the
backend. :func:`agree_batch` runs before the adapter shards the batch, on every forward:

    record  = [global rank, tensors, then per tensor (at most MAX_TENSORS): name id, ndim, dims[:4], digest]  int64
    records = all-gather of record over the Ulysses group, then of those over the ring group   [sp, RECORD] int64

one fixed-size all-gather per cp group (``RECORD`` = 2 + 8 * MAX_TENSORS int64), whatever the shapes, so ranks fed
different shapes meet in it and raise; then, on every cp rank, the same ``ValueError`` when the records differ, naming
each cp rank's global rank and tensor shapes (and which tensors' contents differ) and how to build the loader over
the data-parallel ranks. Tensors are the call's positional (``arg0``, ...) and keyword tensors (sorted by name);
``digest`` is ``sum_i m(v_i) * (i * 0x9E3779B1 + 1)`` in wrapping int64 over the tensor's flattened values ``v``
(integers as they are, floats by their bits; ``m(v) = v ^ (v >> 32)``): cheap on the device, equal for equal tensors,
and different for practically all different ones. Tensors past ``MAX_TENSORS`` are folded into the last slot's digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from llmpar.distributed.collectives import all_gather_flat, collective_device
from llmpar.distributed.groups import GroupRef

MAX_TENSORS, DIMS = 6, 4
SLOT = 3 + DIMS  # name id, ndim, dims, digest
RECORD = 2 + SLOT * MAX_TENSORS
_GOLDEN = 0x9E3779B1
_CHUNK = 1 << 24
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _name_id(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:12], 16)


def digest(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 on ``t``'s device: ``sum_i m(v_i) * (i * 0x9E3779B1 + 1)`` (wrapping, ``m(v) = v ^ (v >> 32)``) over
    the flattened values (floats by their bits), taken ``_CHUNK`` elements at a time."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        flat = flat.contiguous().view(_BITS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):  # int64 temporaries of at most _CHUNK elements (long embeddings)
        part = flat[start : start + _CHUNK].to(torch.int64)
        part = part ^ (part >> 32)  # the high bits into the low ones (else e.g. +-0.0 differ by 2^63 and cancel)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device) * _GOLDEN + 1
        total += (part * weights).sum()
    return total


def named_tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The call's tensors in a fixed order: positional ``arg{i}``, then keywords sorted by name."""
    out = [(f"arg{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return out + [(k, kwargs[k]) for k in sorted(kwargs) if isinstance(kwargs[k], torch.Tensor)]


def batch_record(args: tuple, kwargs: dict, device: torch.device) -> tuple[torch.Tensor, list[str]]:
    """This rank's ``[RECORD]`` int64 record (module docstring) on ``device``, and the names of its slots."""
    tensors = named_tensors(args, kwargs)
    fields = [dist.get_rank() if dist.is_initialized() else 0, len(tensors)]  # what the host knows: shapes, names
    digests, names = [], []
    for k, (name, t) in enumerate(tensors[:MAX_TENSORS]):
        shape = list(t.shape)
        dims = (shape[: DIMS - 1] + [int(torch.Size(shape[DIMS - 1 :]).numel())]) if len(shape) > DIMS else shape
        fields += [_name_id(name), t.dim(), *dims, *[-1] * (DIMS - len(dims)), -1]  # the digest's slot last
        d = digest(t).to(device)
        if k == MAX_TENSORS - 1:  # the rest folded into the last slot
            for _, extra in tensors[MAX_TENSORS:]:
                d = d * _GOLDEN + digest(extra).to(device)
        digests.append(d)
        names.append(name)
    fields += [-1] * (RECORD - len(fields))
    record = torch.tensor(fields, dtype=torch.int64).to(device)  # one host-to-device copy, then the digests
    if digests:
        at = torch.arange(len(digests), device=device) * SLOT + 2 + SLOT - 1
        record[at] = torch.stack(digests)
    return record, names


def _gather(record: torch.Tensor, groups: list[GroupRef]) -> torch.Tensor:
    """``[sp, RECORD]`` in cp-rank order (Ulysses inner): all-gathered over each group in turn."""
    out = record
    for group in groups:
        size = dist.get_world_size(group.get())
        gathered = torch.empty(size * out.numel(), dtype=out.dtype, device=out.device)
        all_gather_flat(gathered, out.contiguous(), group, what="context-parallel batch agreement")
        out = gathered
    return out.view(-1, RECORD)


def _describe(row: list[int], names: dict[int, str]) -> str:
    parts = []
    for k in range(min(row[1], MAX_TENSORS)):
        at = 2 + k * SLOT
        ndim = row[at + 1]
        dims = row[at + 2 : at + 2 + min(ndim, DIMS)]
        parts.append(f"{names.get(row[at], f'tensor {k}')} {list(dims) if ndim <= DIMS else f'{dims[:-1]}+...'}")
    if row[1] > MAX_TENSORS:
        parts.append(f"+{row[1] - MAX_TENSORS} more")
    return ", ".join(parts) or "no tensors"


def agree_batch(cp: Any, args: tuple, kwargs: dict, *, dp_size: int | None = None, dp_rank: int | None = None) -> None:
    """Raise the same ``ValueError`` on every cp rank of ``cp`` (a ``ContextParallel``) unless all of them were called
    with the same tensors (names, shapes, contents); see the module docstring. ``dp_size`` / ``dp_rank``: this rank's
    data-parallel degree and rank, named in the error as what the loader must be built over (when known)."""
    device = collective_device(cp.groups[0])
    record, names = batch_record(args, kwargs, device)
    rows = _gather(record, cp.groups)
    if bool((rows[:, 1:] == rows[0, 1:]).all()):  # all but the global rank
        return
    table = rows.tolist()
    ids = {_name_id(n): n for n in names}
    same_shapes = all(
        row[1] == table[0][1]
        and all(
            row[2 + k * SLOT : 2 + (k + 1) * SLOT - 1] == table[0][2 + k * SLOT : 2 + (k + 1) * SLOT - 1]
            for k in range(MAX_TENSORS)
        )
        for row in table
    )
    ranks = "; ".join(f"cp rank {c} (global rank {row[0]}): {_describe(row, ids)}" for c, row in enumerate(table))
    if same_shapes:
        differ = [
            ids.get(table[0][2 + k * SLOT], f"tensor {k}")
            for k in range(min(table[0][1], MAX_TENSORS))
            if len({row[2 + (k + 1) * SLOT - 1] for row in table}) > 1
        ]
        what = f"the same shapes but different contents ({', '.join(differ)} differ)"
    else:
        what = "different tensor shapes or arguments"
    raise ValueError(
        f"context-parallel batch: the {cp.size} cp ranks of a group were fed {what}: {ranks}. Under context "
        "parallelism every cp rank of a data-parallel group is fed the same whole batch (each keeps its slice of the "
        "sequence): build the loader over the data-parallel ranks, e.g. DistributedSampler(dataset, "
        "num_replicas=engine.dp_world_size, rank=engine.dp_rank)"
        + (f" (here dp size {dp_size}, dp rank {dp_rank})" if dp_size is not None else "")
        + ", or "
        "engine.deepspeed_io(dataset), not over the global rank and world size; and give every cp rank sequences "
        "of the same length (pad a short last batch, or drop it)"
    )


__all__ = ["MAX_TENSORS", "RECORD", "agree_batch", "batch_record", "digest", "named_tensors"]
