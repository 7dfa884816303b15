"""What a rank's checkpoint file holds, and cutting any saved layout back into named param ranges.

Rank file ``dp{d}-tp{t}.pt`` (a dict of plain tensors, ``torch.load(weights_only=True)``-safe):

    "buffers": one dict per flat buffer of ``ZeroOptimizer.describe()``, or None on a rank that holds no unique shard
               (stage 0, dp rank > 0):  "params" [partition] (the params' dtype), "exp_avg", "exp_avg_sq"
               [partition], "master" / "kahan_comp" [partition] when the mode has one, "steps" [units] float32
    "extras":  {name: tensor} module buffers and frozen params (dp rank 0 only; not in the optimizer)
    "rng":     this rank's torch / cuda / python / numpy RNG states

The partition of a buffer is the concat over units of this rank's shard of each unit (``layout.py``). Since a param's
offset inside its unit does not depend on the number of shards, element ``e`` of param ``name`` lives in unit-relative
position ``slot.offset + e``, i.e. in shard ``r = pos // shard`` at ``unit.shard_offset + pos - r * shard`` of rank r's
partition: :class:`ShardReader` serves any element range of any param from whatever layout was saved.
"""
from __future__ import annotations

import os
import random
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError, load_file, rank_file

STATE_FALLBACK = {"master": "params", "kahan_comp": None}  # a state key missing from the checkpoint: derive or zero


def local_buffers(opt: Any) -> list[dict] | None:
    """This rank's shards of every flat buffer of ZeroOptimizer ``opt`` (fresh CPU tensors), None if it owns none."""
    rank = opt.rank if opt.stage > 0 else 0
    if opt.stage == 0 and opt.rank != 0:
        return None
    out = []
    for b in opt.buffers:
        units = range(len(b.layout.units))
        if b.shard is not None:
            params = b.shard.detach().to("cpu", copy=True)
        else:
            params = torch.cat([b.layout.shard_of_full(b.flat, u, rank).detach().cpu() for u in units])
        entry = {"params": params, "steps": torch.stack([s.detach().float().cpu() for s in b.steps])}
        for key, t in b.state.items():
            entry[key] = t.detach().to("cpu", copy=True)
        out.append(entry)
    return out


def extras(module: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Module state the optimizer does not hold: buffers and frozen params."""
    trained = {b.layout.slot(i).name for b in opt.buffers for i in range(len(b.params))}
    out = {}
    for name, p in module.named_parameters():
        if name not in trained and not p.requires_grad and p.numel() and not p.is_meta:
            out[name] = p.detach().to("cpu", copy=True)
    for name, t in module.named_buffers():
        if t is not None and not t.is_meta:
            out[name] = t.detach().to("cpu", copy=True)
    return out


def rng_state() -> dict:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _py_state(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        st["numpy"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
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
        self.where: dict[str, tuple[int, dict, dict]] = {}
        for bi, b in enumerate(meta["layout"]["buffers"]):
            for slot in b["params"]:
                self.where[slot["name"]] = (bi, slot, b["units"][slot["unit"]])
        self._cache: dict[str, dict] = {}

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
        return {rank_file(r, self.tp_rank) for r, *_ in self._pieces(name, a, z)}

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
            src = self._file(rank_file(r, self.tp_rank))["buffers"][bi][key][start:start + count]
            if out is None:
                out = torch.empty(z - a, dtype=src.dtype)
            out[at:at + count] = src
        assert out is not None
        return out

    def step(self, name: str) -> torch.Tensor:
        bi, slot, _ = self.where[name]
        return self.meta["layout"]["buffers"][bi]["steps"][slot["unit"]]

    def extras(self) -> dict[str, torch.Tensor]:
        return self._file_any(rank_file(0, self.tp_rank)).get("extras", {})

    def _file_any(self, fname: str) -> dict:
        if fname not in self._cache:
            self._cache[fname] = load_file(os.path.join(self.path, fname))
        return self._cache[fname]
