"""Checkpoint files on disk: checksummed writes, the atomic publish, the ``latest`` pointer, and agreement of errors.

A checkpoint ``DIR/TAG/`` holds, once published:

    metadata.json          the global layout and run state (written last, by rank 0; its presence marks completeness)
    dp{d:03d}-tp{t:02d}.pt  one file per rank: its own shards, its RNG states (``shards.py`` says what is inside);
                           ``pp{p:02d}-dp{d:03d}-tp{t:02d}.pt`` when the run had pp > 1 pipeline ranks
    client_state.pt        the caller's ``client_state`` (rank 0)

It is written under ``DIR/.tmp-TAG`` and renamed to ``DIR/TAG`` by rank 0 only after every rank reported success; then
``DIR/latest`` (the tag, one line) is replaced atomically. A crash anywhere before the rename leaves only a ``.tmp-``
directory that no loader looks at; a crash between the rename and ``latest`` leaves a complete checkpoint that
``latest`` does not name yet. Every file's sha256 and size are recorded in ``metadata.json`` and checked on load.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, BinaryIO, cast

import torch

from llmpar.checkpoint.protocol import FaultHook
from llmpar.distributed.collectives import Group, all_reduce

METADATA = "metadata.json"
LATEST = "latest"
CLIENT_STATE = "client_state.pt"
FORMAT_VERSION = 1

class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (names the file and the reason)."""


def fault(hook: FaultHook | None, point: str) -> None:
    """Call the test hook ``hook`` (``save_checkpoint(..., fault_hook=)``), if any, at ``point``."""
    if hook is not None:
        hook(point)


def rank_file(dp_rank: int, tp_rank: int, pp_rank: int = 0, pp: int = 1) -> str:
    """The file of rank (pp_rank, dp_rank, tp_rank) in a run with ``pp`` pipeline ranks (no pp part when pp == 1)."""
    name = f"dp{dp_rank:03d}-tp{tp_rank:02d}.pt"
    return f"pp{pp_rank:02d}-{name}" if pp > 1 else name


class _HashingWriter:
    """A write-only file object that hashes what passes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        mv = memoryview(data)
        self.sha.update(mv)
        self.bytes += mv.nbytes
        return self.f.write(mv)

    def flush(self) -> None:
        self.f.flush()


def save_file(obj: Any, path: str) -> dict:
    """``torch.save`` to ``path`` (fsynced); returns ``{"sha256", "bytes"}`` of what was written."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, cast(BinaryIO, w))  # torch.save needs only write() and flush()
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": w.sha.hexdigest(), "bytes": w.bytes}


def sha256_file(path: str) -> tuple[str, int]:
    sha, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
            n += len(chunk)
    return sha.hexdigest(), n


def check_file(ckpt: str, name: str, entry: dict) -> str | None:
    """None when ``ckpt/name`` exists with the recorded size and sha256, else why not ("missing" / "corrupt")."""
    path = os.path.join(ckpt, name)
    if not os.path.isfile(path):
        return "missing"
    digest, n = sha256_file(path)
    if n != entry["bytes"] or digest != entry["sha256"]:
        return "corrupt"
    return None


def load_file(path: str, *, mmap: bool = True) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(save_dir: str, tmp: str, tag: str, fault_hook: FaultHook | None = None) -> str:
    """Rank 0, after every rank wrote: ``tmp`` becomes ``save_dir/tag`` (an older one of that tag is replaced), then
    ``latest`` names it. Returns the published path. ``fault_hook``: called at "before_publish" and
    "before_latest" (tests)."""
    final = os.path.join(save_dir, tag)
    fault(fault_hook, "before_publish")
    if os.path.exists(final):  # re-saving a tag: move the old one aside first, delete it once the new one is in place
        trash = os.path.join(save_dir, f".old-{tag}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(save_dir)
    fault(fault_hook, "before_latest")
    latest = os.path.join(save_dir, LATEST)
    with open(latest + ".tmp", "w") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest + ".tmp", latest)
    _fsync_dir(save_dir)
    return final


def resolve(load_dir: str, tag: str | None) -> tuple[str, str]:
    """(tag, checkpoint path) for ``tag`` or, when None, the one ``load_dir/latest`` names."""
    if not isinstance(load_dir, (str, os.PathLike)):
        raise TypeError(f"load_dir must be a path, got {type(load_dir).__name__}")
    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"no checkpoint to load: {latest} does not exist (pass tag= or save one first)")
        with open(latest) as f:
            tag = f.read().strip()
    check_tag(tag)
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise CheckpointError(f"checkpoint {path} is not complete: {os.path.join(path, METADATA)} is missing")
    return tag, path


def check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or "\\" in tag or tag == LATEST:
        raise ValueError(f"tag={tag!r} must be a non-empty name without '/' that does not start with '.' and is not "
                         f"{LATEST!r}")
    return tag


def read_metadata(path: str) -> dict:
    with open(os.path.join(path, METADATA)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{os.path.join(path, METADATA)} has format {meta.get('format')!r}; this llmpar reads "
                              f"format {FORMAT_VERSION}")
    return meta


def agree(code: int, groups: list[Group], device: torch.device) -> int:
    """The largest ``code`` over every rank of the grid ``groups`` span (max over each group in turn).
    ``device``: where the collective runs (cuda under NCCL)."""
    t = torch.tensor([code], dtype=torch.int64, device=device)
    for g in groups:
        all_reduce(t, g, op="max")
    return int(t.item())
