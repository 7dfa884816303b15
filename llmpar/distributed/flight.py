"""Flight recorder: every rank keeps its last N collectives, and a failed one says which rank is behind or different.

Each collective of ``collectives.py`` and of ``llmpar.comm`` (the ``deepspeed.comm`` drop-in) starts an entry in the
process's :data:`RECORDER` (a bounded deque; ``LLMPAR_FLIGHT_RECORDER=N`` keeps the last N, default 256, 0 turns it
off): the operation and its description (``what``), the group (its name and global ranks) with a sequence number per
group (the k-th collective this rank started on that group: the same k names the same collective on every member),
elements and dtype, the engine's optimizer step (:attr:`FlightRecorder.step`, set by the engine), the call site
(file:line of the first frame outside ``llmpar/distributed`` and ``llmpar/comm/``) and the state: ``started`` ->
``done`` when waited for, or ``failed``. Cost: one frame walk and a deque append per collective
(``bench/bench_flight.py`` measures it).

When a collective fails or times out (:func:`on_failure`, called where the
:class:`~llmpar.distributed.errors.CollectiveError` is made), this rank:
1. writes its whole record as JSON to ``$LLMPAR_FLIGHT_DIR/rank{R}.json`` (default ``./llmpar_flight/``);
2. for a timeout or a lost peer, publishes a summary (per group: how many collectives it started, the last few,
   the one it failed in) under ``llmpar/flight/{R}`` in the default group's store (the TCPStore / FileStore that
   ``init_process_group`` already made), then reads the summaries of the failing group's other ranks, waiting at
   most ``LLMPAR_FLIGHT_WAIT_S`` seconds (default 2) for the ones not there yet. A summary older than the last
   collective this rank completed with its author is stale (an earlier failure that the job survived) and ignored.
   The store talk runs in a daemon thread joined with that deadline, so a store that is gone cannot add a hang;
3. adds to the error (:func:`diagnose`) per peer: no summary (it is stuck outside any collective, stopped, or
   gone; its last collective is then the last one this rank completed with it), behind or ahead on a group (how
   many collectives each started there, and its last one), the first collective where the two ranks' records
   differ (operation, size, dtype or call site: an extra or a skipped collective), and the collective it failed in.
Peers need not be able to answer: a rank that is stuck in Python (a data loader, ``time.sleep``) publishes nothing
and is named by its silence and this rank's own record.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

ENV_SIZE, ENV_DIR, ENV_WAIT = "LLMPAR_FLIGHT_RECORDER", "LLMPAR_FLIGHT_DIR", "LLMPAR_FLIGHT_WAIT_S"
DEFAULT_SIZE, DEFAULT_WAIT_S, PUBLISHED_PER_GROUP = 256, 2.0, 8
STORE_KEY = "llmpar/flight/{rank}"
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# call sites inside these are not the caller's: llmpar's collectives and the deepspeed.comm drop-in (llmpar/comm/)
_INTERNAL = (_HERE, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "comm") + os.sep)


def env_size(environ: Any = os.environ) -> int:
    """``LLMPAR_FLIGHT_RECORDER`` as a count of collectives kept (unset: 256; 0: off)."""
    raw = environ.get(ENV_SIZE, "").strip()
    if not raw:
        return DEFAULT_SIZE
    if not raw.isdigit():
        raise ValueError(
            f"{ENV_SIZE}={raw!r} must be a non-negative integer: how many collectives each rank keeps "
            f"(0 turns the flight recorder off, unset keeps {DEFAULT_SIZE})"
        )
    return int(raw)


def env_wait_s(environ: Any = os.environ) -> float:
    """``LLMPAR_FLIGHT_WAIT_S``: seconds a failing rank waits for the other ranks' summaries (unset: 2)."""
    raw = environ.get(ENV_WAIT, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_WAIT_S
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"{ENV_WAIT}={raw!r} must be a finite number of seconds >= 0 (how long a failing rank waits "
            f"for the other ranks' flight records; unset: {DEFAULT_WAIT_S})"
        )
    return value


class GroupLog:
    """Per process group: its name, global ranks and how many collectives this rank started on it (``pg``: a weak
    reference to the group)."""

    __slots__ = ("name", "ranks", "seq", "pg")

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = weakref.ref(pg)
        self.name = str(getattr(pg, "group_name", "") or f"id{id(pg)}")
        try:
            self.ranks = list(dist.get_process_group_ranks(pg))
        except (RuntimeError, ValueError, AttributeError):
            self.ranks = []
        self.seq = 0


# an entry is a plain list (a list literal costs a fifth of a class instance's __init__), indexed by these; the call
# site is kept as the frame's code and instruction offset, turned into file:line only when written out (site())
SEQ, OP, GROUP, NUMEL, DTYPE, WHAT, STEP, CODE, LASTI, T0, T1, STATE = range(12)
Entry = list  # [seq, op, GroupLog, numel, torch.dtype | None, what, step, code, lasti, t0, t1 (wall s), state]


