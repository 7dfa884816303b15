"""Publishing a written checkpoint (rank 0): ``DIR/.tmp-TAG`` becomes ``DIR/TAG``, ``DIR/latest`` names it, and what
earlier failures left behind is cleaned up. No collectives here: ``save.py`` calls :func:`publish` after the ranks
agreed that every write succeeded; :func:`publish_written` (an async save left pending at exit, the ``llmpar
checkpoint publish`` command) checks the same thing on disk instead, since each rank writes its side file
(``RANKFILE.json``: sha256, layout) last, after its file is complete and fsynced.

Instants of a publish and what a crash there leaves (every one loadable):

    before_publish     nothing moved: ``latest`` and the old checkpoint as they were (the new files in .tmp-TAG)
    old_moved_aside    (re-saving an existing TAG) old copy at .old-TAG, TAG missing: ``resolve`` loads .old-TAG,
                       the next publish of TAG keeps it until the new copy is in, the next cleanup moves it back
    before_latest      TAG complete (the new copy), ``latest`` not moved yet
    before_cleanup     (re-save) the new TAG and ``latest`` in place; .old-TAG removed by the next cleanup

A publish that raises (disk full) rolls back: the old copy back under TAG, the new files deleted. After a successful
publish, :func:`cleanup` deletes stale ``.tmp-*`` directories (failed or never published saves), ``.old-*`` copies
whose tag is in place again, and puts back an ``.old-TAG`` whose TAG is missing.

The swap itself (:func:`swap_in`: the old copy moved aside, then the new one into place; or, for an export's output
directory, ``outdir.py``, the two exchanged in one step where the OS can) is the one llmpar has.

A TAG that is a symlink (a checkpoint moved to other storage and linked back) is handled as the directory entry it
is: a re-save moves the link aside as ``.old-TAG`` and, once the new copy is in, unlinks it. So the new checkpoint
is a real directory ``DIR/TAG`` next to ``latest`` (its files written and renamed on the save directory's file
system), and the link's target, the previous copy, is left as it is: nothing is ever deleted through a link.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import logging
import os
import shutil

from llmpar.checkpoint import files, metacheck
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.protocol import FaultHook

logger = logging.getLogger("llmpar")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def publish(save_dir: str, tmp: str, tag: str, fault_hook: FaultHook | None = None) -> str:
    """Rank 0, once ``tmp`` is complete: it becomes ``save_dir/tag`` (an older copy of that tag is replaced:
    :func:`swap_in`), then ``latest`` names it; a failure rolls back (and raises). Returns the published path.
    ``fault_hook`` (tests): called at the instants of the module docstring."""
    final = os.path.join(save_dir, tag)
    old = os.path.join(save_dir, files.OLD_PREFIX + tag)
    moved = False
    files.fault(fault_hook, "before_publish")
    try:
        if os.path.lexists(final) and not files.complete(final) and files.complete(old):
            # an incomplete TAG next to a complete .old-TAG: the old copy is the good one, keep it
            files.remove_path(final)
            files.fsync_dir(save_dir)
            files.fault(fault_hook, "old_moved_aside")
        elif os.path.lexists(final):  # a symlink (even a dangling one) is moved aside like a directory
            files.remove_path(old)  # stale: the tag itself is complete
            moved = True
        swap_in(tmp, final, old, fault_hook=fault_hook)
        files.fault(fault_hook, "before_latest")
        files.write_latest(save_dir, tag)
    except Exception:
        _roll_back(final, old, tmp, moved)
        raise
    if os.path.lexists(old):
        files.fault(fault_hook, "before_cleanup")
        try:
            files.remove_path(old)  # a link: unlinked, its target left as it is
        except OSError:  # the published checkpoint is in place; cleanup() retries (and says why it cannot)
            pass
    return final


def swap_in(tmp: str, target: str, aside: str, *, exchange: bool = False, fault_hook: FaultHook | None = None) -> str:
    """Directory ``tmp`` becomes ``target`` (the one directory swap of llmpar: a publish, and an export's output
    directory, ``outdir.py``); returns the path that now holds the previous ``target`` ("" when there was none), for
    the caller to remove once it no longer needs it. A ``target`` already there is moved out of the way first: with
    ``exchange``, exchanged with ``tmp`` in one step where the OS and file system can (Linux's
    ``renameat2(RENAME_EXCHANGE)``: ``tmp`` then holds it); else renamed to ``aside`` (a crash between that rename and
    the next leaves no ``target`` and the previous copy whole at ``aside``: :func:`put_back` undoes it), the
    "old_moved_aside" instant of ``fault_hook``, then ``tmp`` renamed to ``target``. The directory is fsynced after
    each rename."""
    parent = os.path.dirname(target) or "."
    if not os.path.lexists(target):
        os.rename(tmp, target)
        files.fsync_dir(parent)
        return ""
    if exchange and _exchange(tmp, target):
        files.fsync_dir(parent)
        return tmp
    os.rename(target, aside)
    files.fsync_dir(parent)
    files.fault(fault_hook, "old_moved_aside")
    os.rename(tmp, target)
    files.fsync_dir(parent)
    return aside


def put_back(aside: str, target: str, why: str) -> None:
    """``aside`` (a previous copy moved out of the way by :func:`swap_in`, whose swap stopped before its second
    rename: ``why``) back in place as ``target``, which is missing."""
    os.rename(aside, target)
    logger.warning("put %s back as %s (%s)", aside, target, why)


def _exchange(a: str, b: str) -> bool:
    """Exchange directories ``a`` and ``b`` in one step (``renameat2(RENAME_EXCHANGE)``); False where the OS or the
    file system cannot (the caller then renames twice)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def _roll_back(final: str, old: str, tmp: str, moved: bool) -> None:
    """After a publish raised: the previous copy of the tag back in place, the new files gone."""
    try:
        if moved and files.complete(old):
            files.remove_path(final)
            os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # the loader still finds .old-TAG; the next cleanup retries
        logger.error("rolling back the publish of %s failed: %r", final, e)


