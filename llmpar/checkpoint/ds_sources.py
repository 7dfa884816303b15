"""The checkpoints ``convert --to deepspeed | universal`` read (``ds_write.py``, ``ds_universal.py``), behind one
interface, :class:`Source`: the param groups and shapes, the optimizer's hyper-parameters and step, buffers, frozen
params, the run's counters / scheduler / client_state, and each param's fp32 master and Adam moments whole
(:meth:`Source.full`) or as a flat element range (:meth:`Source.piece`).

    _DeepSpeedSource   a DeepSpeed ZeRO checkpoint (``deepspeed_read.DeepSpeedCheckpoint``): pieces read from the
                       memory-mapped partitions that hold them
    _UniversalSource   a universal checkpoint (``universal_read.UniversalCheckpoint``): pieces of each param's mapped
                       file, the file released after each read (its pages leave the RSS)
    _LlmparSource      an llmpar checkpoint (``reshard.CheckpointReader``, tensor-parallel params merged), every shard
                       checked first; one whole param held at a time

``open_source(src, tag, source)`` picks one (``locate_universal``, ``ds_convert.locate``). Refused, naming what was
found: param groups at different step counts, a group count that differs between the param shapes and the
optimizer, an llmpar pipeline (pp > 1) source, an llmpar source of several param groups.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from llmpar.checkpoint import ds_check, ds_convert, files, metacheck, universal_read
from llmpar.checkpoint.deepspeed_read import DeepSpeedCheckpoint
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.reshard import CheckpointReader
from llmpar.checkpoint.universal_read import UniversalCheckpoint

CHUNK = 1 << 22  # elements of a universal source's mapped file resident at a time


class Source:
    """What the writer needs of a checkpoint: ``groups`` [[name]], ``shapes``, ``hyper`` [per group {lr, betas,
    eps, weight_decay}], :meth:`full`, ``step``, ``extras`` (buffers), ``frozen``, ``run`` (counters, scheduler,
    client_state, ds_config)."""

    groups: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    hyper: list[dict]
    step: float
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    counters: dict[str, Any]
    scheduler: Any
    client: dict
    ds_config: dict
    stage: int
    dp: int
    kind: str  # "deepspeed", "universal" or "llmpar"

    def full(self, name: str, key: str) -> torch.Tensor:
        raise NotImplementedError

    def piece(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of :meth:`full`'s flat view (a source reads only those when it can)."""
        return self.full(name, key).reshape(-1)[a:z]

    def piece_into(self, name: str, key: str, a: int, z: int, out: torch.Tensor) -> None:
        """:meth:`piece` copied into ``out`` (``z - a`` elements; a source may copy it without a copy of its own)."""
        out.copy_(self.piece(name, key, a, z).detach())