def site(entry: Entry) -> str:
    """``file:line`` of the entry's call site."""
    code, lasti = entry[CODE], entry[LASTI]
    line = next((n for a, b, n in code.co_lines() if a <= lasti < b and n is not None), code.co_firstlineno)
    return f"{code.co_filename}:{line}"


def as_dict(e: Entry) -> dict[str, Any]:
    """An entry as JSON-ready fields."""
    return {
        "seq": e[SEQ],
        "op": e[OP],
        "group": e[GROUP].name,
        "ranks": e[GROUP].ranks,
        "numel": e[NUMEL],
        "dtype": str(e[DTYPE] or "")[6:],
        "what": e[WHAT],
        "step": e[STEP],
        "site": site(e),
        "t0": e[T0],
        "t1": e[T1],
        "state": e[STATE],
    }


class FlightRecorder:
    """This process's last ``size`` collectives (0: records nothing). :attr:`step`: the engine's optimizer step,
    stamped on each entry."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self.configure(size)

    def configure(self, size: int) -> None:
        """Keep the last ``size`` collectives from now on (forgets what was kept)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"flight recorder size={size!r} must be an int >= 0 (0 turns it off)")
        self.size = size
        self.entries: collections.deque[Entry] = collections.deque(maxlen=max(size, 1))
        self.groups: dict[int, GroupLog] = {}  # by id() of the group, checked against the log's weak reference
        self.step = 0

    def start(self, pg: dist.ProcessGroup, op: str, tensor: torch.Tensor | None, what: str) -> Entry | None:
        """Record that this rank starts ``op`` on ``pg`` (called by the collectives; None when off)."""
        if not self.size:
            return None
        log = self.groups.get(id(pg))
        if log is None or log.pg() is not pg:
            log = self.groups[id(pg)] = GroupLog(pg)
        log.seq += 1
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
            frame = frame.f_back
        entry = [
            log.seq,
            op,
            log,
            tensor.numel() if tensor is not None else 0,
            tensor.dtype if tensor is not None else None,
            what,
            self.step,
            frame.f_code,
            frame.f_lasti,
            time.time(),
            0.0,
            "started",
        ]
        self.entries.append(entry)
        return entry

    def first_unfinished(self, pg: dist.ProcessGroup) -> Entry | None:
        """The earliest entry of ``pg`` still started (collectives on a group finish in order): the stuck one."""
        log = self.groups.get(id(pg))
        return next((e for e in self.entries if e[GROUP] is log and e[STATE] == "started"), None)

    def summary(self, failed: Entry | None, error: str) -> dict[str, Any]:
        """What this rank publishes to its peers: per group the count started and the last few entries."""
        groups: dict[str, dict[str, Any]] = {}
        for e in self.entries:
            log = e[GROUP]
            g = groups.setdefault(log.name, {"ranks": log.ranks, "seq": log.seq, "entries": []})
            g["entries"].append(e)
        for g in groups.values():
            g["last"] = [as_dict(e) for e in g.pop("entries")[-PUBLISHED_PER_GROUP:]]
        return {
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "at": time.time(),
            "step": self.step,
            "failed": None if failed is None else as_dict(failed),
            "error": error,
            "groups": groups,
        }

    def last_done_with(self, rank: int) -> float:
        """When this rank last finished a collective on a group that has global ``rank`` in it (0.0: never)."""
        return max((e[T1] for e in self.entries if e[STATE] == "done" and rank in e[GROUP].ranks), default=0.0)


def end(entry: Entry | None) -> None:
    """Mark ``entry`` finished (its handle was waited for)."""
    if entry is not None:
        entry[T1], entry[STATE] = time.time(), "done"


def _dump(recorder: FlightRecorder, failed: Entry | None, error: str) -> str:
    """Write this rank's whole record to the flight directory; its path ("" if it could not be written)."""
    folder = os.environ.get(ENV_DIR) or os.path.join(os.getcwd(), "llmpar_flight")
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(folder, f"rank{rank}.json")
    record = {**recorder.summary(failed, error), "entries": [as_dict(e) for e in recorder.entries]}
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError:
        return ""
    return path


def _exchange(
    mine: dict[str, Any], peers: list[int], fresh_after: dict[int, float], wait_s: float
) -> tuple[dict[int, dict], str]:
    """Publish ``mine`` in the default store and read the peers' fresh summaries within ``wait_s`` seconds."""
    found: dict[int, dict] = {}
    problem: list[str] = []

    def talk() -> None:
        store = dist.distributed_c10d._get_default_store()
        store.set(STORE_KEY.format(rank=mine["rank"]), json.dumps(mine))
        deadline = time.monotonic() + wait_s
        while True:
            for p in peers:
                key = STORE_KEY.format(rank=p)
                if p not in found and store.check([key]):
                    record = json.loads(store.get(key))
                    if record.get("at", 0.0) >= fresh_after.get(p, 0.0):
                        found[p] = record
            if len(found) == len(peers) or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def guarded() -> None:
        try:
            talk()
        except Exception as err:  # noqa: BLE001 - the store may be gone with the failed rank
            problem.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")

    thread = threading.Thread(target=guarded, name="llmpar-flight", daemon=True)
    thread.start()
    thread.join(wait_s + 1.0)
    return dict(found), (f"the store did not answer ({problem[0]})" if problem else "")


