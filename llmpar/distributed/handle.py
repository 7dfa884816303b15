"""An in-flight collective (:class:`Handle`) and how a backend failure becomes a
:class:`~llmpar.distributed.errors.CollectiveError` (:func:`failing_as`): the two pieces every wrapper that moves bytes
between ranks shares (``collectives.py``, ``p2p.py``, ``exchange.py``, ``compressed.py`` and ``llmpar.comm``), so a
dead or stuck peer reads the same wherever it is met, and a wait marks the flight recorder's entry done."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch.distributed as dist

from llmpar.distributed.errors import CollectiveError, collective_error
from llmpar.distributed.flight import Entry, end


class Handle:
    """An in-flight collective. ``wait()`` blocks until the result is in the output tensor; a failure or timeout of
    the collective raises :class:`~llmpar.distributed.errors.CollectiveError` naming ``what`` and the group."""

    def __init__(
        self,
        works: list,
        finish: Callable[[], object] | None = None,
        *,
        what: str = "a collective",
        pg: dist.ProcessGroup | None = None,
        entry: Entry | None = None,
    ) -> None:
        self._works, self._entry = works, entry  # entry: the flight recorder's, marked done once waited for
        self._finish = finish
        self._done = False
        self._what, self._pg = what, pg

    def wait(self) -> None:
        if self._done:
            return
        with failing_as(self._what, self._pg):
            for w in self._works:
                w.wait()
        end(self._entry)
        if self._finish is not None:
            self._finish()
        self._done = True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


@contextlib.contextmanager
def failing_as(what: str, pg: dist.ProcessGroup | None) -> Iterator[None]:
    """Turn a backend failure inside the block (a dead or stuck peer, a timeout) into a :class:`CollectiveError`
    saying ``what`` ran over which group."""
    try:
        yield
    except RuntimeError as err:  # DistBackendError and gloo's errors are RuntimeErrors
        if pg is None or isinstance(err, CollectiveError):
            raise
        raise collective_error(err, what, pg) from err


def handle_or_wait(
    async_op: bool,
    works: list,
    finish: Callable[[], object] | None,
    what: str,
    pg: dist.ProcessGroup,
    entry: Entry | None = None,
) -> Handle | None:
    """``works`` (the backend's, None dropped) as a :class:`Handle` with ``finish`` to run once they are done: returned
    when ``async_op``, else waited for here (None returned)."""
    handle = Handle([w for w in works if w is not None], finish, what=what, pg=pg, entry=entry)
    if async_op:
        return handle
    handle.wait()
    return None


__all__ = ["Handle", "failing_as", "handle_or_wait"]
