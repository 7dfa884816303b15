"""Which hosts and slots a launch uses, with DeepSpeed's launcher rules (``deepspeed/launcher/runner.py``).

A hostfile (MPI style, DeepSpeed's format) lists one host per line::

    # comments and blank lines are skipped
    worker-0 slots=4
    worker-1 slots=4   # a trailing comment is allowed

``--include`` / ``--exclude`` (mutually exclusive) filter that pool with ``NODE_SPEC[@NODE_SPEC ...]``,
``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``: ``worker-0@worker-1:0,2`` keeps all of worker-0 and slots 0 and 2 of worker-1;
``--exclude worker-1:0`` keeps everything but slot 0 of worker-1 (a bare name drops the whole host). Hosts keep the
hostfile's order (ranks follow it). ``--num_nodes N`` then keeps the first N hosts, ``--num_gpus P`` slots 0..P-1 on
each; neither may be combined with ``--include`` / ``--exclude`` (as in DeepSpeed). Where DeepSpeed would silently
use fewer nodes or more slots than the hostfile has, these raise: every error names the flag or hostfile line.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Iterable

Pool = "OrderedDict[str, list[int]]"  # host -> slot ids, in hostfile order
MAX_SLOTS = 4096  # processes per host: far above any node's devices or cores; more is a typo (or hostile input)

_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)\s*(#.*)?$")


def parse_hostfile(lines: Iterable[str], *, name: str = "hostfile") -> "OrderedDict[str, int]":
    """``host slots=N`` lines -> {host: N} in file order. Comments (``#``) and blank lines are skipped. A malformed
    line, a host listed twice, ``slots`` outside 1..:data:`MAX_SLOTS` or a file without hosts raises a ValueError
    naming ``name:line``."""
    pool: OrderedDict[str, int] = OrderedDict()
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(
                f"{name}:{number}: {line!r} is not a hostfile entry: expected 'HOST slots=N' (e.g. "
                "'worker-0 slots=8'), a '# comment' or a blank line"
            )
        host, digits = match["host"], match["slots"]
        if len(digits.lstrip("0")) > len(str(MAX_SLOTS)) or int(digits) > MAX_SLOTS:
            raise ValueError(f"{name}:{number}: host {host!r} has slots={digits}: slots must be in 1..{MAX_SLOTS}")
        slots = int(digits)
        if host in pool:
            raise ValueError(
                f"{name}:{number}: host {host!r} is listed again (first on line {first_line[host]}): "
                "give each host once"
            )
        if slots < 1:
            raise ValueError(f"{name}:{number}: host {host!r} has slots={slots}: slots must be in 1..{MAX_SLOTS}")
        pool[host], first_line[host] = slots, number
    if not pool:
        raise ValueError(f"{name}: no hosts: expected lines 'HOST slots=N'")
    return pool


def read_hostfile(path: str) -> "OrderedDict[str, int]":
    """:func:`parse_hostfile` of the file at ``path`` (an unreadable file raises a ValueError naming it)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--hostfile {path}: cannot be read: {e.strerror or e}") from None
    return parse_hostfile(text.splitlines(), name=path)


def _node_specs(spec: str, flag: str) -> "OrderedDict[str, list[int] | None]":
    """``NAME[:SLOT[,SLOT ...]]@...`` -> {host: sorted slots, or None for the whole host} (a host named twice merges
    its slots, as DeepSpeed)."""
    out: OrderedDict[str, list[int] | None] = OrderedDict()
    for part in spec.split("@"):
        host, colon, slots_text = part.partition(":")
        if not host or (colon and not slots_text):
            raise ValueError(
                f"{flag} {spec!r}: {part!r} is not NAME or NAME:SLOT[,SLOT...] (e.g. 'worker-0@worker-1:0,2')"
            )
        slots: list[int] | None = None
        if colon:
            try:
                slots = [int(s) for s in slots_text.split(",")]
            except ValueError:
                raise ValueError(
                    f"{flag} {spec!r}: slots {slots_text!r} of {host!r} must be integers separated by "
                    "commas (e.g. 'worker-1:0,2')"
                ) from None
        if host in out and (out[host] is None or slots is None):
            out[host] = None
        else:
            out[host] = sorted(set((out.get(host) or []) + (slots or []))) if slots is not None else None
    return out


def filter_pool(pool: "OrderedDict[str, int]", include: str = "", exclude: str = "") -> "OrderedDict[str, list[int]]":
    """The hosts and slots ``include`` / ``exclude`` leave of ``pool`` ({host: slot count}), in pool order.
    Raises a ValueError for both given, a host not in the pool, a slot the host does not have, or nothing left."""
    if include and exclude:
        raise ValueError(f"--include {include!r} and --exclude {exclude!r}: give one of them, not both")
    active: OrderedDict[str, list[int]] = OrderedDict((h, list(range(n))) for h, n in pool.items())
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    if not spec:
        return active
    chosen = _node_specs(spec, flag)
    for host, slots in chosen.items():
        if host not in active:
            raise ValueError(f"{flag} {spec!r}: host {host!r} is not in the pool (hosts: {', '.join(active)})")
        for s in slots or []:
            if s not in active[host]:
                raise ValueError(
                    f"{flag} {spec!r}: host {host!r} has no slot {s} (it has slots 0-{len(active[host]) - 1})"
                )
    if include:
        out = OrderedDict((h, (chosen[h] if chosen[h] is not None else active[h])) for h in active if h in chosen)
    else:
        out = OrderedDict()
        for h, slots in active.items():
            drop = chosen.get(h, [])
            left = [] if drop is None else [s for s in slots if s not in drop]
            if left:
                out[h] = left
    if not out:
        raise ValueError(f"{flag} {spec!r} leaves no host and slot to run on")
    return out


def trim(
    active: "OrderedDict[str, list[int]]",
    num_nodes: int | None,
    num_gpus: int | None,
) -> "OrderedDict[str, list[int]]":
    """The first ``num_nodes`` hosts of ``active``, each with slots ``0..num_gpus-1`` (None: as they are). Asking
    for more hosts or slots than there are raises a ValueError naming the flag."""
    if num_nodes is not None:
        if num_nodes > len(active):
            raise ValueError(f"--num_nodes {num_nodes}: the hostfile has {len(active)} host(s) ({', '.join(active)})")
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        short = [f"{h} (slots={len(s)})" for h, s in active.items() if len(s) < num_gpus]
        if short:
            raise ValueError(f"--num_gpus {num_gpus}: more than the hostfile gives {', '.join(short)}")
        active = OrderedDict((h, list(range(num_gpus))) for h in active)
    return active


def resolve_pool(
    *, hostfile: str | None, include: str, exclude: str, num_nodes: int | None, num_gpus: int | None, local_slots: int
) -> "OrderedDict[str, list[int]]":
    """The active {host: slots} of a launch: the hostfile's, filtered by ``include`` / ``exclude``, trimmed by
    ``num_nodes`` / ``num_gpus`` (DeepSpeed's order and rules). Without a hostfile: ``{"localhost": slots}`` with
    ``num_gpus`` (else ``local_slots``) slots, filtered; ``num_nodes`` is then the caller's to use."""
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise ValueError(
            "--num_nodes / --num_gpus cannot be combined with --include / --exclude (as in DeepSpeed): "
            "name the hosts and slots in --include, or drop it"
        )
    if hostfile is not None:
        pool = read_hostfile(hostfile)
    else:
        pool = OrderedDict(localhost=num_gpus if num_gpus is not None else local_slots)
        num_nodes = num_gpus = None  # without a hostfile the nodes are not listed here (the caller counts them)
    return trim(filter_pool(pool, include, exclude), num_nodes, num_gpus)


__all__ = ["MAX_SLOTS", "filter_pool", "parse_hostfile", "read_hostfile", "resolve_pool", "trim"]
