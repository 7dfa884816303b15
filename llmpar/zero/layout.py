"""The flat layout ZeRO keeps parameters, gradients and optimizer state in.

One :class:`FlatLayout` covers the params of one *buffer key* (same dtype, same optimizer param group, same
tensor-parallel kind), so that one fused AdamW launch steps a rank's whole partition of it. The params are cut into
**units**: runs of whole params, in the order their gradients are expected (reverse registration order), each at most
``unit_numel`` elements unless one param alone is larger. Each unit is padded to a multiple of ``shards * align`` and
split into ``shards`` equal, contiguous shards; rank r owns shard r of every unit. So:

    full flat buffer  [total]        unit u at  [u.offset, u.offset + u.padded)             (params: views into it)
    unit u, shard r   [u.shard]      at  u.offset + r * u.shard  in the full buffer
    rank r partition  [partition]    concat over units of shard r;  unit u's shard at u.shard_offset in it

Why units and not one contiguous cut of the whole buffer: a unit is reduce-scattered (its full ``[padded]`` gradient in,
this rank's ``[shard]`` out) and all-gathered (``[shard]`` in, ``[padded]`` out, straight into the param buffer) as one
collective with no padding beyond ``shards * align`` elements and no copies, as soon as the unit's gradients are
complete, which is what lets the reduce-scatter overlap the rest of backward. Stage 3 uses the same units as its
gather units (one transformer block each); CPU offload moves the partition-sized buffers to the host; a checkpoint
stores ``describe()`` plus each rank's partition, and since offsets inside a unit do not depend on ``shards``, any other
world size re-cuts the same per-param values (``param_slices`` tells which piece of which param a shard holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ParamSlot:
    """Where one param lives: ``numel`` elements at ``offset`` inside unit ``unit`` (unit-relative)."""

    index: int  # position in the layout's param list
    name: str
    shape: tuple[int, ...]
    numel: int
    unit: int
    offset: int


@dataclass(frozen=True, kw_only=True)
class Unit:
    """A run of whole params reduced and gathered as one collective."""

    index: int
    params: tuple[int, ...]  # layout param indices, in buffer order
    numel: int  # sum of the params' numels
    padded: int  # numel rounded up to a multiple of shards * align
    offset: int  # start in the full flat buffer
    shard_offset: int  # start of this unit's shard in every rank's partition

    def shard_numel(self, shards: int) -> int:
        return self.padded // shards


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FlatLayout:
    """Layout of ``params`` (one dtype) over ``shards`` data-parallel ranks. Pure bookkeeping: allocates nothing.

    params: the tensors in registration order; names: matching names (for errors and checkpoints).
    unit_numel: target elements per unit (``reduce_bucket_size``); align: elements each shard is a multiple of.
    groups: explicit units instead (lists of param indices, in unit order; stage 3 gives one per module).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        names: list[str],
        *,
        shards: int,
        unit_numel: int,
        align: int = 1,
        groups: list[list[int]] | None = None,
    ) -> None:
        if len(params) != len(names):
            raise ValueError(f"names has {len(names)} entries but params has {len(params)}")
        if not params:
            raise ValueError("a FlatLayout needs at least one param")
        if shards < 1 or unit_numel < 1 or align < 1:
            raise ValueError(f"shards={shards}, unit_numel={unit_numel}, align={align} must all be >= 1")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"a FlatLayout holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.shards = shards
        self.align = align
        self.unit_numel = unit_numel
        if groups is not None:  # explicit units (stage 3: one module each): every param in exactly one
            flat_ids = sorted(i for g in groups for i in g)
            if flat_ids != list(range(len(params))) or any(not g for g in groups):
                raise ValueError(f"groups must split the {len(params)} params into non-empty units, each param once")
            groups = [list(g) for g in groups]
        else:
            groups = self._by_size(params, unit_numel)
        self.slots: list[ParamSlot | None] = [None] * len(params)
        self.units: list[Unit] = []
        offset = shard_offset = 0
        for u, members in enumerate(groups):
            inner = 0
            for i in members:
                self.slots[i] = ParamSlot(
                    index=i, name=names[i], shape=tuple(params[i].shape), numel=params[i].numel(), unit=u, offset=inner
                )
                inner += params[i].numel()
            padded = _round_up(max(inner, 1), shards * align)
            self.units.append(
                Unit(
                    index=u, params=tuple(members), numel=inner, padded=padded, offset=offset, shard_offset=shard_offset
                )
            )
            offset += padded
            shard_offset += padded // shards
        self.total = offset
        self.partition = shard_offset
        self.numel = sum(p.numel() for p in params)

    @staticmethod
    def _by_size(params: list[torch.Tensor], unit_numel: int) -> list[list[int]]:
        order = list(reversed(range(len(params))))  # gradients arrive roughly in reverse registration order
        groups: list[list[int]] = []
        size = 0
        for i in order:
            n = params[i].numel()
            if groups and size + n <= unit_numel:
                groups[-1].append(i)
                size += n
            else:
                groups.append([i])
                size = n
        return groups

    def slot(self, index: int) -> ParamSlot:
        slot = self.slots[index]
        assert slot is not None
        return slot

    # ------------------------------------------------------------------ views
    def param_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Param ``index`` as a view into the full flat buffer ``flat: [total]``."""
        s = self.slot(index)
        start = self.units[s.unit].offset + s.offset
        return flat[start : start + s.numel].view(s.shape)

    def param_in_unit(self, unit_flat: torch.Tensor, index: int) -> torch.Tensor:
        """Param ``index`` as a view into its gathered unit ``unit_flat: [padded]`` (stage 3)."""
        s = self.slot(index)
        return unit_flat[s.offset : s.offset + s.numel].view(s.shape)

    def unit_view(self, flat: torch.Tensor, unit: int) -> torch.Tensor:
        """Unit ``unit`` of the full flat buffer: ``[padded]``."""
        u = self.units[unit]
        return flat[u.offset : u.offset + u.padded]

    def shard_of_full(self, flat: torch.Tensor, unit: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of unit ``unit`` inside the full flat buffer: ``[shard]``."""
        u = self.units[unit]
        n = u.shard_numel(self.shards)
        return flat[u.offset + rank * n : u.offset + (rank + 1) * n]

    def shard_of_partition(self, part: torch.Tensor, unit: int) -> torch.Tensor:
        """Unit ``unit``'s shard inside a partition-sized buffer ``part: [partition]``."""
        u = self.units[unit]
        n = u.shard_numel(self.shards)
        return part[u.shard_offset : u.shard_offset + n]

    def param_slices(self, unit: int, rank: int) -> list[tuple[int, int, int, int]]:
        """Pieces of params in rank ``rank``'s shard of ``unit``: (param index, start, stop in the param's flat view,
        start in the shard). Padding holds no param and is left out."""
        u = self.units[unit]
        n = u.shard_numel(self.shards)
        lo, hi = rank * n, (rank + 1) * n
        out = []
        for i in u.params:
            s = self.slot(i)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((i, a - s.offset, b - s.offset, a - lo))
        return out

    def describe(self) -> dict:
        """The global layout as plain data (for checkpoints): enough to cut any shard back into named params."""
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "shards": self.shards,
            "align": self.align,
            "unit_numel": self.unit_numel,
            "total": self.total,
            "partition": self.partition,
            "units": [
                {
                    "params": list(u.params),
                    "numel": u.numel,
                    "padded": u.padded,
                    "offset": u.offset,
                    "shard_offset": u.shard_offset,
                }
                for u in self.units
            ],
            "params": [
                {"name": s.name, "shape": list(s.shape), "unit": s.unit, "offset": s.offset}
                for s in (self.slot(i) for i in range(len(self.slots)))
            ],
        }
