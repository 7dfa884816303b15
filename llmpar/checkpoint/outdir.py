"""Where a conversion writes: a new directory built beside the target and swapped in whole, so that the target holds
the previous output or the new one, never a mix, whenever the process stops.

    with staged("out", overwrite=False) as tmp:     # tmp: an empty directory beside out (.out.tmp-PID-HEX)
        ...every file written into tmp...            # an error: tmp removed, out untouched
    # out is now what was written into tmp; the previous out (overwrite=True) was removed after the swap

Refused before anything is written (``ValueError`` naming the path and what it holds): a target that exists and
is not an empty directory unless ``overwrite`` (``--overwrite``; then the target is replaced whole: no file of an
earlier output survives, whatever its name), a target that is a file.

The swap is ``publish.swap_in``, the one a checkpoint's publish makes: Linux's ``renameat2(RENAME_EXCHANGE)``
exchanges the two directories in one step (a kill at any instant leaves the old output or the new one at the
target); where it is not available (another OS, a file system without it), two renames: the target moved aside to
``.NAME.old-PID-HEX``, then the new directory into its place. A kill between those two leaves no target and the
previous output whole beside it. The next ``staged`` call into the same target repairs what a killed one left: a
``.NAME.old-*`` copy whose target is missing is moved back, and the ``.NAME.tmp-*`` / ``.NAME.old-*`` directories of
processes no longer running are removed.

A target that is a symlink to a directory: the directory it names is replaced (built beside it), the link kept.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from typing import Iterator

from llmpar.checkpoint import publish
from llmpar.checkpoint.files import CheckpointError, fsync_dir

_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO)  # a write's, with no file name


def check_target(out_dir: str, overwrite: bool, source: str | None = None) -> str:
    """The directory ``out_dir`` resolves to (a symlink followed); a ``ValueError`` naming it when it is a file, a
    non-empty directory and not ``overwrite``, or holds ``source`` (the checkpoint read: replacing the directory
    would delete it); a ``TypeError`` when ``overwrite`` is not a bool."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite={overwrite!r} must be a bool (True replaces a non-empty output directory whole)")
    target = os.path.realpath(os.fspath(out_dir))
    if source is not None and (os.path.realpath(os.fspath(source)) + os.sep).startswith(target + os.sep):
        raise ValueError(f"output directory {out_dir} holds the checkpoint read ({source}): write elsewhere")
    _repair(target)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ValueError(f"output directory {out_dir} is a file, not a directory")
    found = sorted(os.listdir(target)) if os.path.isdir(target) else []
    if found and not overwrite:
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise ValueError(
            f"output directory {out_dir} is not empty (it holds {shown}): pass overwrite=True "
            "(--overwrite) to replace it whole, or choose an empty or new directory"
        )
    return target


@contextlib.contextmanager
def staged(out_dir: str, *, overwrite: bool = False, source: str | None = None, what: str = "write") -> Iterator[str]:
    """Yield a new empty directory beside ``out_dir``; when the block ends without an error it replaces
    ``out_dir`` whole (module docstring), else it is removed. ``overwrite``: replace a non-empty ``out_dir``;
    ``source``: the checkpoint read, which ``out_dir`` must not hold. A failed write into the new directory (a full
    disk: an ``OSError`` naming a file in it, or with a write's errno) becomes a ``CheckpointError`` naming the
    file as it would have been in ``out_dir`` and the cause (``what``: the caller, its first word)."""
    target = check_target(out_dir, overwrite, source)
    parent, base = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    try:
        try:
            yield tmp
        except OSError as e:
            raise _named(e, tmp, out_dir, what) from e
        _fsync_tree(tmp)  # the new files reach the disk before the old export goes (a power loss, not only a kill)
        check_target(out_dir, overwrite)  # a file that landed in the target meanwhile is not lost silently
        swap(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (writers that fsync their own files pay a second, cheap one)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def _named(e: OSError, tmp: str, out_dir: str, what: str) -> BaseException:
    """``e`` as a ``CheckpointError`` naming the file in ``out_dir`` when it is a write into ``tmp``; else ``e``
    (a source file that cannot be read: its reader names it)."""
    # fsdecode: an OSError raised on a bytes path carries a bytes filename, compared here with str paths
    name = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes, os.PathLike)) else None
    inside = name if name is not None and os.path.realpath(name).startswith(os.path.realpath(tmp) + os.sep) else None
    if inside is None and e.errno not in _WRITE_ERRORS:
        return e
    where = moved([inside], tmp, out_dir)[0] if inside is not None else os.fspath(out_dir)
    code = errno.errorcode.get(e.errno, e.errno) if e.errno is not None else type(e).__name__
    return CheckpointError(
        f"{what}: cannot write {where}: {e.strerror or e} ({code}); nothing of this {what} was "
        f"left in place, {out_dir} is as it was"
    )


def moved(paths: list[str], tmp: str, out_dir: str) -> list[str]:
    """``paths`` under ``tmp`` named as they are now, under ``out_dir``."""
    return [os.path.join(os.fspath(out_dir), os.path.relpath(p, tmp)) for p in paths]


def swap(tmp: str, target: str) -> None:
    """Directory ``tmp`` becomes ``target`` (``publish.swap_in``, exchanged in one step where it can be); the previous
    ``target`` (if any) is removed once it is out of place."""
    parent, base = os.path.split(target)
    aside = os.path.join(parent, f".{base}.old-{os.getpid()}-{secrets.token_hex(4)}")
    previous = publish.swap_in(tmp, target, aside, exchange=True)
    if previous:
        shutil.rmtree(previous, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _repair(target: str) -> None:
    """Undo what a killed ``staged`` call into ``target`` left (module docstring)."""
    parent, base = os.path.split(target)
    if not os.path.isdir(parent):
        return
    pattern = re.compile(rf"\.{re.escape(base)}\.(tmp|old)-(\d+)-[0-9a-f]+")
    for name in sorted(os.listdir(parent)):
        m = pattern.fullmatch(name)
        if m is None or _alive(int(m.group(2))):  # a conversion still running (this process's too)
            continue
        path = os.path.join(parent, name)
        if m.group(1) == "old" and not os.path.lexists(target):
            publish.put_back(path, target, "a conversion into it was stopped between its two renames")
        else:
            shutil.rmtree(path, ignore_errors=True)


__all__ = ["check_target", "moved", "staged", "swap"]
