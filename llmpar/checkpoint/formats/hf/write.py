"""Any reader of the protocol (``formats/source.py``) written in HuggingFace's layout (``files.py``: what
``from_pretrained`` loads), every tensor written checked: ``llmpar checkpoint convert --to hf`` and ``consolidate``.

    write_hf(src, out, dtype=..., max_shard_size=..., format=None, stream=...)   the paths written
    verify(state, written)     every weight file written read back, every tensor compared bitwise with ``state``
                               (tied copies once, as ``files.untied``); a CheckpointError naming what differs

The weights (``source.weights``): each trained param's fp32 master (its weights where the run kept none), a tied name as
the same tensor as its source, buffers and frozen params; float tensors cast to ``dtype`` (float64 kept; None: as saved;
an llmpar checkpoint's buffers and frozen params as saved). ``stream=False``: gathered whole, written by
``files.write_hf_model`` (with the model's ``config.json`` when the checkpoint recorded it), read back by
:func:`verify`.

Streaming (safetensors from a memory-mapped source: DeepSpeed's files, a universal checkpoint): the output shards
are planned from the shapes alone (``files.shard_plan``); each safetensors file is written by
``stream.write_shards`` (its header, then each tensor's bytes, written by a thread while the next piece is read;
checked while the next file is written: see there) from pieces of at most ``PIECE`` elements read from the source
(a ZeRO-3 param: from its ranks' chunks, never gathered whole), cast piece by piece; the source lets its files go
(``Source.release()``) after every ``budget`` bytes read so that the mapped pages already read leave the process
(mapped pages count in its RSS). Peak memory: the pages of ``budget`` bytes of the source plus a few pieces and a
read-back window, whatever the model's size.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.hf import files as hf_files
from llmpar.checkpoint.formats.hf import stream as hf_stream
from llmpar.checkpoint.formats.source import Source, state_key, weights

PIECE = 1 << 24  # elements read, cast and written at a time
REOPEN_MIN = 256 << 20  # bytes read from the source before it lets its files go (or one shard's, when smaller)


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
    """The tensors of reader ``src`` (in ``source.weights``' order, tied copies once) read in pieces, each cast as
    ``weights`` casts; the source's files let go after ``budget`` bytes read (module docstring)."""

    def __init__(self, src: Source, dtype: torch.dtype | None, budget: int) -> None:
        self.src, self.dtype, self.budget, self.since = src, dtype, budget, 0
        self.small = {
            n: t for n, t in {**src.buffers(), **src.frozen()}.items() if n not in src.shapes and n not in src.aliases
        }  # buffers and frozen params, read whole (as saved)
        self.meta: dict[str, torch.Tensor] = {}  # name -> meta tensor of the shape and dtype written
        for name in src.names:
            shape = src.shapes[name]
            saved = src.read(name, self._key(name), 0, 1).dtype if math.prod(shape) else torch.float32
            self.meta[name] = torch.empty(shape, dtype=self._cast(saved), device="meta")
        for name, t in self.small.items():
            self.meta[name] = torch.empty(t.shape, dtype=self._cast(t.dtype), device="meta")

    def _cast(self, dt: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dt.is_floating_point and dt != torch.float64 else dt

    def _key(self, name: str) -> str:
        return state_key(self.src, name, "master")

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor ``name`` flat, in pieces of at most ``PIECE`` elements, cast to the dtype written."""
        want = self.meta[name].dtype
        if name in self.small:
            yield self.small[name].reshape(-1).to(want)
            return
        n = math.prod(self.src.shapes[name])
        chunk = -(-n // self.src.dp) if self.src.stage == 3 else n  # a ZeRO-3 piece stays within one rank's chunk
        a = 0
        while a < n:
            if self.since > self.budget:  # let the pages read so far go: the files are mapped afresh
                self.src.release()
                self.since = 0
            z = min(a + PIECE, n, (a // chunk + 1) * chunk)
            t = self.src.read(name, self._key(name), a, z)
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
    src: Source,
    out_dir: str,
    *,
    dtype: Any = torch.float32,
    max_shard_size: Any = hf_files.DEFAULT_SHARD_SIZE,
    format: str | None = None,
    stream: bool = False,
    progress: bool | None = None,
) -> list[str]:
    """Reader ``src`` written to ``out_dir`` as HuggingFace weights (``write_hf_model``'s files, names and sharding)
    and checked (module docstring): ``dtype`` (bf16 / fp16 / fp32, a torch dtype, None / "keep": as saved),
    ``max_shard_size``, ``format`` ("safetensors", the default when installed, or "bin") as ``write_hf_model`` takes
    them. ``stream``: safetensors written from pieces of the source (``format`` must be safetensors; no config
    files); ``progress``: a tqdm bar of the bytes streamed (None: when stderr is a terminal). Returns the paths
    written."""
    target = hf_files.parse_dtype(dtype)
    max_bytes = hf_files.parse_size(max_shard_size)
    if not stream:
        state = weights(src, target, extras_as_saved=src.format == "llmpar")  # consolidate's rule, as before
        model = src.hf_config()
        written = hf_files.write_hf_model(
            out_dir,
            state,
            config=model.get("hf_config"),
            generation_config=model.get("hf_generation_config"),
            max_shard_size=max_shard_size,
            format=format,
        )
        verify(state, written)
        return written
    if hf_files.parse_format(format) != "safetensors":
        raise ValueError(f"format={format!r}: a streamed export writes safetensors")
    from tqdm.auto import tqdm

    pieces = _Stream(src, target, min(max_bytes, REOPEN_MIN))
    shards = hf_files.shard_plan(pieces.meta, max_bytes)
    names = hf_files.shard_files(len(shards), "safetensors")
    index = "model.safetensors.index.json"
    os.makedirs(out_dir, exist_ok=True)
    hf_files.clean(out_dir, set())  # an earlier export's weights gone before the first new file lands
    total = sum(t.numel() * t.element_size() for t in pieces.meta.values())
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="convert", disable=None if progress is None else not progress
    ) as bar:
        written = hf_stream.write_shards(out_dir, dict(zip(names, shards)), pieces, bar)
    if len(names) > 1:
        hf_files.write_json(
            os.path.join(out_dir, index),
            {
                "metadata": {"total_size": total, "total_parameters": sum(t.numel() for t in pieces.meta.values())},
                "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys},
            },
        )
        written.append(os.path.join(out_dir, index))
    return written


__all__ = ["PIECE", "verify", "write_hf"]
