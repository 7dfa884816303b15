"""Parallel degrees and the named device mesh they build.

``ParallelDims(tp=2, pp=2, cp=1, dp=-1)`` is validated against the world size (``dp=-1`` takes what is left) and
builds a ``torch.distributed.device_mesh.DeviceMesh`` of shape ``[pp, dp, cp, tp]`` with the axis names
``("pp", "dp", "cp", "tp")``: tp is innermost, so tensor-parallel peers are neighbouring ranks (same node on GPUs),
cp (context parallelism: the ranks that split one sequence) next, then dp, pp outermost. Axes of size 1 are kept, so
code can always ask for ``mesh["tp"]`` or ``mesh["cp"]``.

Groups the mesh has no axis for are derived from it by name, as torchtitan names its derived meshes:
:meth:`ParallelDims.group` ``("dp_cp")`` is the flattened dp x cp group ZeRO reduces over under context
parallelism (:data:`DERIVED`), :meth:`ParallelDims.split_axis` ``("cp", inner)`` the inner (adjacent) and outer parts
of an axis (a hybrid cp axis: Ulysses inside, ring across). Both build on :meth:`ParallelDims.new_group`, which
partitions the ranks by a key (a collective: every rank calls it alike); each named group is built once per
``ParallelDims``. :meth:`ParallelDims.from_mesh` gives the degrees of an existing mesh.

Expert parallelism (``ep``) is not a mesh axis: as in Megatron-Core and DeepSpeed it folds over the ranks that are
data-parallel for the dense part, here the dp x cp ranks ZeRO reduces over (``ep`` must divide ``dp * cp``). Number
those ranks ``i = dp_rank * cp + cp_rank``; then ``ep_rank = i % ep`` and ``edp_rank = i // ep``, i.e.
``dp * cp = edp * ep`` with ep inner (the ranks exchanging tokens are neighbours, on one node where they fit):

- ``group("ep")``: the ep ranks whose experts together make one full MoE layer (the all-to-all group);
- ``group("edp")``: the ``edp = dp * cp / ep`` ranks holding the same experts (expert-data-parallel: ZeRO reduces and
  shards expert parameters over it, every other parameter over ``"dp_cp"``).

Both share pp and tp coordinates (experts are replicated over tp). :meth:`ParallelDims.derived_ranks` lists a
derived group's ranks without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
# groups derived from the mesh by name: the mesh axes they flatten (ranks that differ only on these axes share one)
DERIVED: dict[str, tuple[str, ...]] = {"dp_cp": ("dp", "cp")}
# groups folded over the dp x cp ranks by the expert-parallel degree (module docstring)
EXPERT_GROUPS: tuple[str, ...] = ("ep", "edp")


def _check_degree(name: str, value: object, *, allow_infer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if allow_infer and value == -1:
        return
    if value < 1:
        accepted = "a positive int or -1 (infer from the world size)" if allow_infer else "a positive int"
        raise ValueError(f"{name}={value} is not valid: expected {accepted}")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of tensor (``tp``), pipeline (``pp``), context (``cp``), data (``dp``) and expert (``ep``)
    parallelism.

    ``tp * pp * cp * dp == world_size`` must hold; ``dp=-1`` infers ``dp = world_size // (tp * pp * cp)``. ``ep``
    divides ``dp * cp``: the dp x cp ranks are ``edp x ep`` for the experts (``edp = dp * cp / ep``, ep inner; module
    docstring); ``group("ep")`` / ``group("edp")`` are the derived groups.
    """

    tp: int = 1
    pp: int = 1
    dp: int = -1
    cp: int = 1
    ep: int = 1
    world_size: int = field(default=-1)
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # derived groups, built once

    def __post_init__(self) -> None:
        _check_degree("tp", self.tp)
        _check_degree("pp", self.pp)
        _check_degree("cp", self.cp)
        _check_degree("dp", self.dp, allow_infer=True)
        _check_degree("ep", self.ep)
        if self.world_size == -1:
            if not dist.is_available() or not dist.is_initialized():
                if self.dp == -1:
                    raise ValueError(
                        "world_size is not given and torch.distributed is not initialized: pass world_size= "
                        "or call llmpar.init_distributed() first"
                    )
                self.world_size = self.tp * self.pp * self.cp * self.dp
            else:
                self.world_size = dist.get_world_size()
        _check_degree("world_size", self.world_size)
        model_parallel = self.tp * self.pp * self.cp
        if self.dp == -1:
            if self.world_size % model_parallel:
                what = "tp*pp" if self.cp == 1 else "tp*pp*cp"
                given = f"{self.tp}*{self.pp}" + ("" if self.cp == 1 else f"*{self.cp}")
                raise ValueError(
                    f"world size {self.world_size} is not divisible by {what} = {given} = {model_parallel}; "
                    f"choose degrees whose product divides {self.world_size}"
                )
            self.dp = self.world_size // model_parallel
        if model_parallel * self.dp != self.world_size:
            raise ValueError(
                f"tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = {model_parallel * self.dp} does not equal "
                f"the world size {self.world_size}; set dp=-1 to infer it"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp*cp = {self.dp}*{self.cp} = {self.dp * self.cp}: expert parallelism "
                "folds over the data-parallel ranks (choose an ep that divides dp*cp)"
            )

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ``dp * cp / ep`` ranks hold the same experts."""
        return self.dp * self.cp // self.ep

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in ``MESH_AXES`` order: ``(pp, dp, cp, tp)``."""
        return (self.pp, self.dp, self.cp, self.tp)

    def degree(self, axis: str) -> int:
        """The degree of a mesh axis, or of ``"ep"`` / ``"edp"``."""
        if axis not in MESH_AXES and axis not in EXPERT_GROUPS:
            raise ValueError(f"axis {axis!r} is not one of {MESH_AXES + EXPERT_GROUPS}")
        return int(getattr(self, axis))

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of global ``rank`` on each axis (tp fastest), without needing a mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        strides = self._strides()
        return {axis: (rank // strides[axis]) % self.degree(axis) for axis in MESH_AXES}

    def _strides(self) -> dict[str, int]:
        return {"tp": 1, "cp": self.tp, "dp": self.tp * self.cp, "pp": self.tp * self.cp * self.dp}

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks that share ``axis``'s group with ``rank`` (ordered by their index on the axis)."""
        c = self.coordinates(rank)
        stride = self._strides()[axis]
        base = rank - c[axis] * stride
        return [base + i * stride for i in range(self.degree(axis))]

    def new_group(self, key: Callable[[int], Hashable]) -> dist.ProcessGroup:
        """This rank's group of the partition of all ranks by ``key(rank)`` (ranks with equal keys share a group,
        ordered by global rank), e.g. ``key=lambda r: (c := dims.coordinates(r))["pp"], c["tp"]`` for the dp x cp
        group ZeRO reduces over. A collective: every rank must call it with the same ``key``; each group of the
        partition is created once, in a fixed order."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call llmpar.init_distributed() first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was built for world size {self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        parts: dict[Hashable, list[int]] = {}
        for r in range(self.world_size):
            parts.setdefault(key(r), []).append(r)
        me, mine = dist.get_rank(), None
        for ranks in sorted(parts.values()):
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group
        assert mine is not None
        return mine

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> "ParallelDims":
        """The degrees of ``mesh`` (a mesh of :meth:`build_mesh`, or any mesh over the whole job whose axes are named
        among :data:`MESH_AXES`; a missing axis has degree 1)."""
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in MESH_AXES]
        if not names or unknown:
            raise ValueError(
                f"mesh has axes {names}: expected names among {MESH_AXES} (llmpar.init_distributed's mesh)"
            )
        if mesh.mesh.numel() != dist.get_world_size():
            raise ValueError(
                f"mesh spans {mesh.mesh.numel()} of the job's {dist.get_world_size()} ranks: pass the whole mesh "
                "(llmpar.init_distributed(...).mesh), not a sub-mesh"
            )
        return cls(**{n: mesh[n].size() for n in names}, world_size=dist.get_world_size())

    def _key(self, name: str) -> Callable[[int], Hashable]:
        """The partition key of derived group ``name``: ranks with equal keys share its group."""
        if name in EXPERT_GROUPS:

            def expert_key(r: int) -> Hashable:
                c = self.coordinates(r)
                i = c["dp"] * self.cp + c["cp"]  # the rank's index among its dp x cp ranks
                return (c["pp"], c["tp"], i // self.ep if name == "ep" else i % self.ep)

            return expert_key
        if name not in DERIVED:
            raise ValueError(f"no derived group {name!r}: expected one of {sorted(DERIVED) + list(EXPERT_GROUPS)}")
        kept = [a for a in MESH_AXES if a not in DERIVED[name]]
        return lambda r: tuple(self.coordinates(r)[a] for a in kept)

    def derived_ranks(self, name: str, rank: int) -> list[int]:
        """Global ranks of ``rank``'s derived group ``name`` (``"dp_cp"``, ``"ep"``, ``"edp"``), ascending; no
        process group needed. ``derived_ranks("ep", r)[k]`` is the rank of ep rank ``k``."""
        key = self._key(name)
        mine = key(rank)
        return [r for r in range(self.world_size) if key(r) == mine]

    def group(self, name: str) -> dist.ProcessGroup:
        """This rank's group of the derived group ``name``: ``"dp_cp"`` (:data:`DERIVED`: the dp x cp ranks that share
        pp and tp coordinates), ``"ep"`` / ``"edp"`` (expert parallel / expert data parallel: module docstring). The
        whole job when it spans every rank. A collective the first time (every rank asks alike); the same group
        after."""
        key = self._key(name)
        if name not in self._groups:
            if len(self.derived_ranks(name, 0)) == self.world_size:
                self._groups[name] = dist.group.WORLD
            else:
                self._groups[name] = self.new_group(key)
        return self._groups[name]

    def split_axis(self, axis: str, inner: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """``(inner group, outer group)`` of ``axis`` split as ``axis rank = outer rank * inner + inner rank``: the
        inner groups join ``inner`` adjacent ranks of the axis, the outer ones the ranks ``inner`` apart (a hybrid cp
        axis: Ulysses over the inner, ring over the outer). A collective the first time; the same groups after."""
        size = self.degree(axis)
        if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1 or size % inner:
            raise ValueError(f"inner={inner!r} must be a positive divisor of the {axis} degree {size}")
        key = f"{axis}/{inner}"
        if key not in self._groups:
            others = [a for a in MESH_AXES if a != axis]

            def where(r: int) -> tuple:
                c = self.coordinates(r)
                return tuple(c[a] for a in others)

            inner_group = self.new_group(lambda r: (*where(r), self.coordinates(r)[axis] // inner))
            outer_group = self.new_group(lambda r: (*where(r), self.coordinates(r)[axis] % inner))
            self._groups[key] = (inner_group, outer_group)
        return self._groups[key]

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """Build the ``[pp, dp, cp, tp]`` DeviceMesh over the default process group (a collective call).

        ``device_type`` defaults to ``"cuda"`` when the default backend is NCCL, else ``"cpu"``.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call llmpar.init_distributed() first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was built for world size {self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