def on_failure(recorder: FlightRecorder, pg: dist.ProcessGroup, cause: BaseException, kind: str) -> str:
    """After a collective on ``pg`` failed with ``cause`` (``kind``: "timeout", "gone" or "error"): mark the stuck
    entry failed, write this rank's record, exchange summaries with the group's other ranks (timeouts and lost peers
    only) and return the diagnosis to add to the error ("" when the recorder is off)."""
    if not recorder.size or not dist.is_initialized():
        return ""
    failed = recorder.first_unfinished(pg)
    if failed is not None:
        failed[T1], failed[STATE] = time.time(), "failed"
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    path = _dump(recorder, failed, text)
    where = f"records in {os.path.dirname(path)}" if path else "its record could not be written"
    if kind not in ("timeout", "gone"):
        return f"flight recorder: {where}"
    me = dist.get_rank()
    try:
        peers = [r for r in dist.get_process_group_ranks(pg) if r != me]
    except (RuntimeError, ValueError):
        peers = []
    try:
        wait_s = env_wait_s()
    except ValueError:  # checked at import; set wrong since: the default rather than an error hiding this one
        wait_s = DEFAULT_WAIT_S
    mine = recorder.summary(failed, text)
    found, problem = _exchange(mine, peers, {p: recorder.last_done_with(p) for p in peers}, wait_s)
    lines = diagnose(mine, {p: found.get(p) for p in peers}, wait_s)
    return (
        f"flight recorder ({where}): "
        + ("; ".join(lines) if lines else "no peer record differs")
        + (f"; {problem}" if problem else "")
    )


def describe(e: dict[str, Any]) -> str:
    """ "#3 all-reduce (sum) of 5 elements (float32) at train.py:40, step 2, done"."""
    return (
        f"#{e['seq']} {e['what']} ({e['dtype'] or 'no tensor'}) at {os.path.basename(e['site'].rsplit(':', 1)[0])}"
        f":{e['site'].rsplit(':', 1)[1]}, step {e['step']}, {e['state']}"
    )


def diagnose(mine: dict[str, Any], peers: dict[int, dict | None], wait_s: float) -> list[str]:
    """Sentences comparing this rank's summary ``mine`` with each peer's (None: it sent none)."""
    me, out = mine["rank"], []
    failed = mine.get("failed")
    for p, theirs in sorted(peers.items()):
        if theirs is None:
            line = (
                f"global rank {p} sent no flight record within {wait_s:g}s: it is stuck outside the collectives "
                "(a data loader, a stopped process), or gone"
            )
            if failed is not None:
                g = mine["groups"].get(failed["group"], {})
                prior = [e for e in g.get("last", []) if e["seq"] == failed["seq"] - 1]
                line += f"; it has not joined {describe(failed)} on group {failed['group']} {g.get('ranks')}"
                if prior:
                    line += f"; its last collective there, completed with this rank: {describe(prior[0])}"
            out.append(line)
            continue
        for name in sorted(set(mine["groups"]) | set(theirs["groups"])):
            a, b = mine["groups"].get(name), theirs["groups"].get(name)
            ranks = (a or b)["ranks"]
            if me not in ranks or p not in ranks:
                continue
            na, nb = (a or {}).get("seq", 0), (b or {}).get("seq", 0)
            if na != nb:
                last = (b or {}).get("last") or []
                out.append(
                    f"global rank {p} is {'behind' if nb < na else 'ahead'} on group {name} {ranks}: it "
                    f"started {nb} collectives there, global rank {me} {na}"
                    + (f"; its last there: {describe(last[-1])}" if last else "")
                )
            ours = {e["seq"]: e for e in (a or {}).get("last", [])}
            for e in (b or {}).get("last", []):
                o = ours.get(e["seq"])
                if o is not None and (o["op"], o["numel"], o["dtype"], o["site"]) != (
                    e["op"],
                    e["numel"],
                    e["dtype"],
                    e["site"],
                ):
                    out.append(
                        f"collective #{e['seq']} on group {name} {ranks} differs: global rank {p} ran "
                        f"{describe(e)}; global rank {me} ran {describe(o)}"
                    )
                    break
        if theirs.get("failed"):
            f = theirs["failed"]
            out.append(f"global rank {p} failed in {describe(f)} on group {f['group']} {f['ranks']}")
    return out


RECORDER = FlightRecorder(env_size())
env_wait_s()  # a bad LLMPAR_FLIGHT_WAIT_S fails the import on every rank, not the report of a failure

__all__ = [
    "ENV_DIR",
    "ENV_SIZE",
    "ENV_WAIT",
    "Entry",
    "FlightRecorder",
    "RECORDER",
    "as_dict",
    "describe",
    "diagnose",
    "end",
    "env_size",
    "env_wait_s",
    "on_failure",
    "site",
]
