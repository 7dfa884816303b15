"""Turning one rank's exception into the same error on every rank, instead of a hang.

A pipeline step blocks in point-to-point receives: if stage 2 raises, stage 1 waits forever for its gradients, and
gloo gives no way to interrupt a blocked receive (``ProcessGroup.abort()`` does not wake the peer). So the step runs
in a worker thread while the calling thread watches the job's rendezvous store (the c10d store every rank already
shares). A rank whose step raises writes ``where + traceback`` under a key known to all ranks (first writer wins);
every other rank sees it within ``poll_s``, stops waiting and raises :class:`PipelineStageError` with that text.
The abandoned worker thread stays blocked: after a failed step the pipeline's groups are unusable and the job should
exit (under torchrun the launcher then tears the job down).
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


class PipelineStageError(RuntimeError):
    """A pipeline step failed on some rank; the message holds that rank's stage and traceback."""


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default store: fall back to running without a monitor
        return None


class FailureChannel:
    """Runs step functions so that a failure on any rank fails the step on every rank."""

    def __init__(self, name: str, *, poll_s: float = 0.02) -> None:
        self.key = f"llmpar/pipeline/{name}/error"
        self.poll_s = poll_s
        self.store = _store()
        self.broken: str | None = None

    @classmethod
    def for_runner(cls, *, poll_s: float = 0.02) -> "FailureChannel":
        """A channel for the next pipeline runner this rank builds: ``runner<n>`` for the n-th, counted in the job's
        store per global rank (every rank builds its runners in the same order, so the n-th runners of all ranks
        share a key, and a failed runner's key never reaches a later runner). The count lives in the store, not in
        this process: it starts afresh with a new process group."""
        store = _store()
        n = store.add(f"llmpar/pipeline/runners/rank{dist.get_rank()}", 1) if store is not None else 0
        return cls(f"runner{n}", poll_s=poll_s)

    def _posted(self) -> str | None:
        if self.store is None or not self.store.check([self.key]):
            return None
        return self.store.get(self.key).decode(errors="replace")

    def _post(self, message: str) -> str:
        """Write ``message`` unless another rank wrote first; returns the message that stands."""
        if self.store is None:
            return message
        return self.store.compare_set(self.key, "", message).decode(errors="replace")

    def run(self, fn: Callable[[], Any], where: str) -> Any:
        if self.broken is None:
            self.broken = self._posted()
        if self.broken is not None:
            raise PipelineStageError(
                "the pipeline is unusable after a failed step; restart the job. The step failed with:\n" + self.broken
            )
        box: dict[str, Any] = {}
        done = threading.Event()
        grad_enabled = torch.is_grad_enabled()

        def work() -> None:
            try:
                with torch.set_grad_enabled(grad_enabled):
                    box["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - reported to every rank below
                box["error"] = err
                box["trace"] = traceback.format_exc()
            finally:
                done.set()

        worker = threading.Thread(target=work, name="llmpar-pipeline-step", daemon=True)
        worker.start()
        while not done.wait(self.poll_s):
            posted = self._posted()
            if posted is not None:
                self.broken = posted
                raise PipelineStageError(posted)
        worker.join()  # finished: let it exit now, not while the interpreter shuts down (C++ thread state aborts)
        if "error" in box:
            mine = f"pipeline step failed on {where}:\n{box['trace']}"
            self.broken = self._post(mine)
            raise PipelineStageError(self.broken) from box["error"]
        return box["value"]


__all__ = ["FailureChannel", "PipelineStageError"]
