"""What ``llmpar checkpoint convert`` needs beside ``consolidate.py``: which layout a source is, a DeepSpeed
checkpoint's full weights tensor by tensor, and the check of what was written.

    locate(src, tag, source)   ("deepspeed" | "llmpar", checkpoint dir): ``source="auto"`` takes DeepSpeed's layout
                               (``ds_files``) when ``src`` / ``src/TAG`` / ``src/latest``'s tag has its files, else
                               llmpar's (``files.resolve``: an unknown layout is an error listing what it holds)
    state_dict(path, dtype)    {name: full tensor}: the fp32 masters (ZeRO 1-3; stage 0: the weights or its bf16
                               optimizer's fp32 copies), a tied name as the same tensor as its source, buffers and
                               frozen params; float tensors cast to ``dtype`` (float64 kept; None: as saved)
    verify(state, written)     every weight file written read back, every tensor compared bitwise with ``state``
                               (tied copies once, as ``hf_files.untied``); a CheckpointError naming what differs
    write_hf(path, out, ...)   ``state_dict`` + ``write_hf_model`` + ``verify`` streamed (below): what ``llmpar
                               checkpoint convert --to hf`` runs on a DeepSpeed source (safetensors)

Streaming (``write_hf``): the output shards are planned from the shapes alone (``hf_files.shard_plan``); each
safetensors file is written by ``hf_stream.write_shards`` (its header, then each tensor's bytes, written by a
thread while the next piece is read; checked while the next file is written: see there) from pieces of at most
``PIECE`` elements read from the memory-mapped source (a ZeRO-3 param: its ranks' chunks in turn, no piece across
two, never gathered whole), cast piece by piece; the source is reopened after every ``budget`` bytes read so that
the mapped pages already read leave the process (mapped pages count in its RSS). Peak memory: the pages of
``budget`` bytes of the source plus a few pieces and a read-back window, whatever the model's size.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator

import torch

from llmpar.checkpoint import ds_check, ds_files, files, hf_files, hf_stream
from llmpar.checkpoint.deepspeed_read import DeepSpeedCheckpoint
from llmpar.checkpoint.files import CheckpointError

PIECE = 1 << 24  # elements read, cast and written at a time
REOPEN_MIN = 256 << 20  # bytes read from the source before it is reopened (or one shard's, when smaller)

SOURCES = ("auto", "deepspeed", "llmpar")


def locate(src: str, tag: str | None, source: str = "auto") -> tuple[str, str]:
    """(kind, checkpoint directory) of ``src`` (a checkpoint directory, or a save directory with ``latest`` or
    ``tag``); ``source``: "auto", or the layout it must be."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not one of {list(SOURCES)}")
    src = os.fspath(src)
    ds = ds_files.resolve(src, tag) or (src if tag is None and ds_files.detect(src) else None)
    if ds is not None and source in ("auto", "deepspeed"):
        return "deepspeed", ds
    if ds is not None:
        raise CheckpointError(
            f"{ds} is a DeepSpeed checkpoint, not llmpar's (--from llmpar): convert it with --from deepspeed or auto"
        )
    if source == "deepspeed":
        where = os.path.join(src, tag) if tag is not None else src
        found = sorted(os.listdir(where))[:8] if os.path.isdir(where) else "nothing (no such directory)"
        raise CheckpointError(
            f"{where} is not a DeepSpeed checkpoint (no mp_rank_*_model_states.pt or "
            f"*zero_pp_rank_*_optim_states.pt, or a metadata.json): it holds {found}"
        )
    if tag is None and os.path.isfile(os.path.join(src, files.METADATA)):
        return "llmpar", src
    return "llmpar", files.resolve(src, tag)[1]


