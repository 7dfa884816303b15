"""HuggingFace safetensors weights (what ``save_pretrained`` writes) loaded straight into an initialized engine's
parallel layout, each rank reading only its own slices:

    engine, *_ = llmpar.initialize(model=model, config={..., "tensor_parallel": {"size": 2},
                                                       "zero_optimization": {"stage": 3}})
    stats = llmpar.checkpoint.load_hf_weights(engine, "path/to/hf_dir")   # collective over the engine's ranks

Each param of this rank is named as in the unsplit model (``view.py``); its tensor-parallel cut (``reshard.py``'s
spec: dim, full and padded size) and, under ZeRO-3, the element ranges ``[a, z)`` of that cut this rank's shard holds
(the optimizer's ``load_pieces``) are read with ``safe_open(file).get_slice(name)[rows, cols]``: the rows of the cut
covering ``[a, z)`` (at most one row more on either side) and, for a param split along dim 1, only this rank's
columns. Padding rows / columns of a padded split (vocab) are zeros. No rank ever reads a whole tensor it does not
hold, nor the whole model: bytes read per rank <= its shard + two rows per piece (``stats["bytes_read"]``); the files
are closed after every ``REOPEN`` bytes read, so the pages mapped to read them (a column slice maps whole rows) leave
the process's RSS.

A pipeline engine (pp > 1, any tp and dp its stages run) loads the same way: each rank reads its stage's params
only, found by their names in the unsplit model (``engine.checkpoint_names``), a weight tied across stages (the
last stage's head tied to the embedding) read by each stage holding it from the one tensor the files have.

Module buffers and frozen params found in the files are read whole (small: norms' buffers). The optimizer's state
restarts: moments zero, step 0, fp32 masters from the weights read (a load of pretrained weights, not a resume).
Every rank checks the files first (every param present with its full shape; with ``strict``, nothing in the files
that no rank's model holds) and the ranks agree before anything is modified; an error names the param and file.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.protocol import Checkpointable, DescribesModel
from llmpar.checkpoint.reshard import Cut, full_shape
from llmpar.checkpoint.shards import extras_names
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")


def safe_open(path: str, framework: str = "pt") -> Any:
    """``safetensors.safe_open`` (imported when first used: safetensors is optional), a clear ImportError without."""
    try:
        import safetensors
    except ImportError as e:
        raise ImportError(
            f"loading HuggingFace weights needs the safetensors package ({e}): pip install safetensors"
        ) from e
    return safetensors.safe_open(path, framework=framework)


REOPEN = 64 << 20  # bytes read before the open files are closed (their mapped pages let go)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def weight_files(path: str) -> dict[str, str]:
    """{tensor name: safetensors file} of ``path``: a directory with ``model.safetensors`` or the sharded
    ``model.safetensors.index.json`` (``save_pretrained``'s layout), or one ``.safetensors`` file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a directory or a .safetensors file, got {type(path).__name__}")
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        with safe_open(path, framework="pt") as f:
            return {n: path for n in f.keys()}
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map' of tensor names to files")
        out = {n: os.path.join(path, f) for n, f in weight_map.items()}
        gone = sorted({f for f in out.values() if not os.path.isfile(f)})
        if gone:
            raise CheckpointError(f"{index} names files that are missing: {gone[:4]}")
        return out
    if os.path.isfile(single):
        return weight_files(single)
    found = sorted(os.listdir(path))[:8] if os.path.isdir(path) else "nothing (no such directory)"
    raise CheckpointError(
        f"path={path!r} is not HuggingFace safetensors weights (model.safetensors, or "
        f"model.safetensors.index.json with its shards): it holds {found}"
    )


class SliceReader:
    """Reads pieces of tensors from safetensors files (kept open, memory-mapped), counting the bytes it reads."""

    def __init__(self, where: dict[str, str]) -> None:
        self.where = where
        self._open: dict[str, Any] = {}
        self.bytes_read = 0
        self.largest_read = 0
        self._since = 0

    def _file(self, name: str) -> Any:
        path = self.where[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def header(self, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        """Shape and dtype of ``name`` as stored (no data read)."""
        s = self._file(name).get_slice(name)
        return tuple(int(d) for d in s.get_shape()), _DTYPES.get(s.get_dtype())

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.bytes_read += n
        self.largest_read = max(self.largest_read, n)
        self._since += n
        if self._since > REOPEN:  # close the files: the mapped pages read so far leave this process's RSS
            self._open.clear()
            self._since = 0
        return t

    def whole(self, name: str) -> torch.Tensor:
        return self._count(self._file(name).get_tensor(name))

    def piece(self, name: str, cut: Cut, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of the flat view of this rank's cut (``cut.shape``) of tensor ``name``."""
        shape = cut.shape
        if len(shape) == 0:
            return self.whole(name).reshape(-1)[a:z]
        inner = math.prod(shape[1:])
        r0, r1 = a // inner, -(-z // inner)
        spec = cut.spec
        if spec is None:
            rows = self._count(self._file(name).get_slice(name)[r0:r1])
        else:
            dim, chunk, full = spec["dim"], spec["padded"] // cut.tp, spec["full"]
            lo = cut.rank * chunk
            if dim == 0:  # rows [lo + r0, lo + r1) of the full tensor, those past ``full`` are padding
                got = self._count(self._file(name).get_slice(name)[min(lo + r0, full) : min(lo + r1, full)])
                rows = _pad(got, 0, r1 - r0)
            else:
                index = (slice(r0, r1),) + (slice(None),) * (dim - 1) + (slice(min(lo, full), min(lo + chunk, full)),)
                rows = _pad(self._count(self._file(name).get_slice(name)[index]), dim, chunk)
        return rows.reshape(-1)[a - r0 * inner : z - r0 * inner]


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to ``size`` (a padded split's padding)."""
    if t.shape[dim] >= size:
        return t
    pad = list(t.shape)
    pad[dim] = size - t.shape[dim]
    return torch.cat([t, torch.zeros(pad, dtype=t.dtype)], dim)


class _Slices:
    """``load_pieces``' fetch: this rank's pieces of each param from the files, the last piece kept for the
    "master" fallback (read once); moments zero."""

    def __init__(self, reader: SliceReader, view: EngineView) -> None:
        self.reader, self.view = reader, view
        g, specs = view.grid, view.specs()
        self.cuts = {n: Cut(shape=s, spec=specs[n], tp=g.tp, rank=g.tp_rank) for n, s in view.shapes().items()}
        self._last: tuple[tuple[str, int, int], torch.Tensor] | None = None

    def check(self, local: str) -> None:
        name, cut = self.view.saved_name[local], self.cuts[local]
        if name not in self.reader.where:
            raise CheckpointError(
                f"param {name!r} of this model is not in the HuggingFace weights (files "
                f"{sorted(set(self.reader.where.values()))[:3]})"
            )
        here, (there, _) = full_shape(cut.shape, cut.spec), self.reader.header(name)
        if here != there:
            raise CheckpointError(
                f"param {name!r} has full shape {here} here (tp={cut.tp}) but {there} in {self.reader.where[name]}"
            )

    def get(self, local: str, key: str, a: int, z: int) -> torch.Tensor | None:
        if key == "master":
            return None  # derived from "params" (the piece just read)
        if key != "params":
            return torch.zeros(z - a)  # a fresh optimizer state
        if self._last is None or self._last[0] != (local, a, z):
            self._last = ((local, a, z), self.reader.piece(self.view.saved_name[local], self.cuts[local], a, z))
        return self._last[1]


def load_hf_weights(engine: Checkpointable, path: str, *, strict: bool = True) -> dict[str, int]:
    """Load HuggingFace safetensors weights ``path`` into ``engine`` (module docstring); collective over the engine's
    ranks. Returns this rank's ``{"bytes_read", "largest_read", "tensors"}``."""
    if not all(hasattr(engine, a) for a in ("optimizer", "checkpoint_grid", "checkpoint_names")):
        raise TypeError(f"load_hf_weights takes the engine llmpar.initialize returned, got {type(engine).__name__}")
    view = EngineView(engine)
    g, opt = view.grid, engine.optimizer
    extras: dict[str, Any] = {}
    with files.agreed(g, "load_hf_weights"):
        where = weight_files(path)
        src = _Slices(SliceReader(where), view)
        for b in view.layout:
            for slot in b["params"]:
                src.check(slot["name"])
        targets, frozen = view.targets(), opt.frozen_shapes()
        unsaved = (
            set(engine.checkpoint_model().get("unsaved_buffers", ())) if isinstance(engine, DescribesModel) else set()
        )
        for name in set(extras_names(targets, set(view.saved_name.values()) | set(frozen))) | set(frozen):
            if name in unsaved or name not in where:
                continue  # a buffer the files lack keeps its value (HF writes no non-persistent buffers)
            shape = frozen.get(name, tuple(targets[name][0].shape) if name in targets else None)
            if src.reader.header(name)[0] != tuple(shape or ()):
                raise CheckpointError(
                    f"{name!r} has shape {src.reader.header(name)[0]} in {where[name]} and {shape} here"
                )
            extras[name] = shape
    view.unexpected(
        sorted(where),
        strict=strict,
        where=f"the HuggingFace weights {path}",
        show=lambda n: str(n[:8]),
        noun="tensors",
        call="load_hf_weights",
    )
    with files.all_or_mixed(g, path, "weights"):  # agreed before the stage-3 re-gather: no rank waits alone
        opt.load_pieces(src.get, lambda local: 0.0)
        view.put_extras({name: src.reader.whole(name) for name in extras})
    opt.after_load()
    if g.rank0:
        logger.info(
            "loaded HuggingFace weights %s at pp=%d dp=%d tp=%d stage %d: %d bytes read on rank 0",
            path,
            g.pp,
            g.dp,
            g.tp,
            opt.stage,
            src.reader.bytes_read,
        )
    return {"bytes_read": src.reader.bytes_read, "largest_read": src.reader.largest_read, "tensors": len(where)}


__all__ = ["SliceReader", "load_hf_weights", "weight_files"]
