"""The rank files of checkpoint format 3: tensors written once as raw bytes (no pickling, no copies), hashed in
fixed blocks while they are written, read back through ``mmap`` with only the blocks a reader touches verified.

    [0, 16)                 header: b"LLMPARCK", version (u32 LE, 1), 4 zero bytes
    [16, data_end)          the records (tensors' bytes, C order), each at a multiple of 64; zeros between
    [data_end, size - 16)   index: UTF-8 JSON {"version", "block": B, "data_end", "blocks": [sha256 hex per block],
                            "records": [{"dtype", "shape", "offset", "nbytes"}], "tree": the object written, each
                            tensor replaced by {"__record__": i}}
    [size - 16, size)       trailer: the index's length (u64 LE), b"LLMPAREN"

Block k covers the bytes ``[16 + k B, min(16 + (k + 1) B, data_end))``. ``metadata.json`` records each file's size
and the sha256 of its index (``{"bytes", "index_sha256"}``), so every byte is covered: the index by its digest, the
records and the padding by the block digests it lists, the header and trailer as constants. A reader checks the size
and the index when it opens a file (:class:`BlockFile`), and a block the first time a read touches it: a rank that
needs 100 MB of a 300 MB file hashes those 100 MB, not the file; :meth:`BlockFile.verify_all` checks every block.

Writing: ``blockwrite.py`` (the sha256 of each block taken by the :func:`hash_threads` threads of :class:`Hasher`
while the next blocks are written). Verifying many blocks hashes them in those threads too.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import queue
import struct
import threading
from typing import Any, Iterable

import torch

from llmpar.checkpoint.files import CheckpointError

MAGIC, END = b"LLMPARCK", b"LLMPAREN"
VERSION = 1
HEADER = MAGIC + struct.pack("<I", VERSION) + bytes(4)
TRAILER = 16  # u64 index length + END
BLOCK = 1 << 22  # 4 MiB: the unit of hashing and of verification
ALIGN = 64
RECORD_REF = "__record__"


class CorruptFile(CheckpointError):
    """A rank file whose bytes do not match what was recorded (``name``: its file name, ``why``: what differs)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"checkpoint shard {path} is corrupt ({why})")
        self.path, self.name, self.why = path, os.path.basename(path), why


class Concat:
    """One record written as the concatenation of ``pieces`` (flattened, one dtype): no ``cat`` copy is made."""

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        if not pieces or len({p.dtype for p in pieces}) != 1:
            raise ValueError(f"Concat needs one or more tensors of one dtype, got {[p.dtype for p in pieces]}")
        self.pieces = pieces
        self.dtype = pieces[0].dtype
        self.shape = [sum(p.numel() for p in pieces)]

    def tensor(self) -> torch.Tensor:
        """A fresh host tensor holding the concatenation (each piece copied once, straight into it)."""
        out, at = torch.empty(self.shape[0], dtype=self.dtype), 0
        for p in self.pieces:
            out[at : at + p.numel()].copy_(p.detach().reshape(-1))
            at += p.numel()
        return out


def _digest(parts: list[memoryview]) -> str:
    sha = hashlib.sha256()
    for p in parts:
        sha.update(p)
    return sha.hexdigest()


