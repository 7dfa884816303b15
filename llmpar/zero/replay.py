"""The recording ``llmpar.zero.Init`` keeps (``deferred.py``) and its replay: :class:`Replayer` rebuilds recorded
storage ``s`` at version ``v`` from the last op of ``log[:v]`` that rewrote all of ``s`` without reading it (its
producer, or ``normal_`` / ``copy_`` / ``fill_``... over the whole storage: a Linear's ``kaiming_uniform_`` that HF's
``normal_`` overwrites is never replayed), then runs the rest in order, random ops with their saved generator state,
inputs rebuilt at the versions they were read at."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Kept", "Op", "Ref", "Replayer", "Storage", "covers", "geometry", "needed_ops", "view_of"]


@dataclasses.dataclass(frozen=True)
class Ref:
    """A tensor built in the block, as an op saw it: a view of recorded storage ``key`` after ``version`` ops."""

    key: int
    version: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass(frozen=True)
class Kept:
    """A real tensor read by an op recorded after the block (``after_init.py``: a loaded state dict), held by
    reference, not copied, with its version counter at the time: changed in place since, its values are gone."""

    tensor: torch.Tensor
    version: int

    def changed(self) -> bool:
        return self.tensor._version != self.version

    def get(self) -> torch.Tensor:
        if self.changed():
            raise ValueError(
                f"a tensor {tuple(self.tensor.shape)} written into a param of a model built under "
                "llmpar.zero.Init (after the block) was changed in place before llmpar.initialize read "
                "it: write a tensor you leave alone until initialize (or a .clone())"
            )
        return self.tensor.detach()


@dataclasses.dataclass
class Op:
    """One recorded op. ``flat``/``spec``: its arguments (Refs for recorded tensors, copies of real ones); ``view``:
    the output it produced or the view it wrote; ``target``: the index in ``flat`` of the tensor written (None: a
    producer, whose output ``out`` of the flattened outputs is the storage); ``rng``: the generator drawn from and
    its state before the op; ``fresh``: the op rewrites the whole storage without reading it."""

    func: Any
    flat: list
    spec: Any
    view: Ref
    target: int | None
    out: int
    rng: tuple[torch.Generator, torch.Tensor] | None
    fresh: bool


@dataclasses.dataclass
class Storage:
    """One recorded storage: its ops in order (``log[0]`` its producer)."""

    base: torch.Tensor  # a meta tensor keeping the meta storage (and so its key) alive
    device: torch.device  # where a plain build would have had it
    nbytes: int
    log: list[Op]


def geometry(t: torch.Tensor, key: int, version: int) -> Ref:
    """``t`` as a view of storage ``key`` at ``version``."""
    return Ref(key, version, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


def view_of(storage: torch.UntypedStorage, ref: Ref, device: torch.device) -> torch.Tensor:
    """The tensor ``ref`` describes, over ``storage`` (a real one holding that recorded storage's bytes)."""
    return torch.empty(0, dtype=ref.dtype, device=device).set_(storage, ref.offset, ref.size, ref.stride)


def covers(t: torch.Tensor, nbytes: int) -> bool:
    """``t`` is every element of a storage of ``nbytes`` bytes, each once (any dim order)."""
    if t.storage_offset() != 0 or t.numel() * t.element_size() != nbytes:
        return False
    expect = 1
    for stride, size in sorted((s, d) for d, s in zip(t.shape, t.stride()) if d != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _start(log: list[Op], version: int) -> int:
    """The op a replay of ``log[:version]`` starts from: the last one rewriting the whole storage."""
    return max(i for i in range(version) if log[i].fresh)


def needed_ops(storages: dict[int, Storage], refs: list[Ref]) -> set[tuple[int, int]]:
    """(storage key, op index) of every op replaying ``refs`` runs, inputs included."""
    runs: set[tuple[int, int]] = set()
    todo, seen = [(r.key, r.version) for r in refs], set()
    while todo:
        k, v = todo.pop()
        if (k, v) in seen:
            continue
        seen.add((k, v))
        log = storages[k].log
        for i in range(_start(log, v), v):
            runs.add((k, i))
            todo.extend(
                (x.key, x.version) for j, x in enumerate(log[i].flat) if isinstance(x, Ref) and j != log[i].target
            )  # the storage written: being built
    return runs


class Recording(Protocol):
    """What a :class:`Replayer` reads of ``deferred.Recorder`` (not imported: deferred.py imports this module)."""

    storages: dict[int, Storage]


class Replayer:
    """Rebuilds recorded tensors for real (module docstring). One per param or batch of buffers: it keeps every
    storage it built (``memo``) until dropped."""

    def __init__(self, recorder: Recording, base: dict[int, tuple[int, torch.UntypedStorage]] | None = None) -> None:
        self.storages = recorder.storages
        self.memo: dict[tuple[int, int], torch.UntypedStorage] = {}
        self.base = base or {}  # storage key -> (version, its bytes at that version): replays start there

    def storage_copy(self, ref: Ref) -> torch.UntypedStorage:
        """A new real storage holding ``ref``'s whole recorded storage at ``ref.version`` (the caller's to write)."""
        st = self._storage(ref.key, ref.version)
        out = torch.empty(st.nbytes(), dtype=torch.uint8, device=self.storages[ref.key].device).untyped_storage()
        out.copy_(st)
        return out

    def value(self, ref: Ref, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``ref`` stands for. ``into``: a tensor of the same geometry, dtype and device covering its
        storage, rebuilt in place when the replay starts with an in-place op (no second copy of a param)."""
        s = self.storages[ref.key]
        fits = (
            into is not None
            and into.dtype == ref.dtype
            and into.device == s.device
            and covers(into, s.nbytes)
            and geometry(into, ref.key, ref.version) == ref
        )
        given = into.untyped_storage() if fits and into is not None else None
        return view_of(self._storage(ref.key, ref.version, given), ref, s.device)

    def _storage(self, key: int, version: int, into: torch.UntypedStorage | None = None) -> torch.UntypedStorage:
        got = self.memo.get((key, version))
        if got is not None:
            return got
        s = self.storages[key]
        start = _start(s.log, version)
        given = self.base.get(key)
        if given is not None and start < given[0] <= version:  # the bytes at version given[0] are known
            st = (
                into
                if into is not None
                else torch.empty(s.nbytes, dtype=torch.uint8, device=s.device).untyped_storage()
            )
            st.copy_(given[1])
            for op in s.log[given[0] : version]:
                self._run(op, st, s.device)
            self.memo[(key, version)] = st
            return st
        first = s.log[start]
        if first.target is None:
            o = tree_flatten(self._run(first, None, s.device))[0][first.out]
            st = o.untyped_storage()
            if st.nbytes() != s.nbytes or geometry(o, key, 0) != first.view:
                st = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device).untyped_storage()
                view_of(st, first.view, s.device).copy_(o)
        else:
            st = (
                into
                if into is not None
                else torch.empty(s.nbytes, dtype=torch.uint8, device=s.device).untyped_storage()
            )
            self._run(first, st, s.device)
        for op in s.log[start + 1 : version]:
            self._run(op, st, s.device)
        self.memo[(key, version)] = st
        return st

    def _run(self, op: Op, st: torch.UntypedStorage | None, device: torch.device) -> Any:
        target = None
        if op.target is not None:
            assert st is not None  # an op writing into a recorded storage replays into its bytes (``_storage``)
            target = view_of(st, op.view, device)
        flat = [
            target if i == op.target else self.value(x) if isinstance(x, Ref) else x.get() if isinstance(x, Kept) else x
            for i, x in enumerate(op.flat)
        ]
        args, kwargs = tree_unflatten(flat, op.spec)
        with torch.no_grad():
            if op.rng is None:
                return op.func(*args, **kwargs)
            gen, state = op.rng
            saved = gen.get_state()
            gen.set_state(state)
            try:
                return op.func(*args, **kwargs)
            finally:
                gen.set_state(saved)
