"""What a rank's checkpoint file holds, and cutting any saved layout back into named param ranges.

Rank file ``dp{d}-tp{t}.pt`` / ``pp{p}-dp{d}-tp{t}.pt`` (plain tensors, ``torch.load(weights_only=True)``-safe):

    "buffers": one dict per flat buffer of the optimizer (``CheckpointOptimizer.checkpoint_shards``), or None on a
               rank that holds no unique shard (stage 0, dp rank > 0):  "params" [partition] (the params' dtype),
               "exp_avg", "exp_avg_sq" [partition], "master" / "kahan_comp" [partition] when the mode has one, "steps"
               [units] float32;
               "holes" [n, 2] (start, count) when the elements of tied copies another pp rank writes were cut out
    "extras":  {name: tensor} module buffers and frozen params (dp rank 0 only; not in the optimizer)
    "rng":     this rank's torch / cuda / python / numpy RNG states

The partition of a buffer is the concat over units of this rank's shard of each unit (ZeRO's flat layout). Since a
param's offset inside its unit does not depend on the number of shards, element ``e`` of param ``name`` lives in
unit-relative position ``slot.offset + e``, i.e. in shard ``r = pos // shard`` at ``unit.shard_offset + pos - r *
shard`` of rank r's partition: :class:`ShardReader` serves any element range of any param from whatever layout was
saved (for one saved tp rank; ``reshard.py`` cuts across tp degrees). A pipeline checkpoint lists every pp rank's
buffers in one layout, each tagged with ``pp_rank`` and its ``index`` in that rank's file.
"""
from __future__ import annotations

import os
import random
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError, load_file, rank_file
from llmpar.checkpoint.protocol import CheckpointOptimizer

def local_buffers(opt: CheckpointOptimizer, skip: set[str] | frozenset = frozenset()) -> list[dict] | None:
    """This rank's shards of every flat buffer of ``opt`` (fresh CPU tensors, ``checkpoint_shards``), None if it owns
    none. ``skip``: names of params not to write (tied copies written by another pp rank): their elements are cut out
    of every state and their ``[start, count]`` in the partition listed under ``"holes"``."""
    shards = opt.checkpoint_shards()
    if shards is None:
        return None
    out = []
    for entry, held in zip(shards, opt.checkpoint_held()):
        steps = entry.pop("steps")
        holes = [(at, z - a) for name, a, z, at in held if name in skip]
        if holes:
            keep = torch.ones(entry["params"].numel(), dtype=torch.bool)
            for start, count in holes:
                keep[start:start + count] = False
            entry = {k: v[keep] for k, v in entry.items()}
            entry["holes"] = torch.tensor(sorted(holes), dtype=torch.int64)
        entry["steps"] = steps
        out.append(entry)
    return out


def _compacted(entry: dict, start: int) -> int:
    """Where partition offset ``start`` (outside every hole) is in a buffer written without its holes."""
    holes = entry.get("holes")
    if holes is None:
        return start
    return start - sum(count for at, count in holes.tolist() if at < start)


def extras_names(targets: dict[str, tuple[torch.Tensor, bool]], trained: set[str]) -> list[str]:
    """The names of the module state the optimizer does not hold: buffers and frozen params. ``targets``: {name:
    (tensor, is_param)} (``EngineView.targets``); ``trained``: the names the optimizer holds."""
    return [name for name, (t, is_param) in targets.items()
            if not (t.is_meta or (is_param and (name in trained or t.requires_grad or not t.numel())))]


def extras(targets: dict[str, tuple[torch.Tensor, bool]], trained: set[str]) -> dict[str, torch.Tensor]:
    """Host copies of that state (:func:`extras_names`)."""
    return {name: targets[name][0].detach().to("cpu", copy=True) for name in extras_names(targets, trained)}


def rng_state() -> dict:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _py_state(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        st["numpy"] = {"keys": torch.from_numpy(np.asarray(keys).astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
                       "gauss": float(gauss)}
    except ImportError:
        pass
    return st


def _py_state(state: tuple) -> dict:
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    if "numpy" in st:
        try:
            import numpy as np

            n = st["numpy"]
            np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                                 n["gauss"]))
        except ImportError:
            pass


