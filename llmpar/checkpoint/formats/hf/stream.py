"""Safetensors files written from a stream of pieces, with reading, writing and checking overlapped, and checked.

    write_shards(out_dir, files, src, bar)   {file name: [tensor names]} of ``src`` written into ``out_dir``;
                                             returns the paths written, after every file passed its check

``src`` is any :class:`PieceSource`: ``meta`` ({name: meta tensor of the shape and dtype to write}) and
``pieces(name)`` (that tensor's elements, flat, in order, in pieces already in that dtype). Nothing here knows where
the pieces come from (``write.py`` reads them from any reader of the protocol, ``formats/source.py``).

How a file is written (``write_file``): its safetensors header (names in the given order, HuggingFace's
``{"format": "pt"}`` metadata, padded to 8 bytes), then each tensor's bytes. The calling thread reads a piece and
takes its digest (``new_digest``: XXH3-64, or CRC-32 without the ``xxhash`` package) while its bytes are hot; a
writer thread puts the piece where it goes with ``os.pwrite`` (large sequential writes, no second copy in Python),
so reading the next piece overlaps writing this one (the digests and the write release the GIL). At most ``DEPTH``
pieces wait to be written: memory stays ``(DEPTH + 1)`` pieces.

How a file is checked (on a checker thread, while the next tensor is written): every tensor's bytes, read back
from the file once written through read-only mappings of ``WINDOW`` bytes at a time (no copy, the mapping dropped
after each window: RSS stays a window), have the digest taken of the bytes sent (``check_bytes``); once the file is
written, safetensors parses it (names, dtypes and shapes equal the plan, ``check_header``). Then (``sample``, once
all files are written) a sample is reloaded through safetensors and compared bitwise with a fresh read of the
source: in each file the smallest tensor whole and the first rows of the largest. A file that differs raises a
``CheckpointError`` naming the file and tensor; the half-written ``.tmp`` files are removed.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Protocol

import torch

from llmpar.checkpoint.files import CheckpointError

DEPTH = 2  # pieces waiting for the writer thread
WINDOW = 64 << 20  # bytes mapped at a time when a file is read back
SAMPLE_ELEMS = 1 << 16  # elements of each file's largest tensor reloaded by the sample (whole rows)
ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class Crc32:
    """``zlib.crc32`` behind hashlib's streaming interface (``update``, ``intdigest``)."""

    name = "CRC-32"

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def new_digest() -> Any:
    """A fresh streaming digest: xxHash's XXH3-64 when the ``xxhash`` package is installed (~4x faster than
    CRC-32 here, and it releases the GIL), else :class:`Crc32`."""
    try:
        import xxhash
    except ImportError:
        return Crc32()
    return xxhash.xxh3_64()


def digest(data: Any) -> int:
    """The digest :func:`new_digest` takes of ``data`` (bytes or a memoryview)."""
    h = new_digest()
    h.update(data)
    return h.intdigest()


