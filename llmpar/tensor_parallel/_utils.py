"""Small helpers shared by the tensor-parallel layers: group resolution, divisibility checks, chunk bounds.

Every check here is local (shapes, sizes), so a bad input raises on every rank before any collective is issued.
"""

from __future__ import annotations

from typing import Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmpar.distributed.collectives import GroupRef, as_group, group_rank, group_size

Group = Union[dist.ProcessGroup, DeviceMesh]


def resolve_tp_group(group: object, *, argument: str = "group") -> dist.ProcessGroup:
    """Return the tensor-parallel ProcessGroup for ``group``.

    Accepts a ProcessGroup, a 1-D DeviceMesh, or a multi-dimensional DeviceMesh with a ``"tp"`` axis (such as
    ``llmpar.init_distributed(tp=2).mesh``), from which ``mesh["tp"]`` is taken.
    """
    if group is None:
        raise TypeError(
            f"{argument} is required: pass the tensor-parallel ProcessGroup or DeviceMesh (e.g. env.mesh['tp']); "
            "llmpar never falls back to a global group"
        )
    if isinstance(group, DeviceMesh) and group.ndim != 1:
        names = group.mesh_dim_names or ()
        if "tp" not in names:
            raise ValueError(
                f"{argument} is a {group.ndim}-D DeviceMesh with axes {names}, which has no 'tp' axis: pass a "
                "1-D mesh, a mesh with a 'tp' axis, or a ProcessGroup"
            )
        group = group["tp"]
    if not isinstance(group, (DeviceMesh, dist.ProcessGroup, GroupRef)):
        raise TypeError(f"{argument} must be a ProcessGroup or a DeviceMesh, got {type(group).__name__}")
    return as_group(group)


def tp_size_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    return group_size(group), group_rank(group)


def divide(numerator: int, tp: int, what: str) -> int:
    """``numerator // tp``, raising a ValueError naming ``what`` when it does not divide."""
    if numerator % tp:
        raise ValueError(f"{what} {numerator} is not divisible by tp={tp}")
    return numerator // tp


def pad_to_multiple(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive int")
    return value


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into at most ``chunks`` contiguous non-empty ranges of near-equal size."""
    k = max(1, min(chunks, n))
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out