class ShardReader:
    """Element ranges of named params (and their optimizer state) from a saved checkpoint, for one tp rank."""

    def __init__(self, path: str, meta: dict, tp_rank: int) -> None:
        self.path, self.meta, self.tp_rank = path, meta, tp_rank
        self.shards = 1 if meta["stage"] == 0 else meta["dp"]
        self.pp = int(meta.get("pp", 1))
        self.buffers = meta["layout"]["buffers"]
        self.where: dict[str, tuple[int, dict, dict]] = {}
        for bi, b in enumerate(self.buffers):
            for slot in b["params"]:
                if not slot.get("dup"):  # a tied copy also written by a lower stage
                    self.where.setdefault(slot["name"], (bi, slot, b["units"][slot["unit"]]))
        self._cache: dict[str, dict] = {}

    def file_of(self, dp_rank: int, bi: int) -> str:
        """The file of saved dp rank ``dp_rank`` holding buffer ``bi`` (of the pp rank that wrote it)."""
        return rank_file(dp_rank, self.tp_rank, self.buffers[bi].get("pp_rank", 0), self.pp)

    def numel(self, name: str) -> int:
        n = 1
        for d in self.where[name][1]["shape"]:
            n *= d
        return n

    def _pieces(self, name: str, a: int, z: int) -> list[tuple[int, int, int, int]]:
        """(old dp rank, start in its partition, count, start in the output) covering elements [a, z) of ``name``."""
        bi, slot, unit = self.where[name]
        n = unit["padded"] // self.shards
        lo, hi = slot["offset"] + a, slot["offset"] + z
        out = []
        while lo < hi:
            r = lo // n
            stop = min(hi, (r + 1) * n)
            out.append((r, unit["shard_offset"] + lo - r * n, stop - lo, lo - slot["offset"] - a))
            lo = stop
        return out

    def files_for(self, name: str, a: int, z: int) -> set[str]:
        bi = self.where[name][0]
        return {self.file_of(r, bi) for r, *_ in self._pieces(name, a, z)}

    def _file(self, fname: str) -> dict:
        if fname not in self._cache:
            obj = load_file(os.path.join(self.path, fname))
            if not isinstance(obj, dict) or obj.get("buffers") is None:
                raise CheckpointError(f"{os.path.join(self.path, fname)} holds no shards but the metadata says it does")
            self._cache[fname] = obj
        return self._cache[fname]

    def has(self, name: str, key: str) -> bool:
        return key in self.meta["layout"]["buffers"][self.where[name][0]]["state_keys"]

    def get(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements [a, z) of ``name``'s flat view, from state ``key`` ("params", "exp_avg", ...)."""
        bi = self.where[name][0]
        pieces = self._pieces(name, a, z)
        out = None
        for r, start, count, at in pieces:
            entry = self._file(self.file_of(r, bi))["buffers"][self.buffers[bi].get("index", bi)]
            pos = _compacted(entry, start)
            src = entry[key][pos:pos + count]
            if out is None:
                out = torch.empty(z - a, dtype=src.dtype)
            out[at:at + count] = src
        assert out is not None
        return out

    def step(self, name: str) -> float:
        """The step count saved for the unit holding ``name``."""
        bi, slot, _ = self.where[name]
        return float(self.meta["layout"]["buffers"][bi]["steps"][slot["unit"]])

    def extras_files(self) -> dict[str, str]:
        """{module buffer / frozen param name: the file holding it}."""
        if "extras" in self.meta:
            return {n: rank_file(0, self.tp_rank, pp_rank, self.pp) for n, pp_rank in self.meta["extras"].items()}
        return {"*": rank_file(0, self.tp_rank)}  # written before the names were recorded: dp rank 0's file

    def extras(self, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Module buffers and frozen params (``names`` only, when given)."""
        out: dict[str, torch.Tensor] = {}
        for fname in sorted(set(self.extras_files().values())):
            for n, t in self.file_any(fname).get("extras", {}).items():
                if names is None or n in names:
                    out.setdefault(n, t)
        return out

    def file_any(self, fname: str) -> dict:
        """The whole rank file ``fname`` (any rank's, with or without shards), read once."""
        if fname not in self._cache:
            self._cache[fname] = load_file(os.path.join(self.path, fname))
        return self._cache[fname]
