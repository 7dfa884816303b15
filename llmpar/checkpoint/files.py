"""Checkpoint files on disk: checksummed writes, the ``latest`` pointer, accepted tags and resolving one (with the
recovery of an interrupted re-save), and agreement of errors between ranks (``metacheck.py`` writes and reads
``metadata.json`` with its digest).

A checkpoint ``DIR/TAG/`` holds, once published:

    metadata.json          the global layout and run state (written last, by rank 0; its presence marks completeness),
                           with ``"digest"``: the sha256 of its own content (every key but the digest, canonical JSON),
                           which covers the shard list (each file's size and the sha256 of its index, which lists
                           the sha256 of each of its blocks) and every number in it; for a HuggingFace model
                           ``"model"``: its config and generation config (``consolidate`` writes them as
                           ``config.json`` / ``generation_config.json``; absent in older checkpoints)
    dp{d:03d}-tp{t:02d}.shard  one file per rank (``blockfile.py``): its own shards, its RNG states (``shards.py`` says
                           what is inside); ``pp{p:02d}-dp{d:03d}-tp{t:02d}.shard`` when pp > 1 (pipeline ranks)
    client_state.pt        the caller's ``client_state`` (rank 0, ``torch.save``; its whole sha256 recorded)

It is written under ``DIR/.tmp-TAG`` and published by rank 0 (``publish.py``): renamed to ``DIR/TAG`` only once every
rank's file is there, then ``DIR/latest`` (the tag, one line) is replaced atomically. Re-saving an existing tag moves
the old copy to ``DIR/.old-TAG`` first; :func:`resolve` loads that copy when a crash came between the two renames.
Format 3 writes the rank files in llmpar's block format (raw tensors, hashed per block while written, verified per
block as read); format 2 added the digest; checkpoints of formats 1 and 2 (``.pt`` rank files by ``torch.save``,
each file's whole sha256 recorded) still load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import traceback
from typing import Any, BinaryIO, Iterator, cast

import torch

from llmpar.checkpoint.protocol import FaultHook, Grid
from llmpar.distributed.collectives import Group, all_reduce

METADATA = "metadata.json"
LATEST = "latest"
CLIENT_STATE = "client_state.pt"
FORMAT_VERSION = 3  # 3: rank files in llmpar's block format (blockfile.py); 2: metadata.json carries its own digest
READABLE_FORMATS = (1, 2, 3)  # 1: written before the digest (loads unverified); 1-2: rank files by torch.save
OLD_PREFIX, TMP_PREFIX = ".old-", ".tmp-"
PART = METADATA + ".part"  # metadata.json less what rank 0 collects from the ranks (in DIR/.tmp-TAG only)
FAILED = ".failed"  # a rank file's name + this: its writer failed (the error inside)
MAX_TAG_BYTES = 255 - len(OLD_PREFIX)  # .old-TAG and .tmp-TAG must fit a file name (255 bytes)

logger = logging.getLogger("llmpar")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (names the file and the reason)."""


def fault(hook: FaultHook | None, point: str) -> None:
    """Call the test hook ``hook`` (``save_checkpoint(..., fault_hook=)``), if any, at ``point``."""
    if hook is not None:
        hook(point)


def rank_file(dp_rank: int, tp_rank: int, pp_rank: int = 0, pp: int = 1, *, fmt: int = FORMAT_VERSION) -> str:
    """The file of rank (pp_rank, dp_rank, tp_rank) in a run with ``pp`` pipeline ranks (no pp part when pp == 1), in
    a checkpoint of format ``fmt`` (``.shard``: a block file; ``.pt`` before format 3)."""
    name = f"dp{dp_rank:03d}-tp{tp_rank:02d}" + (".shard" if fmt >= 3 else ".pt")
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


def fsync_dir(path: str) -> None:
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