class _DeepSpeedSource(Source):
    kind = "deepspeed"

    def __init__(self, path: str) -> None:
        ck = self.ck = DeepSpeedCheckpoint(path)
        ds_check.validate(ck)
        shapes = ck.model.get("param_shapes") if ck.stage > 0 else [dict.fromkeys(ck.names)]
        self.groups = [list(g) for g in shapes]
        self.shapes = dict(ck.shapes)
        self.hyper = ck.param_groups()
        if len(self.hyper) != len(self.groups):
            raise CheckpointError(
                f"{path}: {len(self.groups)} param groups by param_shapes, {len(self.hyper)} "
                "in the optimizer state: cannot be written"
            )
        steps = {ck.step(g[0]) for g in self.groups if g}
        self.step = _one_step(steps, path)
        self.buffers, self.frozen = ck.buffers(), ck.frozen()
        self.counters, self.scheduler, self.client = ck.counters(), ck.scheduler(), ck.client_state()
        self.ds_config = dict(ck.model.get("ds_config") or {})
        self.stage, self.dp = max(ck.stage, 1), ck.dp

    def full(self, name: str, key: str) -> torch.Tensor:
        if key == "master" and not self.ck.has(name, "master"):
            key = "params"
        n = math.prod(self.shapes[name])
        return self.ck.read(name, key, 0, n).to(torch.float32)

    def piece(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        if key == "master" and not self.ck.has(name, "master"):
            key = "params"
        return self.ck.read(name, key, a, z).to(torch.float32)


class _UniversalSource(Source):
    """A universal checkpoint (``universal_read``): every param's files opened (memory-mapped) and checked."""

    kind = "universal"

    def __init__(self, path: str) -> None:
        ck = self.ck = UniversalCheckpoint(path)
        groups = ck.model.get("param_shapes")
        self.groups = [list(g) for g in groups] if isinstance(groups, list) and groups else [list(ck.names)]
        for n in ck.names:
            ck.open(n)
        self.shapes, self.aliases = dict(ck.shapes), dict(ck.aliases)
        self.hyper = ck.param_groups()
        if len(self.hyper) != len(self.groups):
            raise CheckpointError(
                f"{path}: {len(self.groups)} param groups by param_shapes, {len(self.hyper)} in "
                "zero/optimizer_state.pt: cannot be written"
            )
        self.step = _one_step({ck.step(n) for n in ck.names}, path)
        self.buffers, self.frozen = ck.buffers(), ck.frozen()
        self.counters, self.scheduler, self.client = ck.counters(), ck.scheduler(), ck.client_state()
        self.ds_config = dict(ck.model.get("ds_config") or {})
        self.stage, self.dp = min(max(ck.stage, 1), 3), ck.dp

    def full(self, name: str, key: str) -> torch.Tensor:
        return self.piece(name, key, 0, math.prod(self.shapes[name]))

    def piece(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        out = torch.empty(z - a, dtype=torch.float32)  # not a view of the mapped file
        self.piece_into(name, key, a, z, out)
        return out

    def piece_into(self, name: str, key: str, a: int, z: int, out: torch.Tensor) -> None:
        """Copied from the mapped file ``CHUNK`` elements at a time, the file released after each (its mapped pages
        leave the RSS): at most one chunk of it is resident beside ``out``."""
        if not self.ck.has(name, key):
            raise CheckpointError(f"universal checkpoint {self.ck.path} has no {key!r} of {name!r}")
        for b in range(a, z, CHUNK):
            e = min(b + CHUNK, z)
            out[b - a : e - a].copy_(self.ck.read(name, key, b, e).detach())  # saved as a param: no grad
            self.ck.release(name)


class _LlmparSource(Source):
    kind = "llmpar"

    def __init__(self, path: str) -> None:
        meta = metacheck.read(path)
        if int(meta.get("pp", 1)) > 1:
            raise CheckpointError(
                f"{path}: llmpar pipeline checkpoint (pp={meta['pp']}): DeepSpeed's ZeRO and "
                "universal layouts are written from pp=1 checkpoints only (load it at pp=1 and save)"
            )
        if len(meta["param_groups"]) != 1:
            raise CheckpointError(
                f"{path}: llmpar checkpoint of {len(meta['param_groups'])} param groups: which "
                "param is in which is not recorded; only one group is written to DeepSpeed's layout"
            )
        reader = self.reader = CheckpointReader(path, meta)
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None
        for fname in sorted(meta["files"]):
            why = reader.files.check(fname, full=True)
            if why is not None:
                raise CheckpointError(f"checkpoint shard {os.path.join(path, fname)} is {why}")
        self.keys = {name: meta["layout"]["buffers"][bi]["state_keys"] for name, (bi, _, _) in reader.where.items()}
        names = list(reader.where)
        self.groups, self.shapes = [names], {n: reader.full_shape(n) for n in names}
        self.hyper = [dict(meta["param_groups"][0], betas=tuple(meta["param_groups"][0]["betas"]))]
        self.step = _one_step({reader.step(n) for n in names}, path)
        self.buffers, self.frozen = reader.extras(reader.tp, 0), {}
        eng = meta["engine"]
        self.counters = {k: eng.get(k, 0) for k in ("global_steps", "global_samples", "skipped_steps")}
        self.scheduler, self.ds_config = meta["scheduler"], {}
        self.client = (
            files.load_file(os.path.join(path, files.CLIENT_STATE), mmap=False)
            if files.CLIENT_STATE in meta["files"]
            else {}
        )
        self.stage, self.dp = min(max(int(meta["stage"]), 1), 3), int(meta["dp"])

    def full(self, name: str, key: str) -> torch.Tensor:
        if key == "master" and key not in self.keys[name]:
            key = "params"
        if key not in self.keys[name]:
            raise CheckpointError(
                f"param {name!r} has no {key!r} in the llmpar checkpoint (saved: "
                f"{self.keys[name]}): an optimizer without Adam moments is not written"
            )
        if self._last is None or self._last[0] != (name, key):  # one param's whole tensor at a time
            self._last = ((name, key), self.reader.full(name, key).reshape(-1).to(torch.float32))
        return self._last[1]


def _one_step(steps: set[float], path: str) -> float:
    if len(steps) > 1:
        raise CheckpointError(f"{path}: param groups at different step counts {sorted(steps)}: DeepSpeed keeps one")
    return float(next(iter(steps), 0.0))


def locate_universal(src: str, tag: str | None, source: str) -> str | None:
    """The universal checkpoint ``src`` names (``universal_read.resolve``) when ``source`` is "auto" or
    "universal"; None otherwise; a CheckpointError naming what ``src`` holds when ``source`` is "universal" and it
    is not one."""
    if source not in ("auto", "universal"):
        return None
    path = universal_read.resolve(os.fspath(src), tag)
    if path is None and source == "universal":
        where = os.path.join(os.fspath(src), tag) if tag is not None else os.fspath(src)
        found = sorted(os.listdir(where))[:8] if os.path.isdir(where) else "nothing (no such directory)"
        raise CheckpointError(
            f"{where} is not a universal checkpoint (no zero/ folder beside a model states file, "
            f"and no latest_universal naming one): it holds {found}"
        )
    return path


def open_source(src: str, tag: str | None = None, source: str = "auto") -> Source:
    """The checkpoint ``src`` (universal, llmpar's or DeepSpeed's: ``locate_universal``, ``ds_convert.locate``) as
    the writers read it."""
    uni = locate_universal(src, tag, source)
    if uni is not None:
        return _UniversalSource(uni)
    kind, path = ds_convert.locate(src, tag, source)
    return _DeepSpeedSource(path) if kind == "deepspeed" else _LlmparSource(path)


__all__ = ["Source", "locate_universal", "open_source"]