def state(tmp: str) -> tuple[bool, list[str], dict[str, str]]:
    """(complete, missing, failed) of a save's directory ``tmp``: complete when ``metadata.json`` is assembled or
    rank 0's part and every rank's side file are there; ``missing``: the side files not there; ``failed``: {rank
    file: its writer's error} of ranks that failed."""
    failed = {}
    for marker in glob.glob(os.path.join(glob.escape(tmp), "*" + files.FAILED)):
        try:
            with open(marker) as f:
                failed[os.path.basename(marker)[: -len(files.FAILED)]] = f.read().strip()
        except OSError:
            failed[os.path.basename(marker)[: -len(files.FAILED)]] = "(unreadable)"
    if files.complete(tmp):
        return True, [], failed
    try:
        with open(os.path.join(tmp, files.PART)) as f:
            part = json.load(f)
    except (OSError, ValueError):
        return False, [files.PART], failed
    missing = [name + ".json" for name in _expected(part) if not os.path.isfile(os.path.join(tmp, name + ".json"))]
    return not missing and not failed, missing, failed


def _expected(part: dict) -> list[str]:
    """The files a save of this grid writes (each with its ``.json`` side file)."""
    pp, dp, tp, fmt = int(part["pp"]), int(part["dp"]), int(part["tp"]), int(part.get("format", 2))
    out = [files.rank_file(d, t, p, pp, fmt=fmt) for p in range(pp) for d in range(dp) for t in range(tp)]
    return out + ([files.CLIENT_STATE] if part.get("has_client") else [])


