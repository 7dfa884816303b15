"""One save between its snapshot and its publish (``save.py``'s phases 3 and 4): the write of this rank's files
(the caller's thread, or a thread of its own under ``async_save``), the finish (collective: the ranks agree on the
writes, rank 0 publishes through ``publish.py``, they agree again), and the finish of a save whose engine went before
it was published (no collectives: rank 0 publishes once every rank's side file is on disk). The pending save is the
engine's own (``engine.checkpoint_pending``): :func:`pending` and :func:`wait_checkpoint` ask the engine for it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any

from llmpar.checkpoint import blockwrite, files, publish
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.protocol import Checkpointable, FaultHook, Grid

logger = logging.getLogger("llmpar")


@dataclass(kw_only=True)
class Save:
    """One save between its snapshot and its publish: what this rank writes, and how the ranks finish it."""

    save_dir: str
    tag: str
    tmp: str
    grid: Grid
    payload: dict  # this rank's file: host copies, or (a synchronous save) views of the live shards
    meta: dict  # metadata.json without what rank 0 collects at the publish, as of the snapshot (rank 0)
    side: dict  # what this rank tells rank 0 next to its file: its pp rank's layout, its extras' names
    client_state: Any  # deep copy (rank 0), else None
    has_client: bool
    fault_hook: FaultHook | None = None  # tests: called at "before_write", "shard_written", "before_publish", ...
    err: str | None = None  # set by write()
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0  # how long write() took
    finalizer: weakref.finalize | None = None  # async: finishes the save if the engine goes first (at exit)

    def write(self) -> None:
        """Phase 3 (any thread; no collectives): this rank's files into ``tmp``, its side file last (rank 0 counts
        the side files); an error is kept in ``err`` and left in ``RANKFILE.failed``."""
        g, t0 = self.grid, time.perf_counter()
        name = files.rank_file(g.dp_rank, g.tp_rank, g.pp_rank, g.pp)
        try:
            files.fault(self.fault_hook, "before_write")
            if g.rank0:
                files.write_json_atomic(
                    os.path.join(self.tmp, files.PART),
                    {
                        "meta": self.meta,
                        "pp": g.pp,
                        "dp": g.dp,
                        "tp": g.tp,
                        "has_client": self.has_client,
                        "format": files.FORMAT_VERSION,
                    },
                )
            info = blockwrite.write(os.path.join(self.tmp, name), self.payload)
            info.update(
                dp_rank=g.dp_rank,
                tp_rank=g.tp_rank,
                pp_rank=g.pp_rank,
                has_shards=self.payload["buffers"] is not None,
                **self.side,
            )
            if g.rank0 and self.has_client:
                cinfo = files.save_file(self.client_state, os.path.join(self.tmp, files.CLIENT_STATE))
                cinfo.update(dp_rank=0, tp_rank=0, pp_rank=0, has_shards=False)
                files.write_json_atomic(os.path.join(self.tmp, files.CLIENT_STATE + ".json"), cinfo)
            files.fault(self.fault_hook, "shard_written")
            files.write_json_atomic(os.path.join(self.tmp, name + ".json"), info)
        except BaseException as e:  # noqa: BLE001 - agreed with the other ranks in finish(), then raised everywhere
            self.err = f"pp rank {g.pp_rank} dp rank {g.dp_rank} tp rank {g.tp_rank} failed writing its shard: {e!r}"
            logger.error("%s\n%s", self.err, traceback.format_exc())
            try:  # for a publish without the ranks (at exit): this rank will not write its side file
                with open(os.path.join(self.tmp, name + files.FAILED), "w") as f:
                    f.write(self.err)
            except OSError:
                pass
        finally:
            self.payload = {}  # drop the host copies as soon as they are on disk
            self.client_state = None
            self.seconds = time.perf_counter() - t0
            self.done.set()

    def _discard(self) -> None:
        """Rank 0, once every rank is past its write (after an agreement): delete this save's files."""
        if self.grid.rank0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self) -> str:
        """Phase 4 (main thread, collective over the grid): agree on the writes, rank 0 publishes, agree again. A
        failure deletes this save's files (the previous checkpoint stays ``latest``); a success cleans up what
        earlier failures left in ``save_dir`` (``publish.cleanup``)."""
        if self.finalizer is not None:
            self.finalizer.detach()
        if self.thread is not None:
            self.thread.join()
        g, err = self.grid, self.err
        if files.agree(1 if err else 0, g.groups, g.device):
            self._discard()
            raise CheckpointError(
                err
                or f"another rank failed writing checkpoint {self.tag!r} (see its error); "
                f"nothing was published, the previous checkpoint in {self.save_dir} is "
                f"untouched"
            )
        path = os.path.join(self.save_dir, self.tag)
        if g.rank0:
            try:
                publish.assemble(self.tmp)
                path = publish.publish(self.save_dir, self.tmp, self.tag, self.fault_hook)
            except Exception as e:  # noqa: BLE001
                err = f"rank 0 failed publishing {path}: {e!r}"
                logger.error("%s\n%s", err, traceback.format_exc())
                self._discard()
            else:
                publish.cleanup(self.save_dir)
        if files.agree(1 if err else 0, g.groups, g.device):
            raise CheckpointError(err or f"rank 0 failed publishing checkpoint {self.tag!r} (see its error)")
        if g.rank0:
            logger.info("saved checkpoint %s", path)
        return path

    def finish_orphaned(self) -> None:
        """The engine went (garbage-collected, or the interpreter exits) with this save unpublished. Collectives
        cannot run here (ranks exit in any order, the process group may be gone), so: every rank finishes writing
        its file; rank 0 waits for every rank's side file on disk (up to ``LLMPAR_CKPT_EXIT_WAIT_S`` seconds,
        default the longer of 60 s and twice its own write) and publishes without the agreement; else it warns and
        says what to do. Never raises."""
        where = os.path.join(self.save_dir, self.tag)
        try:
            if self.thread is not None:
                self.thread.join()
            if self.err is not None:
                logger.warning(
                    "async checkpoint %s was not saved (%s); the previous checkpoint stays latest", where, self.err
                )
                return
            if not self.grid.rank0:
                logger.warning(
                    "async checkpoint %s was still pending when its engine went (collected, or the "
                    "interpreter exits): this rank's file is written, rank 0 publishes it. Call "
                    "engine.wait_checkpoint() before the end of the script",
                    where,
                )
                return
            limit = max(60.0, 2 * self.seconds)
            try:
                limit = float(os.environ.get("LLMPAR_CKPT_EXIT_WAIT_S", limit))
            except ValueError:
                logger.warning(
                    "LLMPAR_CKPT_EXIT_WAIT_S=%r is not a number of seconds: waiting %.0fs",
                    os.environ["LLMPAR_CKPT_EXIT_WAIT_S"],
                    limit,
                )
            deadline = time.monotonic() + limit
            done, missing, failed = publish.state(self.tmp)
            while not done and not failed and time.monotonic() < deadline:
                time.sleep(0.1)
                done, missing, failed = publish.state(self.tmp)
            if failed:
                logger.warning(
                    "async checkpoint %s was still pending when its engine went (collected, or the "
                    "interpreter exits) and is NOT published: %s. The previous checkpoint stays latest; "
                    "the next save into %s deletes %s",
                    where,
                    "; ".join(f"rank file {n} failed: {e}" for n, e in failed.items()),
                    self.save_dir,
                    self.tmp,
                )
                return
            if not done:
                logger.warning(
                    "async checkpoint %s was still pending when its engine went (collected, or the "
                    "interpreter exits) and is NOT published: after %.0fs (LLMPAR_CKPT_EXIT_WAIT_S) %s "
                    "still missing from %s (those ranks are still writing, or gone). The previous "
                    "checkpoint stays latest. Once every rank's file is there, `llmpar checkpoint publish "
                    "%s %s` publishes it (the next save into %s deletes it). Call engine.wait_checkpoint() "
                    "before the end of the script",
                    where,
                    limit,
                    ", ".join(missing),
                    self.tmp,
                    self.save_dir,
                    self.tag,
                    self.save_dir,
                )
                return
            path = publish.publish_written(self.save_dir, self.tag)
            logger.warning(
                "async checkpoint %s was still pending when its engine went (collected, or the interpreter "
                "exits): written by every rank and published now, without the ranks' agreement. Call "
                "engine.wait_checkpoint() before the end of the script",
                path,
            )
        except Exception as e:  # noqa: BLE001 - a finalizer must not raise
            logger.error(
                "async checkpoint %s could not be finished when its engine went: %r; its files are in %s "
                "(`llmpar checkpoint publish %s %s` publishes them if complete)",
                where,
                e,
                self.tmp,
                self.save_dir,
                self.tag,
            )


def pending(engine: Checkpointable) -> Save | None:
    """The engine's async save that is not published yet (its thread may have finished writing), else None."""
    job = engine.checkpoint_pending
    return job if isinstance(job, Save) else None


def wait_checkpoint(engine: Checkpointable) -> str | None:
    """Finish the engine's pending async save: wait for its writes, then publish it (collective over the grid, call
    it on every rank). Returns the published path, None when no save was pending; raises ``CheckpointError`` on every
    rank if any rank's writer failed (the previous checkpoint stays ``latest``)."""
    job = engine.checkpoint_pending
    if job is None:
        return None
    engine.checkpoint_pending = None
    return job.finish()


__all__ = ["Save", "pending", "wait_checkpoint"]
