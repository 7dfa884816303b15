"""Agreement between ranks: checks that every rank of a group passed the same thing, or that none failed, each
raising the same clear error on every rank instead of leaving the healthy ranks waiting in a later collective."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from llmpar.distributed.collectives import Group, GroupRef, all_gather_flat, all_reduce, as_group, collective_device


def check_same_on_ranks(fingerprint: str, group: "Group | GroupRef", *, what: str, hint: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless all of them passed the same ``fingerprint``.

    One small all-gather of a 60-bit digest: cheap enough to run at start-up, and it turns a mismatch (different
    models, configs or layouts on different ranks) into a clear error everywhere instead of a hang later.
    """
    pg = as_group(group)
    digest = int(hashlib.sha256(fingerprint.encode()).hexdigest()[:15], 16)
    device = collective_device(pg)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(dist.get_world_size(pg), dtype=torch.int64, device=device)
    all_gather_flat(everyone, mine, pg)
    values = everyone.tolist()
    if len(set(values)) > 1:
        by_value: dict[int, list[int]] = {}
        for r, h in enumerate(values):
            by_value.setdefault(h, []).append(r)
        raise ValueError(
            f"{what}: group ranks {sorted(by_value.values())} disagree (this is group rank {dist.get_rank(pg)}); {hint}"
        )


def raise_if_any_failed(
    error: BaseException | None,
    groups: "Group | GroupRef | list",
    *,
    what: str,
    types: tuple[type[BaseException], ...] = (),
) -> None:
    """Collective over ``groups`` (one group, or several spanning a grid such as a mesh's axes, taken in turn): when
    any rank passes an ``error``, every rank raises. A failing rank re-raises its own error; the others raise the same
    exception type naming a failing rank (global rank) and its message, so that a fault on one rank (a config it
    cannot read, a bad value) is reported everywhere, not as a hang or a "connection closed by peer" on the others.
    The same type: TypeError, ValueError or one of ``types`` (classes taking a message), by name; else RuntimeError.
    Costs one small all-reduce per group (and a gather of the messages per group on failure)."""
    pgs = [as_group(g) for g in (groups if isinstance(groups, (list, tuple)) else [groups])]
    device = collective_device(pgs[0])
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    for pg in pgs:  # the max over each group in turn: every rank of the grid learns whether any rank failed
        all_reduce(flag, pg, op="max")
    if not int(flag):
        return
    known = None if error is None else (dist.get_rank(), type(error).__name__, str(error))
    for pg in pgs:  # pass a failing rank's message along in the same way
        messages: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(messages, known, group=pg)
        known = known or next((m for m in messages if m is not None), None)
    if error is not None:
        raise error
    rank, kind, message = known if known is not None else ("?", "RuntimeError", "(no message)")
    known_types: tuple[type[BaseException], ...] = (TypeError, ValueError, *types)
    exc = {t.__name__: t for t in known_types}.get(kind, RuntimeError)
    raise exc(f"{what}: rank {rank} failed: {message}")


__all__ = ["check_same_on_ranks", "raise_if_any_failed"]