def replace_file(path: str, data: bytes) -> None:
    """``path`` holds exactly ``data`` (written aside, fsynced, renamed over the old one; its directory fsynced)."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(os.path.dirname(path) or ".")


def write_latest(save_dir: str, tag: str) -> None:
    """``save_dir/latest`` names ``tag``: the tag and one newline, replaced atomically (:func:`replace_file`)."""
    replace_file(os.path.join(save_dir, LATEST), (check_tag(tag) + "\n").encode())


def read_latest(save_dir: str) -> str | None:
    """The tag ``save_dir/latest`` names, read exactly: its text less one final newline (``\\n`` or ``\\r\\n``;
    DeepSpeed writes none), nothing else stripped. None when there is no such file; a ``CheckpointError`` naming the
    file when what it holds is not an accepted tag (:func:`check_tag`): a ``latest`` naming ``"a "`` is never read
    as ``"a"``."""
    latest = os.path.join(save_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    try:
        with open(latest, "rb") as f:
            raw = f.read(4 * MAX_TAG_BYTES)
        text = raw.decode()
    except OSError as e:
        raise CheckpointError(f"cannot read {latest}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{latest} is not UTF-8 text ({raw[:40]!r}): pass tag=") from e
    tag = text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text
    try:
        return check_tag(tag)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{latest} names {tag!r}, which is not a checkpoint tag ({e}); pass tag= (the "
            f"checkpoints are the directories of {save_dir})"
        ) from e


def remove_path(path: str) -> None:
    """Remove ``path`` without following a symlink: a link or file is unlinked (a link's target is left as it is),
    a directory deleted with its contents; nothing when it does not exist. Raises ``OSError``."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def complete(path: str) -> bool:
    """Whether checkpoint directory ``path`` is complete (its ``metadata.json`` is there: written last)."""
    return os.path.isfile(os.path.join(path, METADATA))


def resolve(load_dir: str, tag: str | None) -> tuple[str, str]:
    """(tag, checkpoint path) for ``tag`` or, when None, the one ``load_dir/latest`` names. When ``load_dir/TAG`` is
    missing but ``load_dir/.old-TAG`` (the previous copy of a re-saved tag, a crash between the two renames of its
    publish) is complete, that copy."""
    if not isinstance(load_dir, (str, os.PathLike)):
        raise TypeError(f"load_dir must be a path, got {type(load_dir).__name__}")
    load_dir = os.fspath(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise CheckpointError(
                f"no checkpoint to load: {os.path.join(load_dir, LATEST)} does not exist (pass tag= or save one first)"
            )
    check_tag(tag)
    path = os.path.join(load_dir, tag)
    if complete(path):
        return tag, path
    old = os.path.join(load_dir, OLD_PREFIX + tag)
    if not os.path.exists(path) and complete(old):
        logger.warning(
            "checkpoint %s is missing: a re-save of tag %r stopped between its two renames; loading the "
            "previous copy %s (the next save of any tag puts it back in place)",
            path,
            tag,
            old,
        )
        return tag, old
    tmp = os.path.join(load_dir, TMP_PREFIX + tag)
    if not os.path.exists(path) and (complete(tmp) or os.path.isfile(os.path.join(tmp, PART))):
        raise CheckpointError(
            f"checkpoint {path} was never published: its save stopped before the publish and left "
            f"its files in {tmp}; `llmpar checkpoint publish {load_dir} {tag}` publishes it if "
            f"every rank's file is there (the next save into {load_dir} deletes it)"
        )
    found = sorted(os.listdir(path)) if os.path.isdir(path) else None
    what = (
        "does not exist"
        if found is None
        else f"holds {found[:8] if found else 'nothing'}"
        + (f" and {len(found) - 8} more" if found and len(found) > 8 else "")
    )
    raise CheckpointError(
        f"checkpoint {path} is not complete: {os.path.join(path, METADATA)} is missing ({path} "
        f"{what}: neither llmpar's layout, metadata.json + rank files, nor DeepSpeed's, "
        f"mp_rank_00_model_states.pt / *zero_pp_rank_*_optim_states.pt)"
    )


def check_tag(tag: object, *, what: str = "tag") -> str:
    """``tag`` when it is an accepted checkpoint tag, else a ``TypeError`` (not a str) / ``ValueError`` naming it
    (``what``: how the caller calls it) and what is accepted. A tag names one directory of the save directory, the
    same on every file system and read back exactly from ``latest``: a non-empty str of printable characters (no
    NUL, newline, tab or other control or format character), without leading or trailing whitespace, without
    '/' or '\\', not starting with '.' (so not '.', '..' and not llmpar's own ``.tmp-TAG`` / ``.old-TAG``), not
    'latest' or 'latest.tmp', at most 250 bytes in UTF-8 (``.old-TAG`` must fit a file name). Pure: every rank
    checks its own tag before any collective."""
    if not isinstance(tag, str):
        raise TypeError(f"{what}={tag!r} must be a str (a directory name), got {type(tag).__name__}")
    why = _tag_problem(tag)
    if why is not None:
        raise ValueError(
            f"{what}={tag!r} {why}; a tag is a non-empty name of printable characters without "
            f"leading or trailing whitespace, without '/' or '\\', not starting with '.', at most "
            f"{MAX_TAG_BYTES} bytes, and not {LATEST!r} or {LATEST + '.tmp'!r}"
        )
    return tag


def _tag_problem(tag: str) -> str | None:
    """Why ``tag`` is not accepted (:func:`check_tag`), None when it is."""
    if not tag:
        return "is empty"
    if not tag.isprintable():
        bad = next(c for c in tag if not c.isprintable())
        return f"holds the non-printable character {bad!r}"
    if tag != tag.strip():
        return "has leading or trailing whitespace"
    if "/" in tag or "\\" in tag:
        return "holds a path separator"
    if tag.startswith("."):
        return "starts with '.'"
    if tag in (LATEST, LATEST + ".tmp"):
        return "is a file name llmpar uses in the save directory"
    if len(tag.encode()) > MAX_TAG_BYTES:
        return f"is {len(tag.encode())} bytes long in UTF-8"
    return None


def agree(code: int, groups: list[Group], device: torch.device) -> int:
    """The largest ``code`` over every rank of the grid ``groups`` span (max over each group in turn).
    ``device``: where the collective runs (cuda under NCCL)."""
    return agree_all([code], groups, device)[0]


def agreed_error(err: str | None, g: Grid) -> str:
    """Collective: this rank's error, or the first failing rank's, named."""
    texts = gather_text(err or "", g)
    if err:
        return err
    i = next((i for i, t in enumerate(texts) if t), None)
    return "another rank failed (see its error)" if i is None else f"{rank_name(g, i)}: {texts[i]}"


@contextlib.contextmanager
def agreed(g: Grid, what: str) -> Iterator[None]:
    """Collective: the block runs on every rank of ``g``; if it raises on any rank, every rank raises a
    CheckpointError with that rank's error (its own first), so no rank walks into a later collective alone. For the
    checks before anything changes (``what``: the caller, in the debug log)."""
    err = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
        err = f"{e}" if isinstance(e, (CheckpointError, ValueError, TypeError)) else repr(e)
        logger.debug("%s: %s", what, traceback.format_exc())
    if agree(1 if err else 0, g.groups, g.device):
        raise CheckpointError(agreed_error(err, g))


@contextlib.contextmanager
def all_or_mixed(g: Grid, path: str, state: str = "state") -> Iterator[None]:
    """Collective: the block writes into the engine on every rank of ``g``; if it fails on any rank, every rank
    raises a CheckpointError saying the engine's ``state`` is now mixed (agreed before any re-gather, so that no
    rank waits alone)."""
    err = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - agreed, then raised everywhere
        err = f"loading {path} failed part-way, the engine's {state} is mixed: {e!r}"
        logger.error("%s\n%s", err, traceback.format_exc())
    if agree(1 if err else 0, g.groups, g.device):
        raise CheckpointError(err or f"another rank failed part-way loading {path}; the engine's {state} is mixed")


def agree_all(values: list[int], groups: list[Group], device: torch.device) -> list[int]:
    """The elementwise max of ``values`` (the same length on every rank) over the grid ``groups`` span."""
    return [int(v) for v in agree_tensor(torch.tensor(values, dtype=torch.int64), groups, device).tolist()]


def agree_tensor(t: torch.Tensor, groups: list[Group], device: torch.device) -> torch.Tensor:
    """The elementwise max of int64 ``t`` (the same shape on every rank) over the grid ``groups`` span, on the CPU."""
    t = t.to(device, copy=True)
    for g in groups:
        all_reduce(t, g, op="max", what="checkpoint agreement (do all ranks save / load the same step?)")
    return t.cpu()


def fingerprint(text: str) -> int:
    """A 60-bit digest of ``text``: equal on every rank iff ``agree_all([h, -h])`` gives ``[h, -h]``."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def gather_text(text: str, grid: Grid, *, limit: int = 2000) -> list[str]:
    """Every grid rank's ``text`` (at most ``limit`` bytes), on every rank, indexed by ``(pp_rank * dp + dp_rank) *
    tp + tp_rank``: an all-reduce (max) of a [ranks, bytes] table in which each rank fills its own row. Collective
    over the grid; meant for error paths (its size is ranks x the longest text)."""
    data = text.encode()[:limit]
    size = grid.pp * grid.dp * grid.tp
    longest = agree(len(data), grid.groups, grid.device)
    table = torch.zeros(size, longest, dtype=torch.uint8, device=grid.device)
    row = (grid.pp_rank * grid.dp + grid.dp_rank) * grid.tp + grid.tp_rank
    if data:
        table[row, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(grid.device)
    for g in grid.groups:
        all_reduce(table, g, op="max", what="checkpoint agreement (exchanging the ranks' messages)")
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in table.cpu().tolist()]


def rank_name(grid: Grid, index: int) -> str:
    """ "pp P dp D tp T" of grid index ``index`` (see :func:`gather_text`)."""
    tp_rank, rest = index % grid.tp, index // grid.tp
    return f"pp rank {rest // grid.dp} dp rank {rest % grid.dp} tp rank {tp_rank}"
