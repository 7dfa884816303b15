"""Tensor-parallel resharding: any saved tp degree cut for any other.

A tensor-parallel param is split along one dim (``p.partition_dim``: 0 for column / vocab layers, 1 for row layers)
into ``tp`` equal chunks of a *padded* size: a vocabulary of ``V`` rows is padded with zero rows to
``V_pad = ceil(V / tp) * tp``. ``metadata.json`` records per param ``"tp": {"dim", "full", "padded"}`` (None when
replicated), so the full tensor is

    full = cat(shard_0, ..., shard_{tp-1}, dim)[:full along dim]        (padding dropped)

and rank r of a run at tp' with padded size P' keeps ``pad(full, P' along dim)[r * P'/tp' : (r + 1) * P'/tp']``
(new padding zero). :class:`CheckpointReader` serves any element range of that local slice, reading only the saved
tp ranks whose chunks overlap it; replicated params come from tp rank 0's files (the own tp rank's when the saved tp
equals this run's, which keeps a same-layout load bitwise). Optimizer states (``exp_avg``, ``exp_avg_sq``,
``master``, ...) are cut exactly like the params.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmpar.checkpoint.experts import ExpertIndex
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.shards import RankFiles, ShardReader

UNKNOWN = "unknown"  # a tp > 1 checkpoint written before the split was recorded: loadable at the same tp only


def tp_specs(module: nn.Module, tp: int) -> dict[int, dict | None]:
    """{id(param): {"dim", "full", "padded"} or None (replicated)} for ``module``'s params. The padding comes from the
    owning layer (``padded_out_features`` / ``padded_num_embeddings``); a split param of an unknown layer gets
    ``"padded": None`` (the caller takes ``local size * tp``, no padding)."""
    out: dict[int, dict | None] = {}
    for m in module.modules():
        for _, p in m.named_parameters(recurse=False):
            dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
            if dim is None:
                out.setdefault(id(p), None)
                continue
            full = padded = None
            if dim == 0 and hasattr(m, "padded_num_embeddings"):
                full, padded = m.num_embeddings, m.padded_num_embeddings
            elif dim == 0 and hasattr(m, "padded_out_features"):
                full, padded = m.out_features, m.padded_out_features
            elif dim == 1 and hasattr(m, "in_features_per_rank"):
                full, padded = m.in_features, m.in_features
            out[id(p)] = {"dim": int(dim), "full": full, "padded": padded}
    return out


def full_shape(shape: Any, spec: dict | None) -> tuple[int, ...]:
    """The unsplit, unpadded shape of a param whose local shape is ``shape``."""
    out = [int(d) for d in shape]
    if isinstance(spec, dict):
        out[spec["dim"]] = spec["full"]
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Cut:
    """How a live param is held here: its local ``shape``, its ``spec`` (None: replicated) at ``tp`` on ``rank``."""

    shape: tuple[int, ...]
    spec: dict | None
    tp: int
    rank: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class CheckpointReader:
    """Named params and optimizer states of a saved checkpoint, cut for this rank's layout (module docstring)."""

    def __init__(self, path: str, meta: dict) -> None:
        self.path, self.meta, self.tp = path, meta, int(meta["tp"])
        self.files = RankFiles(path, meta)  # every rank file, opened once
        self.readers = [ShardReader(path, meta, t, self.files) for t in range(self.tp)]
        self.where = self.readers[0].where
        self._cache: tuple[tuple, torch.Tensor] | None = None
        self.experts = ExpertIndex(self.files, meta)  # an expert-parallel run's experts, by global name
        self.experts.open()

    def holds(self, name: str) -> bool:
        """Whether the checkpoint holds param ``name`` (in its dense buffers or as expert pieces)."""
        return name in self.where or name in self.experts

    def unsplit(self, name: str, tp: int, tp_rank: int) -> Cut:
        """How a rank at (``tp``, ``tp_rank``) holding ``name`` whole (not split over tp) cuts it."""
        return Cut(shape=self.full_shape(name), spec=None, tp=tp, rank=tp_rank)

    def _expert(self, name: str) -> bool:
        return name not in self.where and name in self.experts

    # ------------------------------------------------------------------ layout
    def spec(self, name: str) -> dict | None | str:
        if self._expert(name):
            return None
        slot = self.where[name][1]
        if "tp" not in slot:
            return UNKNOWN if self.tp > 1 else None
        return slot["tp"]

    def shape(self, name: str) -> tuple[int, ...]:
        if self._expert(name):
            return self.experts.shapes[name]
        return tuple(self.where[name][1]["shape"])

    def full_shape(self, name: str) -> tuple[int, ...]:
        spec = self.spec(name)
        if spec == UNKNOWN:
            raise CheckpointError(
                f"{self.path} (tp={self.tp}) does not record how {name!r} is split over tp: it "
                "loads at the same tp only"
            )
        return full_shape(self.shape(name), spec)  # type: ignore[arg-type]

    def check(self, name: str, cut: Cut) -> None:
        """Raise a CheckpointError naming ``name`` when the saved param cannot be cut into ``cut``."""
        saved, spec = self.shape(name), self.spec(name)
        if cut.tp == self.tp and (spec == UNKNOWN or spec == cut.spec):
            if saved != cut.shape:
                raise CheckpointError(f"param {name!r} has shape {cut.shape} here but {saved} in {self.path}")
            return
        here = full_shape(cut.shape, cut.spec)
        there = self.full_shape(name)
        if here != there:
            raise CheckpointError(
                f"param {name!r} has full shape {here} here (tp={cut.tp}) but {there} in "
                f"{self.path} (tp={self.tp}): it cannot be resharded"
            )
        if isinstance(spec, dict) and cut.spec is not None and spec["dim"] != cut.spec["dim"]:
            raise CheckpointError(
                f"param {name!r} is split along dim {cut.spec['dim']} here but along dim "
                f"{spec['dim']} in {self.path}: it cannot be resharded"
            )

    def _route(self, name: str, cut: Cut) -> tuple[int, ...]:
        """``(t,)``: read the same elements from saved tp rank t; ``(dim, lo, hi)``: rows [lo, hi) along ``dim`` of
        the full tensor (zero beyond its size), reshaped to ``cut.shape``."""
        spec = self.spec(name)
        if cut.tp == self.tp and (spec == UNKNOWN or spec == cut.spec):
            return (cut.rank,)
        if spec is None and cut.spec is None:
            return (0,)
        if cut.spec is not None:
            dim, chunk = cut.spec["dim"], cut.spec["padded"] // cut.tp
            return dim, cut.rank * chunk, (cut.rank + 1) * chunk
        full = self.full_shape(name)  # raises for a split the checkpoint did not record
        assert isinstance(spec, dict)
        return spec["dim"], 0, full[spec["dim"]]

    def _sources(self, name: str, dim: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(saved tp rank, start, stop along ``dim`` of its local shard) covering [lo, min(hi, full))."""
        spec = self.spec(name)
        if not isinstance(spec, dict):
            stop = min(hi, self.shape(name)[dim])
            return [(0, lo, stop)] if lo < stop else []
        c, stop = self.shape(name)[dim], min(hi, spec["full"])
        return (
            [(t, max(lo, t * c) - t * c, min(stop, (t + 1) * c) - t * c) for t in range(lo // c, -(-stop // c))]
            if lo < stop
            else []
        )

    # ------------------------------------------------------------------ reads
    def files_for(self, name: str, a: int, z: int, cut: Cut) -> set[str]:
        """The files holding elements [a, z) of ``name`` as ``cut`` holds it."""
        if self._expert(name):
            return self.experts.files_for(name, a, z)
        route = self._route(name, cut)
        if len(route) == 1:
            return self.readers[route[0]].files_for(name, a, z)
        out: set[str] = set()
        for t, _, _ in self._sources(name, *route):
            out |= self.readers[t].files_for(name, 0, self.readers[t].numel(name))
        return out

    def has(self, name: str, key: str) -> bool:
        if self._expert(name):
            return self.experts.has(name, key)
        return self.readers[0].has(name, key)

    def step(self, name: str) -> float:
        """The step count saved for the unit holding ``name``."""
        if self._expert(name):
            return self.experts.step(name)
        return float(self.readers[0].step(name))

    def rng(self, fname: str) -> dict:
        """The RNG states in saved rank file ``fname``."""
        return self.readers[0].rng(fname)

    def verify(self, name: str, key: str, a: int, z: int, cut: Cut) -> None:
        """Verify the blocks :meth:`get` reads for the same arguments (a ``blockfile.CorruptFile`` if one differs),
        copying nothing."""
        if self._expert(name):
            self.experts.get(name, key, a, z)
            return
        route = self._route(name, cut)
        if len(route) == 1:
            self.readers[route[0]].verify(name, key, a, z)
            return
        for t, _, _ in self._sources(name, *route):
            self.readers[t].verify(name, key, 0, self.readers[t].numel(name))

    def get(self, name: str, key: str, a: int, z: int, cut: Cut) -> torch.Tensor:
        """Elements [a, z) of this rank's ``cut`` of ``name`` (state ``key``: "params", "exp_avg", ...), flat."""
        if self._expert(name):
            return self.experts.get(name, key, a, z)
        route = self._route(name, cut)
        if len(route) == 1:
            return self.readers[route[0]].get(name, key, a, z)
        ck = (name, key, route)
        if self._cache is None or self._cache[0] != ck:
            self._cache = (ck, self._along(name, key, *route).reshape(-1))
        return self._cache[1][a:z]

    def _along(self, name: str, key: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        shape, parts = self.shape(name), []
        for t, a, z in self._sources(name, dim, lo, hi):
            shard = self.readers[t].get(name, key, 0, self.readers[t].numel(name)).view(shape)
            parts.append(shard.narrow(dim, a, z - a))
        have = sum(p.shape[dim] for p in parts)
        if have < hi - lo:  # padding rows of this run's layout
            pad = list(shape)
            pad[dim] = hi - lo - have
            like = parts[0] if parts else self.readers[0].get(name, key, 0, 1)
            parts.append(torch.zeros(pad, dtype=like.dtype))
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0].contiguous()

    def full(self, name: str, key: str) -> torch.Tensor:
        """The whole unpadded tensor of ``name`` (state ``key``) in its full shape."""
        shape = self.full_shape(name)
        if self._expert(name):
            return self.experts.get(name, key, 0, math.prod(shape)).view(shape)
        cut = Cut(shape=shape, spec=None, tp=1, rank=0)
        route = self._route(name, cut)
        if len(route) == 1:
            return self.readers[route[0]].get(name, key, 0, cut.numel).view(shape)
        return self._along(name, key, *route).view(shape)

    def _extras_reader(self, tp: int, tp_rank: int) -> ShardReader:
        return self.readers[tp_rank if tp == self.tp else 0]

    def extras_files(self, tp: int, tp_rank: int) -> dict[str, str]:
        """{module buffer / frozen param name: file} a rank at (``tp``, ``tp_rank``) reads it from."""
        return self._extras_reader(tp, tp_rank).extras_files()

    def extras(self, tp: int, tp_rank: int, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Module buffers and frozen params: the own tp rank's copies when the saved tp equals ``tp``, else tp rank
        0's."""
        return self._extras_reader(tp, tp_rank).extras(names)