def hash_threads() -> int:
    """Threads that hash one rank's file: its share of the CPUs it may run on (``LOCAL_WORLD_SIZE`` ranks per
    machine, as torchrun sets it), 1 to 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(4, cpus // local))


class Hasher:
    """The sha256 of each submitted block, in submission order, by ``threads`` helper threads (plain threads: a
    ``ThreadPoolExecutor`` takes no work once the interpreter exits, when an async save left pending is finished);
    inline when ``threads`` is 0 or no thread can start."""

    def __init__(self, threads: int) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.digests: list[str | None] = []
        self.threads: list[threading.Thread] = []
        for _ in range(threads):
            thread = threading.Thread(target=self._run, name="llmpar-ckpt-hash", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # interpreter shutting down
                break
            self.threads.append(thread)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            k, parts = item
            self.digests[k] = _digest(parts)

    def submit(self, parts: list[memoryview]) -> None:
        self.digests.append(None)
        if self.threads:
            self.queue.put((len(self.digests) - 1, parts))
        else:
            self.digests[-1] = _digest(parts)

    def close(self) -> list[str | None]:
        """Every digest submitted (None where a thread failed); waits for the threads."""
        for _ in self.threads:
            self.queue.put(None)
        for thread in self.threads:
            thread.join()
        self.threads = []
        return self.digests


def _dtype(name: Any) -> torch.dtype:
    if not isinstance(dt := getattr(torch, name, None) if isinstance(name, str) else None, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class BlockFile:
    """One rank file, opened: size, header, trailer and index checked (against ``entry`` = ``{"bytes",
    "index_sha256"}`` from ``metadata.json`` when given), data mapped and verified block by block on first read."""

    def __init__(self, path: str, entry: dict | None = None) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if entry is not None and size != entry["bytes"]:
                    raise CorruptFile(path, f"{size} bytes, metadata.json says {entry['bytes']}")
                if size < len(HEADER) + TRAILER or f.read(len(HEADER)) != HEADER:
                    raise CorruptFile(path, "not an llmpar rank file of version 1 (header)")
                f.seek(size - TRAILER)
                n, end = struct.unpack("<Q8s", f.read(TRAILER))
                if end != END or n > size - len(HEADER) - TRAILER:
                    raise CorruptFile(path, "trailer")
                f.seek(size - TRAILER - n)
                raw = f.read(n)
                self.mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: tensors are writable
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint shard {path}: {e.strerror or e}") from e
        if entry is not None and hashlib.sha256(raw).hexdigest() != entry["index_sha256"]:
            raise CorruptFile(path, "its index does not match its sha256 in metadata.json")
        try:
            index = json.loads(raw)
            self.block, self.data_end = int(index["block"]), int(index["data_end"])
            self.digests: list[str] = list(index["blocks"])
            self.records = [
                (_dtype(r["dtype"]), [int(d) for d in r["shape"]], int(r["offset"]), int(r["nbytes"]))
                for r in index["records"]
            ]
            self.tree = index["tree"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptFile(path, f"unreadable index: {e}") from e
        blocks = -(-(self.data_end - len(HEADER)) // self.block) if self.block > 0 else -1
        if (
            self.data_end != size - TRAILER - n
            or blocks != len(self.digests)
            or any(
                o < len(HEADER) or o + nb > self.data_end or nb != dt.itemsize * _numel(shape)
                for dt, shape, o, nb in self.records
            )
        ):
            raise CorruptFile(path, "index inconsistent with the file's size")
        self.verified = bytearray(len(self.digests))
        self.recording = False  # verify(): note the blocks in ``wanted`` instead of hashing them
        self.wanted: set[int] = set()

    def verify(self, lo: int, hi: int) -> None:
        """Check the blocks holding file bytes ``[lo, hi)`` (each once; raises :class:`CorruptFile`), or, while
        ``recording``, add them to ``wanted`` (a caller that has another reader verify them: ``shards.RankFiles``)."""
        if hi <= lo:
            return
        first, last = (lo - len(HEADER)) // self.block, (hi - 1 - len(HEADER)) // self.block
        todo = [k for k in range(first, last + 1) if not self.verified[k]]
        if self.recording:
            self.wanted.update(todo)
        else:
            self.verify_blocks(todo)

    def verify_blocks(self, blocks: Iterable[int]) -> None:
        """Check blocks ``blocks`` against the index (hashed by :func:`hash_threads` threads when more than one);
        raises :class:`CorruptFile` naming the first that differs."""
        todo = sorted({k for k in blocks if not self.verified[k]})
        threads = hash_threads() if len(todo) > 1 else 0
        hasher, view = Hasher(threads if threads > 1 else 0), memoryview(self.mm)
        span = [(len(HEADER) + k * self.block, min(len(HEADER) + (k + 1) * self.block, self.data_end)) for k in todo]
        for a, z in span:
            hasher.submit([view[a:z]])
        for k, (a, z), digest in zip(todo, span, hasher.close()):
            if digest != self.digests[k]:
                raise CorruptFile(self.path, f"block {k}, bytes {a}-{z}, does not match its sha256")
            self.verified[k] = 1

    def verify_all(self) -> None:
        self.verify_blocks(range(len(self.digests)))

    def read(self, i: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of record ``i``, flat, verified: a view of the mapped file (no copy)."""
        dtype, shape, offset, nbytes = self.records[i]
        size = dtype.itemsize
        numel = nbytes // size
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:
            raise IndexError(f"{self.path}: elements [{start}, {stop}) of a record of {numel}")
        if stop == start:
            return torch.empty(0, dtype=dtype)
        self.verify(offset + start * size, offset + stop * size)
        return torch.frombuffer(self.mm, dtype=dtype, count=stop - start, offset=offset + start * size)

    def value(self) -> Any:
        """The object written, with each tensor as a lazy :class:`Record`."""

        def build(x: Any) -> Any:
            if isinstance(x, dict):
                return Record(self, x[RECORD_REF]) if RECORD_REF in x else {k: build(v) for k, v in x.items()}
            return [build(v) for v in x] if isinstance(x, list) else x

        return build(self.tree)


class Record:
    """A tensor of a :class:`BlockFile`, read (and its blocks verified) only when asked for."""

    __slots__ = ("file", "index")

    def __init__(self, file: BlockFile, index: int) -> None:
        self.file, self.index = file, index

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.file.records[self.index][1])

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.file.read(self.index, start, stop)

    def tensor(self) -> torch.Tensor:
        return self.read().view(self.shape)


def elements(x: torch.Tensor | Record, start: int, stop: int) -> torch.Tensor:
    """Flat elements ``[start, stop)`` of a tensor or a :class:`Record` (only their blocks read)."""
    return x.read(start, stop) if isinstance(x, Record) else x.reshape(-1)[start:stop]


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`Record` read whole (verified) as a tensor."""
    if isinstance(obj, Record):
        return obj.tensor()
    if isinstance(obj, dict):
        return {k: materialize(v) for k, v in obj.items()}
    return [materialize(v) for v in obj] if isinstance(obj, list) else obj


def load(path: str, entry: dict | None = None) -> Any:
    """The object in rank file ``path``, every block verified (tensors are views of the mapped file)."""
    f = BlockFile(path, entry)
    f.verify_all()
    return materialize(f.value())
