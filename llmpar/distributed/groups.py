"""Process groups as llmpar passes them: a ``ProcessGroup``, a 1-D ``DeviceMesh`` or a :class:`GroupRef`."""

from __future__ import annotations

from typing import Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Group = Union[dist.ProcessGroup, DeviceMesh]


class GroupRef:
    """A process group held by its registered name and looked up at each use.

    Long-lived llmpar objects (parallel layers, ZeRO optimizers, engines) keep their groups this way, so that
    ``torch.distributed.destroy_process_group()`` really frees the groups even while those objects live on. A gloo
    group kept alive past ``destroy_process_group()`` can abort the interpreter at exit on recent torch ("terminate
    called without an active exception"; torch's own DDP does it too). Where a torch version cannot look groups up by
    name, the group itself is kept.
    """

    __slots__ = ("name", "_pg")

    def __init__(self, group: "Group | GroupRef") -> None:
        pg = as_group(group)
        name = getattr(pg, "group_name", None)
        resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
        try:
            found = resolve(name) if (name and resolve is not None) else None
        except (RuntimeError, ValueError):
            found = None
        self.name: str | None = name if found is not None else None
        self._pg: dist.ProcessGroup | None = None if self.name is not None else pg

    def get(self) -> dist.ProcessGroup:
        if self._pg is not None:
            return self._pg
        try:
            return dist.distributed_c10d._resolve_process_group(self.name)  # type: ignore[arg-type]  # a name: _pg is set otherwise
        except (RuntimeError, ValueError) as err:
            raise RuntimeError(
                f"process group {self.name!r} no longer exists (destroy_process_group() was called?): {err}"
            ) from None

    def __repr__(self) -> str:
        return f"GroupRef({self.name!r})" if self._pg is None else f"GroupRef({self._pg!r})"


def as_group(group: "Group | GroupRef") -> dist.ProcessGroup:
    """Accept a ProcessGroup, a 1-D DeviceMesh (e.g. ``mesh["tp"]``) or a :class:`GroupRef`."""
    if isinstance(group, GroupRef):
        return group.get()
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a DeviceMesh passed as a group must be 1-D, got {group.ndim}-D {group.mesh_dim_names}")
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or a GroupRef, got {type(group).__name__}")


def group_size(group: "Group | GroupRef") -> int:
    return dist.get_world_size(as_group(group))


def group_rank(group: "Group | GroupRef") -> int:
    return dist.get_rank(as_group(group))


def global_rank(group: "Group | GroupRef", local: int) -> int:
    """Global rank of the member ``local`` of ``group``."""
    pg = as_group(group)
    size = dist.get_world_size(pg)
    if not 0 <= local < size:
        raise ValueError(f"group rank {local} is outside [0, {size})")
    return dist.get_global_rank(pg, local)


__all__ = ["Group", "GroupRef", "as_group", "global_rank", "group_rank", "group_size"]