def state_dict(path: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The full weights of DeepSpeed checkpoint directory ``path`` (module docstring)."""
    ck = DeepSpeedCheckpoint(path)
    ds_check.validate(ck)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != torch.float64 else t

    out: dict[str, torch.Tensor] = {}
    for name in ck.names:
        shape = ck.shapes[name]
        key = "master" if ck.has(name, "master") else "params"
        out[name] = cast(ck.read(name, key, 0, math.prod(shape)).view(shape))
    for alias, src in ck.aliases.items():
        if src in out:
            out[alias] = out[src]
    for name, t in {**ck.buffers(), **ck.frozen()}.items():
        out.setdefault(name, cast(t))
    return out


def _read_back(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def verify(state: dict[str, torch.Tensor], written: list[str]) -> int:
    """Read back every weight file of ``written`` (``hf_files.write_hf_model``'s list) and compare each tensor with
    ``state`` bitwise (dtype, shape, values); returns the number of tensors checked."""
    want = hf_files.untied(state)
    seen: set[str] = set()
    for path in written:
        if path.endswith(".json"):
            continue
        for name, t in _read_back(path).items():
            ref = want.get(name)
            if ref is None:
                raise CheckpointError(f"convert: {path} holds {name!r}, which the source does not")
            if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t, ref):
                raise CheckpointError(
                    f"convert: {name!r} in {path} differs from the source ({t.dtype} "
                    f"{tuple(t.shape)} written, {ref.dtype} {tuple(ref.shape)} read)"
                )
            seen.add(name)
    if seen != set(want):
        raise CheckpointError(f"convert: {sorted(set(want) - seen)[:8]} were not written to {written}")
    return len(seen)


class _Stream:
    """The tensors of DeepSpeed checkpoint ``path`` (in ``state_dict``'s order, tied copies once) read in pieces,
    each cast as ``state_dict`` casts; the checkpoint reopened after ``budget`` bytes read (module docstring)."""

    def __init__(self, path: str, dtype: torch.dtype | None, budget: int) -> None:
        self.path, self.dtype, self.budget, self.since = path, dtype, budget, 0
        self.ck = ck = DeepSpeedCheckpoint(path)
        ds_check.validate(ck)  # once, before the first file is written
        self.small = {
            n: t for n, t in {**ck.buffers(), **ck.frozen()}.items() if n not in ck.shapes and n not in ck.aliases
        }  # buffers and frozen params, read whole (as saved)
        self.meta: dict[str, torch.Tensor] = {}  # name -> meta tensor of the shape and dtype written
        for name in ck.names:
            shape = ck.shapes[name]
            saved = ck.read(name, self._key(name), 0, 1).dtype if math.prod(shape) else torch.float32
            self.meta[name] = torch.empty(shape, dtype=self._cast(saved), device="meta")
        for name, t in self.small.items():
            self.meta[name] = torch.empty(t.shape, dtype=self._cast(t.dtype), device="meta")

    def _cast(self, dt: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dt.is_floating_point and dt != torch.float64 else dt

    def _key(self, name: str) -> str:
        return "master" if self.ck.has(name, "master") else "params"

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor ``name`` flat, in pieces of at most ``PIECE`` elements, cast to the dtype written."""
        want = self.meta[name].dtype
        if name in self.small:
            yield self.small[name].reshape(-1).to(want)
            return
        n = math.prod(self.ck.shapes[name])
        chunk = -(-n // self.ck.dp) if self.ck.stage == 3 else n  # a ZeRO-3 piece stays within one rank's chunk
        a = 0
        while a < n:
            if self.since > self.budget:  # let the pages read so far go: a fresh mapping of the files
                self.ck = None  # type: ignore[assignment]
                self.ck, self.since = DeepSpeedCheckpoint(self.path), 0
            z = min(a + PIECE, n, (a // chunk + 1) * chunk)
            t = self.ck.read(name, self._key(name), a, z)
            a = z
            self.since += t.numel() * t.element_size()
            yield t.to(want)

    def tensor(self, name: str) -> torch.Tensor:
        return (
            torch.cat(list(self.pieces(name))).view(self.meta[name].shape)
            if self.meta[name].numel()
            else torch.empty(self.meta[name].shape, dtype=self.meta[name].dtype)
        )


def write_hf(
    path: str,
    out_dir: str,
    *,
    dtype: torch.dtype | None,
    max_shard_size: Any = hf_files.DEFAULT_SHARD_SIZE,
    progress: bool | None = None,
) -> list[str]:
    """DeepSpeed checkpoint directory ``path`` written to ``out_dir`` as HuggingFace safetensors (``write_hf_model``'s
    files, names and sharding), streamed and checked (module docstring); ``progress``: a tqdm bar of the bytes
    written (None: when stderr is a terminal). Returns the paths written."""
    from tqdm.auto import tqdm

    max_bytes = hf_files.parse_size(max_shard_size)
    src = _Stream(path, dtype, 0)
    src.budget = min(max_bytes, REOPEN_MIN)
    shards = hf_files.shard_plan(src.meta, max_bytes)
    names = hf_files.shard_files(len(shards), "safetensors")
    index = "model.safetensors.index.json"
    os.makedirs(out_dir, exist_ok=True)
    hf_files.clean(out_dir, set())  # an earlier export's weights gone before the first new file lands
    total = sum(t.numel() * t.element_size() for t in src.meta.values())
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="convert", disable=None if progress is None else not progress
    ) as bar:
        written = hf_stream.write_shards(out_dir, dict(zip(names, shards)), src, bar)
    if len(names) > 1:
        hf_files.write_json(
            os.path.join(out_dir, index),
            {
                "metadata": {"total_size": total, "total_parameters": sum(t.numel() for t in src.meta.values())},
                "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys},
            },
        )
        written.append(os.path.join(out_dir, index))
    return written


__all__ = ["PIECE", "SOURCES", "locate", "state_dict", "verify", "write_hf"]