def assemble(tmp: str) -> dict:
    """Rank 0: rank 0's part and the ranks' side files become ``metadata.json`` (layout of every pp rank, extras,
    files, with its digest); the side files are removed. Raises when a file is missing."""
    done, missing, failed = state(tmp)
    if files.complete(tmp):
        return metacheck.read_metadata(tmp)
    if not done:
        raise CheckpointError(
            f"{tmp} is not complete: "
            + "; ".join(
                ([f"missing {', '.join(missing)}"] if missing else []) + [f"{n} failed: {e}" for n, e in failed.items()]
            )
        )
    with open(os.path.join(tmp, files.PART)) as f:
        part = json.load(f)
    meta, grid = part["meta"], part
    rank_files: dict[str, dict] = {}
    layouts: dict[int, list] = {}
    extras_at: dict[str, int] = {}
    for name in _expected(grid):
        with open(os.path.join(tmp, name + ".json")) as f:
            info = json.load(f)
        if "layout" in info:
            layouts[info["pp_rank"]] = info.pop("layout")
        for n in info.pop("extras", []):
            extras_at.setdefault(n, info["pp_rank"])
        rank_files[name] = info
    if sorted(layouts) != list(range(int(grid["pp"]))):
        raise CheckpointError(f"{tmp} holds the layouts of pp ranks {sorted(layouts)}, expected 0..{grid['pp'] - 1}")
    meta = {**meta, "files": rank_files, "extras": extras_at}
    meta["layout"] = {**meta["layout"], "buffers": [b for p in range(int(grid["pp"])) for b in layouts[p]]}
    meta = metacheck.write_metadata(tmp, meta)
    for name in _expected(grid):
        os.remove(os.path.join(tmp, name + ".json"))
    os.remove(os.path.join(tmp, files.PART))
    return meta


def publish_written(save_dir: str, tag: str) -> str:
    """Publish ``save_dir/.tmp-TAG`` when every rank's file is there (no collectives: an async save left pending at
    exit, or ``llmpar checkpoint publish``), then clean up; raises ``CheckpointError`` saying what is missing."""
    save_dir = os.fspath(save_dir)
    files.check_tag(tag)
    tmp = os.path.join(save_dir, files.TMP_PREFIX + tag)
    if not os.path.isdir(tmp):
        raise CheckpointError(f"{tmp} does not exist: no unpublished save of tag {tag!r} in {save_dir}")
    assemble(tmp)
    path = publish(save_dir, tmp, tag)
    cleanup(save_dir)
    return path


def unpublished(save_dir: str) -> list[str]:
    """Tags of ``save_dir`` whose save is complete in ``.tmp-TAG`` but was never published."""
    out = []
    for tmp in sorted(glob.glob(os.path.join(glob.escape(save_dir), files.TMP_PREFIX + "*"))):
        tag = os.path.basename(tmp)[len(files.TMP_PREFIX) :]
        if os.path.isdir(tmp) and state(tmp)[0] and not os.path.exists(os.path.join(save_dir, tag)):
            out.append(tag)
    return out


def cleanup(save_dir: str) -> None:
    """Rank 0, after a successful publish: delete stale ``.tmp-*`` directories (a complete one with a warning: its
    save was never published and a newer checkpoint is in place now) and ``latest.tmp``; ``.old-TAG``: deleted
    when TAG is complete, moved back to TAG when TAG is missing."""
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        try:
            if name.startswith(files.TMP_PREFIX) and (os.path.isdir(path) or os.path.islink(path)):
                if state(path)[0]:
                    logger.warning(
                        "deleting %s: a complete save of tag %r that was never published (a newer "
                        "checkpoint was saved since)",
                        path,
                        name[len(files.TMP_PREFIX) :],
                    )
                files.remove_path(path)
            elif name.startswith(files.OLD_PREFIX) and (os.path.isdir(path) or os.path.islink(path)):
                final = os.path.join(save_dir, name[len(files.OLD_PREFIX) :])
                if files.complete(final) or not os.path.exists(path):  # or a dangling link: nothing to put back
                    files.remove_path(path)
                elif files.complete(path) and not os.path.exists(final):
                    put_back(path, final, "a re-save of that tag had stopped between its renames")
            elif name == files.LATEST + ".tmp":
                os.remove(path)
        except OSError as e:  # cleaning is best effort: the checkpoint itself is published
            logger.warning("could not clean up %s: %r", path, e)
    files.fsync_dir(save_dir)
