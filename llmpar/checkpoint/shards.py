"""What a rank's checkpoint file holds, and cutting any saved layout back into named param ranges.

Rank file ``dp{d}-tp{t}.shard`` / ``pp{p}-dp{d}-tp{t}.shard`` (``blockfile.py``; ``.pt``, a ``torch.save`` file, in
checkpoint formats 1-2):

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
from typing import Any, Callable

import torch

from llmpar.checkpoint.blockfile import BLOCK, BlockFile, Concat, CorruptFile, elements, materialize
from llmpar.checkpoint.files import CheckpointError, check_file, load_file, rank_file
from llmpar.checkpoint.protocol import CheckpointOptimizer, ShardViews


def local_buffers(
    opt: CheckpointOptimizer, skip: set[str] | frozenset = frozenset(), *, copy: bool = True
) -> list[dict] | None:
    """This rank's shards of every flat buffer of ``opt``, None if it owns none. ``copy``: fresh CPU tensors (an
    async save's snapshot); else, from an optimizer with ``checkpoint_shard_views``, the live memory itself (one
    tensor, or a :class:`blockfile.Concat` of the pieces a partition is made of: written as one record, no copy).
    ``skip``: names of params not to write (tied copies written by another pp rank): their elements are cut out of
    every state and their ``[start, count]`` in the partition listed under ``"holes"``."""
    if isinstance(opt, ShardViews):
        views = opt.checkpoint_shard_views()
    else:  # fresh tensors already
        shards, copy = opt.checkpoint_shards(), False
        views = None if shards is None else [{k: [v] for k, v in e.items()} for e in shards]
    if views is None:
        return None
    out = []
    for entry, held in zip(views, opt.checkpoint_held()):
        steps = Concat(entry.pop("steps")).tensor()
        holes = [(at, z - a) for name, a, z, at in held if name in skip]
        if holes:
            keep = torch.ones(sum(p.numel() for p in entry["params"]), dtype=torch.bool)
            for start, count in holes:
                keep[start : start + count] = False
            cut: dict = {k: Concat(v).tensor()[keep] for k, v in entry.items()}
            cut["holes"] = torch.tensor(sorted(holes), dtype=torch.int64)
        elif copy:
            cut = {k: Concat(v).tensor() for k, v in entry.items()}
        else:
            cut = {k: v[0] if len(v) == 1 else Concat(v) for k, v in entry.items()}
        cut["steps"] = steps
        out.append(cut)
    return out


def _compacted(entry: dict, start: int) -> int:
    """Where partition offset ``start`` (outside every hole) is in a buffer written without its holes."""
    holes = entry.get("holes")
    if holes is None:
        return start
    return start - sum(count for at, count in materialize(holes).tolist() if at < start)


def extras_names(targets: dict[str, tuple[torch.Tensor, bool]], trained: set[str]) -> list[str]:
    """The names of the module state the optimizer does not hold: buffers and frozen params. ``targets``: {name:
    (tensor, is_param)} (``EngineView.targets``); ``trained``: the names the optimizer holds."""
    return [
        name
        for name, (t, is_param) in targets.items()
        if not (t.is_meta or (is_param and (name in trained or t.requires_grad or not t.numel())))
    ]


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
        st["numpy"] = {
            "keys": torch.from_numpy(np.asarray(keys).astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
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
            np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
        except ImportError:
            pass


def _claim(slot: int, owner: bool, index: int, world: int) -> int:
    """Rank ``index``'s bid (of ``world``) to hash block ``slot``: the file's writer bids highest, the others in an
    order rotated by the slot (``world - (index - slot) mod world``), so that blocks no writer wants are spread."""
    return world + 1 if owner else world - (index - slot) % world


class RankFiles:
    """The rank files of one checkpoint, each opened once: format 3 block files (``blockfile.py``: size and index
    checked on open, each block verified when first read) or format 1-2 ``torch.save`` files (their whole sha256
    checked by :meth:`check`, then read through ``mmap``)."""

    def __init__(self, path: str, meta: dict) -> None:
        self.path, self.meta = path, meta
        self._trees: dict[str, Any] = {}  # file name -> its object (a block file's tensors: Records, read lazily)
        self._blocks: dict[str, BlockFile] = {}
        self._checked: set[str] = set()  # older files whose sha256 was checked
        self.recording = False

    def check(self, fname: str, *, full: bool = False) -> str | None:
        """None when ``fname`` is there and matches ``metadata.json``, else "missing" / "corrupt". A block file's
        size and index are checked (``full``: every block too; the others when read); an older file's sha256."""
        entry = self.meta["files"].get(fname)
        if entry is None or not os.path.isfile(os.path.join(self.path, fname)):
            return "missing"
        if "index_sha256" not in entry:
            if fname not in self._checked:
                why = check_file(self.path, fname, entry)
                if why is not None:
                    return why
                self._checked.add(fname)
            return None
        try:
            self.tree(fname)
            if full:
                self._blocks[fname].verify_all()
        except CorruptFile:
            return "corrupt"
        return None

    def tree(self, fname: str) -> dict:
        """The object rank file ``fname`` holds (tensors of a block file as lazy :class:`blockfile.Record`)."""
        if fname not in self._trees:
            full, entry = os.path.join(self.path, fname), self.meta["files"].get(fname, {})
            if "index_sha256" in entry:
                self._blocks[fname] = BlockFile(full, entry)
                self._blocks[fname].recording = self.recording
                self._trees[fname] = self._blocks[fname].value()
            else:
                self._trees[fname] = load_file(full)
        return self._trees[fname]

    # ------------------------------------------------------------------ sharing the hashing between ranks
    def record(self, on: bool) -> None:
        """While on, reads note the blocks they touch (``BlockFile.wanted``) instead of hashing them."""
        self.recording = on
        for f in self._blocks.values():
            f.recording = on

    def _slots(self) -> list[tuple[str, int, int]]:
        """(block file, first slot, slots) of every block file of ``metadata.json``, sorted by name: one slot per
        block of :data:`blockfile.BLOCK` bytes the size allows (the same on every rank, opened or not)."""
        out, at = [], 0
        for name in sorted(self.meta["files"]):
            entry = self.meta["files"][name]
            if "index_sha256" in entry:
                out.append((name, at, int(entry["bytes"]) // BLOCK + 1))
                at += out[-1][2]
        return out

    def claims(self, owns: Callable[[str], bool], index: int, world: int) -> torch.Tensor:
        """int64 per slot (:meth:`_slots`), for each block this rank wants, else 0: their max over the ranks names
        one verifier per block wanted (:meth:`_claim`)."""
        slots = self._slots()
        out = [0] * sum(n for *_, n in slots)
        for name, at, n in slots:
            f = self._blocks.get(name)
            if f is not None and f.block == BLOCK and len(f.digests) <= n:
                for k in f.wanted:
                    out[at + k] = _claim(at + k, owns(name), index, world)
        return torch.tensor(out, dtype=torch.int64)

    def verify_mine(self, top: torch.Tensor, owns: Callable[[str], bool], index: int, world: int) -> None:
        """Hash the blocks the max of the ranks' :meth:`claims` (``top``) gives this rank, and every wanted block
        of a file not shared (another block size); ``blockfile.CorruptFile`` when one differs."""
        slots, best = {name: (at, n) for name, at, n in self._slots()}, top.tolist()
        for name, f in self._blocks.items():
            at, n = slots.get(name, (0, 0))
            shared = f.block == BLOCK and len(f.digests) <= n
            f.verify_blocks(
                sorted(k for k in f.wanted if not shared or best[at + k] == _claim(at + k, owns(name), index, world))
            )

    def trust(self) -> None:
        """Once the ranks agreed that each verified its blocks: every wanted block is verified; recording stops."""
        for f in self._blocks.values():
            for k in f.wanted:
                f.verified[k] = 1
            f.wanted.clear()
        self.record(False)


class ShardReader:
    """Element ranges of named params (and their optimizer state) from a saved checkpoint, for one tp rank."""

    def __init__(self, path: str, meta: dict, tp_rank: int, files: RankFiles | None = None) -> None:
        self.path, self.meta, self.tp_rank = path, meta, tp_rank
        self.files = files if files is not None else RankFiles(path, meta)
        self.fmt = int(meta.get("format", 1))
        self.shards = 1 if meta["stage"] == 0 else meta["dp"]
        self.pp = int(meta.get("pp", 1))
        self.buffers = meta["layout"]["buffers"]
        self.where: dict[str, tuple[int, dict, dict]] = {}
        for bi, b in enumerate(self.buffers):
            for slot in b["params"]:
                if not slot.get("dup"):  # a tied copy also written by a lower stage
                    self.where.setdefault(slot["name"], (bi, slot, b["units"][slot["unit"]]))

    def file_of(self, dp_rank: int, bi: int) -> str:
        """The file of saved dp rank ``dp_rank`` holding buffer ``bi`` (of the pp rank that wrote it)."""
        return rank_file(dp_rank, self.tp_rank, self.buffers[bi].get("pp_rank", 0), self.pp, fmt=self.fmt)

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
        obj = self.files.tree(fname)
        if not isinstance(obj, dict) or obj.get("buffers") is None:
            raise CheckpointError(f"{os.path.join(self.path, fname)} holds no shards but the metadata says it does")
        return obj

    def has(self, name: str, key: str) -> bool:
        return key in self.meta["layout"]["buffers"][self.where[name][0]]["state_keys"]

    def _sources(self, name: str, key: str, a: int, z: int) -> list[tuple[torch.Tensor, int, int]]:
        """(elements, start in the output, count) covering elements [a, z) of ``name``'s state ``key``: views of
        the files (their blocks verified)."""
        bi = self.where[name][0]
        out = []
        for r, start, count, at in self._pieces(name, a, z):
            entry = self._file(self.file_of(r, bi))["buffers"][self.buffers[bi].get("index", bi)]
            pos = _compacted(entry, start)
            out.append((elements(entry[key], pos, pos + count), at, count))
        return out

    def verify(self, name: str, key: str, a: int, z: int) -> None:
        """Read (and so verify) the blocks holding elements [a, z) of ``name``'s state ``key``."""
        self._sources(name, key, a, z)

    def get(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements [a, z) of ``name``'s flat view, from state ``key`` ("params", "exp_avg", ...): a view of the
        file when one rank's file holds them all (read it, do not write it), else a fresh tensor."""
        parts = self._sources(name, key, a, z)
        if len(parts) == 1:
            return parts[0][0]
        out = torch.empty(z - a, dtype=parts[0][0].dtype)
        for src, at, count in parts:
            out[at : at + count] = src
        return out

    def step(self, name: str) -> float:
        """The step count saved for the unit holding ``name``."""
        bi, slot, _ = self.where[name]
        return float(self.meta["layout"]["buffers"][bi]["steps"][slot["unit"]])

    def extras_files(self) -> dict[str, str]:
        """{module buffer / frozen param name: the file holding it}."""
        if "extras" in self.meta:
            return {
                n: rank_file(0, self.tp_rank, pp_rank, self.pp, fmt=self.fmt)
                for n, pp_rank in self.meta["extras"].items()
            }
        return {"*": rank_file(0, self.tp_rank, fmt=self.fmt)}  # written before the names were recorded

    def extras(self, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Module buffers and frozen params (``names`` only, when given)."""
        out: dict[str, torch.Tensor] = {}
        for fname in sorted(set(self.extras_files().values())):
            for n, t in self.files.tree(fname).get("extras", {}).items():
                if names is None or n in names:
                    out.setdefault(n, materialize(t))
        return out

    def rng(self, fname: str) -> dict:
        """The RNG states in rank file ``fname``."""
        return materialize(self.files.tree(fname)["rng"])
