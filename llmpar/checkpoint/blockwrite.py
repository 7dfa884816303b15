"""Writing a rank file of checkpoint format 3 (``blockfile.py`` describes the format and reads it back).

    info = write(path, {"buffers": [...], "rng": {...}})   # -> {"bytes", "index_sha256"} for metadata.json

Each tensor is handed to ``write()`` as a memoryview of its own memory (a record may be several tensors,
``blockfile.Concat``: a rank's partition of a flat buffer spread over units, written without ``cat``); the sha256 of
each block runs in helper threads (``blockfile.hash_threads``) while the next blocks are written (hashlib and ``write``
release the GIL); each block goes to the disk once written (``sync_file_range``): the one ``fsync`` at the end finds
little left. A tensor on an accelerator goes through the host one block at a time.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import sys
from typing import Any, BinaryIO, Callable

import torch

from llmpar.checkpoint.blockfile import (
    ALIGN,
    BLOCK,
    END,
    HEADER,
    RECORD_REF,
    TRAILER,
    VERSION,
    Concat,
    Hasher,
    hash_threads,
)


def _skeleton(obj: Any, records: list[Concat | torch.Tensor], where: str = "obj") -> Any:
    """``obj`` as JSON with each tensor / Concat appended to ``records`` and replaced by its reference."""
    if isinstance(obj, (torch.Tensor, Concat)):
        records.append(obj)
        return {RECORD_REF: len(records) - 1}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj) or RECORD_REF in obj:
            raise TypeError(f"{where}: dict keys must be str (and not {RECORD_REF!r}), got {list(obj)[:5]}")
        return {k: _skeleton(v, records, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_skeleton(v, records, f"{where}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{where}: cannot write a {type(obj).__name__} to a checkpoint rank file")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of host tensor ``t`` (any dtype) without a copy when it is contiguous."""
    t = t.detach().resolve_conj().resolve_neg().reshape(-1)
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def _writeback() -> Callable[[int, int, int], Any] | None:
    """``(fd, offset, nbytes)``: Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which starts writing a range of
    the page cache to the disk without waiting for it; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE; a hint, errors ignored


class _Writer:
    """Sequential writes into ``f`` from ``len(HEADER)`` on; each full block's sha256 is computed by ``hasher`` while
    the next one is written."""

    def __init__(self, f: BinaryIO, hasher: Hasher, block: int) -> None:
        self.f, self.hasher, self.block = f, hasher, block
        self.pos = len(HEADER)
        self.parts: list[memoryview] = []  # the current block's bytes (views: kept alive until hashed)
        self.start = self.pos  # where the current block starts
        self.writeback = _writeback()

    def put(self, mv: memoryview) -> None:
        while mv.nbytes:
            room = self.block - (self.pos - len(HEADER)) % self.block
            part, mv = mv[:room], mv[room:]
            self.parts.append(part)
            done = 0
            while done < part.nbytes:  # a regular file takes it whole, barring a signal
                done += self.f.write(part[done:]) or 0
            self.pos += part.nbytes
            if (self.pos - len(HEADER)) % self.block == 0:
                self.seal()

    def put_tensor(self, t: torch.Tensor) -> None:
        if t.device.type == "cpu":
            self.put(_bytes_of(t))
            return
        flat = t.detach().reshape(-1)
        step = max(1, self.block // max(1, t.element_size()))
        for a in range(0, flat.numel(), step):  # to the host one block at a time
            self.put(_bytes_of(flat[a : a + step].cpu()))

    def seal(self) -> None:
        if self.parts:
            parts, self.parts = self.parts, []
            self.hasher.submit(parts)
            if self.writeback is not None:  # to the disk from now on: the fsync at the end finds little left
                self.writeback(self.f.fileno(), self.start, self.pos - self.start)
            self.start = self.pos


def write(path: str, obj: Any, *, block: int = BLOCK, threads: int | None = None) -> dict:
    """Write ``obj`` (nested dicts / lists of tensors, :class:`Concat`, str, int, float, bool, None) to ``path`` in
    this format, fsynced once at the end; returns ``{"bytes", "index_sha256"}`` for ``metadata.json``.
    ``threads``: hashing threads working while the file is written (default :func:`hash_threads`; 0: inline)."""
    records: list[Concat | torch.Tensor] = []
    tree = _skeleton(obj, records)
    table = []
    hasher = Hasher(hash_threads() if threads is None else threads)
    try:
        with open(path, "wb", buffering=0) as f:
            f.write(HEADER)
            w = _Writer(f, hasher, block)
            for rec in records:
                w.put(memoryview(bytes(-w.pos % ALIGN)))
                start = w.pos
                for piece in rec.pieces if isinstance(rec, Concat) else [rec]:
                    w.put_tensor(piece)
                table.append(
                    {
                        "dtype": str(rec.dtype).removeprefix("torch."),
                        "shape": list(rec.shape),
                        "offset": start,
                        "nbytes": w.pos - start,
                    }
                )
            w.seal()
            data_end = w.pos
            digests = hasher.close()
            if None in digests or len(digests) != -(-(data_end - len(HEADER)) // block):
                raise RuntimeError(f"hashing {path} failed (a hashing thread died)")
            index = json.dumps(
                {
                    "version": VERSION,
                    "block": block,
                    "data_end": data_end,
                    "blocks": digests,
                    "records": table,
                    "tree": tree,
                },
                separators=(",", ":"),
            ).encode()
            f.write(index)
            f.write(struct.pack("<Q", len(index)) + END)
            os.fsync(f.fileno())
    finally:
        hasher.close()
    return {"bytes": data_end + len(index) + TRAILER, "index_sha256": hashlib.sha256(index).hexdigest()}


__all__ = ["write"]
