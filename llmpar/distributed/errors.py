"""Collective failures reported with llmpar's context instead of a bare backend error.

A rank that dies leaves its peers with gloo's "Connection reset by peer" / "Connection closed by peer"; a rank that
stops (SIGSTOP, a stuck data loader) or runs a different collective (uneven step counts, a save on one rank only)
leaves them waiting until the group's timeout. Either way the survivors raise :class:`CollectiveError`, which says
which operation failed (``what``: "reduce-scatter of gradient unit 3", "checkpoint agreement", ...), on which ranks,
on which rank, and what probably happened; callers that know more (the engine: its step) add it with
:meth:`CollectiveError.add_context`. The flight recorder (``flight.py``) adds what the ranks' records say: which rank
is behind, ahead or ran a different collective, and what it was doing (:attr:`CollectiveError.flight`).
"""

from __future__ import annotations

import torch.distributed as dist

from llmpar.distributed.flight import RECORDER, on_failure

_GONE = (
    "connection reset",
    "connection closed",
    "broken pipe",
    "end of file",
    "eof",
    "connection refused",
    "socket closed",
    "peer",
)
_TIMEOUT = ("timed out", "timeout", "deadline")


class CollectiveError(RuntimeError):
    """A collective failed or timed out; ``str()`` gives the operation, the group, this rank and the diagnosis."""

    def __init__(self, what: str, group: str, rank: int, cause: BaseException) -> None:
        self.what, self.group, self.rank, self.cause = what, group, rank, cause
        self.context: list[str] = []
        self.flight = ""  # the flight recorder's diagnosis (flight.on_failure), appended to the message
        super().__init__(what)

    @property
    def kind(self) -> str:
        """ "timeout" (a peer is stuck or ran another collective), "gone" (a peer died or left) or "error"."""
        text = str(self.cause).lower()
        if any(k in text for k in _TIMEOUT):
            return "timeout"
        if any(k in text for k in _GONE):
            return "gone"
        return "error"

    def add_context(self, text: str) -> "CollectiveError":
        self.context.append(text)
        return self

    def __str__(self) -> str:
        why = {
            "timeout": "a peer rank did not take part within the collective timeout: it is stuck (a hung data loader, "
            "a stopped process) or is running a different collective (uneven step counts across ranks, a "
            "checkpoint saved on some ranks only)",
            "gone": "a peer rank is gone (it died or exited)",
            "error": "the backend reported an error",
        }[self.kind]
        where = "".join(f", {c}" for c in self.context)
        first = str(self.cause).strip().splitlines()[0] if str(self.cause).strip() else type(self.cause).__name__
        return (
            f"llmpar: {self.what} over {self.group} failed on global rank {self.rank}{where}: {why} "
            f"[{type(self.cause).__name__}: {first}]" + (f". {self.flight}" if self.flight else "")
        )


class TokenIdError(ValueError, IndexError):
    """A token / class id outside the vocabulary (a tensor-parallel embedding or loss, a model's loss). A ValueError
    (llmpar's bad-input error) and an IndexError (what ``nn.Embedding`` and ``F.cross_entropy`` raise on CPU), so
    either ``except`` catches it. Defined here, on the lowest floor, so that the models and the tensor-parallel layers
    raise the same class."""


def describe_group(pg: dist.ProcessGroup) -> str:
    """ "the group of global ranks [0, 2]" (or the whole job)."""
    try:
        ranks = dist.get_process_group_ranks(pg)
    except (RuntimeError, ValueError, AttributeError):
        return "a process group"
    if len(ranks) == dist.get_world_size():
        return f"all {len(ranks)} ranks"
    return f"the group of global ranks {ranks}"


def collective_error(err: BaseException, what: str, pg: dist.ProcessGroup) -> CollectiveError:
    """``err`` raised by a collective on ``pg`` as a :class:`CollectiveError` (an existing one passes through), with
    the flight recorder's diagnosis (this rank's record written, the group's ranks' records compared)."""
    if isinstance(err, CollectiveError):
        return err
    error = CollectiveError(what, describe_group(pg), dist.get_rank() if dist.is_initialized() else 0, err)
    error.flight = on_failure(RECORDER, pg, err, error.kind)
    return error


__all__ = ["CollectiveError", "TokenIdError", "collective_error", "describe_group"]