class PieceSource(Protocol):
    meta: dict[str, torch.Tensor]

    def pieces(self, name: str) -> Iterator[torch.Tensor]: ...


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (made contiguous), without a copy when it already is."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def header(meta: dict[str, torch.Tensor], names: list[str]) -> tuple[bytes, list[tuple[int, int]]]:
    """A safetensors header for ``names`` (data in that order) and each tensor's data range in the data section."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at, spans = 0, []
    for n in names:
        if meta[n].dtype not in ST_DTYPES:
            raise CheckpointError(
                f"convert: {n!r} is {meta[n].dtype}, which this writer does not write "
                f"(one of {sorted(map(str, ST_DTYPES))})"
            )
        size = meta[n].numel() * meta[n].element_size()
        head[n] = {"dtype": ST_DTYPES[meta[n].dtype], "shape": list(meta[n].shape), "data_offsets": [at, at + size]}
        spans.append((at, at + size))
        at += size
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, spans


def pwrite_all(fd: int, data: memoryview, at: int) -> None:
    """All of ``data`` written at offset ``at`` of ``fd`` (``os.pwrite`` may write less than asked)."""
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


def write_file(
    path: str,
    src: PieceSource,
    names: list[str],
    bar: Any,
    writer: ThreadPoolExecutor,
    checker: ThreadPoolExecutor | None = None,
) -> tuple[dict[str, int], list[Future]]:
    """One safetensors file of ``names`` from ``src`` at ``path + ".tmp"`` (module docstring): ({name: digest of the
    bytes sent}, the checks started on ``checker``: each tensor's bytes read back once written, then the header).
    The caller waits for the checks and renames the file into place."""
    head, _ = header(src.meta, names)
    digests: dict[str, int] = {}
    checks: list[Future] = []
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pending: deque[Future] = deque()
    try:
        pending.append(writer.submit(pwrite_all, fd, memoryview(head), 0))
        at = len(head)
        for n in names:
            h, first = new_digest(), at
            for piece in src.pieces(n):
                data = as_bytes(piece)
                h.update(data)
                pending.append(writer.submit(pwrite_all, fd, data, at))  # ``data`` keeps ``piece`` alive
                at += len(data)
                bar.update(len(data))
                while len(pending) > DEPTH:
                    pending.popleft().result()
            digests[n] = h.intdigest()
            if checker is not None:  # the writer runs in order: once its last write is done, the tensor is there
                checks.append(
                    checker.submit(
                        _check_after, pending[-1] if pending else None, check_bytes, tmp, n, first, at, digests[n]
                    )
                )
        while pending:
            pending.popleft().result()
    finally:
        for f in pending:  # an error above: let the writes in flight end before the file is closed
            f.exception()
        os.close(fd)
    if checker is not None:
        checks.append(checker.submit(check_header, tmp, src.meta, names))
    return digests, checks


def _check_after(write: Future | None, check: Any, *args: Any) -> None:
    if write is not None:
        write.result()
    check(*args)


def _file_digest(fd: int, a: int, z: int) -> int:
    """:func:`new_digest` of bytes [a, z) of ``fd``, read through read-only mappings of at most ``WINDOW`` bytes."""
    a0, h = a - a % mmap.ALLOCATIONGRANULARITY, new_digest()
    while a < z:
        b = min(z, a0 + WINDOW)
        with mmap.mmap(
            fd, b - a0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ, offset=a0
        ) as m:
            view = memoryview(m)
            try:
                h.update(view[a - a0 :])
            finally:
                view.release()
        a = a0 = b
    return h.intdigest()


def check_bytes(path: str, name: str, a: int, z: int, want: int) -> None:
    """Bytes [a, z) of file ``path`` (tensor ``name``'s) have digest ``want``; a ``CheckpointError`` otherwise."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < z or _file_digest(fd, a, z) != want:
            raise CheckpointError(
                f"convert: the bytes of {name!r} read back from {path} differ from those written "
                f"({getattr(new_digest(), 'name', 'digest')})"
            )
    finally:
        os.close(fd)


def check_header(path: str, meta: dict[str, torch.Tensor], names: list[str]) -> None:
    """``path`` as safetensors parses it holds ``names`` with the dtypes and shapes of ``meta``, and is as long as
    its header says; a ``CheckpointError`` naming what differs."""
    from safetensors import safe_open

    try:
        f = safe_open(path, framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors' own error: named as ours
        raise CheckpointError(f"convert: {path} cannot be parsed as safetensors: {e}") from e
    with f:
        if sorted(f.keys()) != sorted(names):
            raise CheckpointError(f"convert: {path} holds {sorted(f.keys())[:8]}, not the planned {sorted(names)[:8]}")
        for n in names:
            s = f.get_slice(n)
            if tuple(s.get_shape()) != tuple(meta[n].shape) or s.get_dtype() != ST_DTYPES[meta[n].dtype]:
                raise CheckpointError(
                    f"convert: {n!r} in {path} is {s.get_dtype()} {tuple(s.get_shape())}, the "
                    f"source {meta[n].dtype} {tuple(meta[n].shape)}"
                )
    head, _ = header(meta, names)
    want = len(head) + sum(meta[n].numel() * meta[n].element_size() for n in names)
    if os.path.getsize(path) != want:
        raise CheckpointError(f"convert: {path} is {os.path.getsize(path)} bytes, the plan {want}")


def check_file(path: str, meta: dict[str, torch.Tensor], names: list[str], digests: dict[str, int]) -> None:
    """The whole check of a written file: ``check_header``, then every tensor's bytes against ``digests`` (each its
    :func:`digest`)."""
    check_header(path, meta, names)
    head, spans = header(meta, names)
    for n, (a, z) in zip(names, spans):
        check_bytes(path, n, len(head) + a, len(head) + z, digests[n])


def _rows(shape: torch.Size) -> int:
    """How many leading rows of a tensor of ``shape`` make about ``SAMPLE_ELEMS`` elements (at least one)."""
    row = max(1, int(torch.Size(shape[1:]).numel())) if len(shape) else 1
    return max(1, min(shape[0] if len(shape) else 1, SAMPLE_ELEMS // row))


def sample(path: str, src: PieceSource, names: list[str]) -> None:
    """Reload through safetensors the file's smallest tensor and the first rows of its largest, and compare them
    bitwise with a fresh read of ``src`` (module docstring)."""
    from safetensors import safe_open

    if not names:
        return
    small = min(names, key=lambda n: src.meta[n].numel())
    large = max(names, key=lambda n: src.meta[n].numel())
    with safe_open(path, framework="pt") as f:
        for n in dict.fromkeys([small, large]):
            shape = src.meta[n].shape
            want = _head(src, n, int(_rows(shape) * torch.Size(shape[1:]).numel()) if len(shape) else 1)
            got = (f.get_slice(n)[: _rows(shape)] if len(shape) else f.get_tensor(n)).reshape(-1)
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise CheckpointError(f"convert: {n!r} in {path} differs from the source (reloaded sample)")


def _head(src: PieceSource, name: str, count: int) -> torch.Tensor:
    """The first ``count`` elements of ``name`` read afresh from ``src``."""
    out, got = [], 0
    for piece in src.pieces(name):
        out.append(piece[: count - got])
        got += out[-1].numel()
        if got >= count:
            break
    return torch.cat(out) if out else torch.empty(0, dtype=src.meta[name].dtype)


def write_shards(out_dir: str, plan: dict[str, list[str]], src: PieceSource, bar: Any) -> list[str]:
    """Each file of ``plan`` ({file name: tensor names}) written from ``src`` into ``out_dir`` and checked (module
    docstring): each tensor's bytes read back while the next tensor is written, each header once its file is; the
    sample at the end; every file renamed into place once all passed. Returns the paths, in ``plan``'s order."""
    checks: list[Future] = []
    paths = [os.path.join(out_dir, f) for f in plan]
    try:
        with (
            ThreadPoolExecutor(1, thread_name_prefix="llmpar-write") as writer,
            ThreadPoolExecutor(1, thread_name_prefix="llmpar-check") as checker,
        ):
            for path, names in zip(paths, plan.values()):
                checks += write_file(path, src, names, bar, writer, checker)[1]
                for c in checks:  # a file that failed its check already: stop before writing the next
                    if c.done():
                        c.result()
            for c in checks:
                c.result()
        for path, names in zip(paths, plan.values()):
            sample(path + ".tmp", src, names)
    except BaseException:
        for p in paths:
            if os.path.exists(p + ".tmp"):
                os.remove(p + ".tmp")
        raise
    for p in paths:
        os.replace(p + ".tmp", p)
    return paths


__all__ = [
    "DEPTH",
    "ST_DTYPES",
    "WINDOW",
    "Crc32",
    "PieceSource",
    "as_bytes",
    "check_bytes",
    "check_file",
    "check_header",
    "digest",
    "header",
    "new_digest",
    "sample",
    "write_file",
    "write_shards",
]
