"""Which launcher started this process, read from its environment variables (the only place llmpar reads them),
with the standard library only: ``llmpar launch`` (``launch/rank.py``, ``launch/commands.py``) and
``init_distributed`` (``distributed/discovery.py``) share these rules without the launcher importing torch.

:func:`discover` looks, in this order of precedence, for
  1. torchrun (or any launcher that sets its variables): ``RANK`` and ``WORLD_SIZE``, with ``LOCAL_RANK``,
     ``LOCAL_WORLD_SIZE``;
  2. OpenMPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
  3. MPICH / Intel MPI (hydra) or a PMI launcher: ``PMI_RANK`` (or ``PMIX_RANK``), ``PMI_SIZE``,
     ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``;
  4. Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS``, ``SLURM_LOCALID``, the tasks of
     this node from ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``) /
     ``SLURM_NTASKS_PER_NODE`` (indexed by ``SLURM_NODEID`` when nodes differ);
  5. nothing: a world of one.
The rendezvous address is ``MASTER_ADDR`` / ``MASTER_PORT`` when the user set them (always); under Slurm, else the
first host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST`` (expanded here, without
``scontrol``) and port ``15000 + SLURM_JOB_ID % 20000`` (in [15000, 35000): :func:`slurm_job_port`); ``mpirun`` /
PMI inside a Slurm allocation use the same; outside Slurm the address must be given (MPI has no variable for it). A
port nothing names is 29500, torch's own default. ``llmpar launch``'s per-task wrapper writes torchrun's variables
for srun / mpirun tasks, and ``LLMPAR_MASTER_PORT_FROM=PORT:SLURM_JOB_ID=J`` when it derived the port, so an error
can still say where the port came from.
A value that is not an integer, a rank outside its size, or a local rank not below the local size (or, without a
local size, the world size) raises a ValueError naming the variable and launcher.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000
DEFAULT_PORT = 29500  # torch's own default rendezvous port
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
PORT_FROM_VAR = "LLMPAR_MASTER_PORT_FROM"  # "PORT:SLURM_JOB_ID=J": llmpar launch derived MASTER_PORT=PORT from J
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")  # torchrun's (DeepSpeed's launcher's too), OpenMPI's


@dataclass(frozen=True, kw_only=True)
class LaunchInfo:
    """Where the launcher placed this process. ``source`` is "torchrun", "OpenMPI", "MPICH/PMI", "Slurm" or "none";
    ``read`` holds the variables the numbers came from; ``master_addr`` is None when nothing names it (then a world
    larger than one cannot meet); ``master_from`` says where the address and port came from."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    master_from: str = ""
    read: dict[str, str] = field(default_factory=dict)
    warning: str = ""
    job_port: str = ""  # "SLURM_JOB_ID=123042" when the port was derived from the job id (here or by llmpar launch)

    def torchrun_env(self) -> dict[str, str]:
        """The variables torch's ``env://`` rendezvous and llmpar's local-rank users read (MASTER_* only if known)."""
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        if self.master_addr is not None:
            out["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            out["MASTER_PORT"] = str(self.master_port)
        return out

    def describe(self) -> str:
        """One line: ``rank 1 of 4 (local 1 of 2) from Slurm: SLURM_PROCID=1 ...; master node01:15042 (...)``."""
        read = " ".join(f"{k}={v}" for k, v in self.read.items())
        head = f"rank {self.rank} of {self.world_size} (local {self.local_rank} of {self.local_world_size})"
        head += f" from {self.source}: {read}" if read else " (no launcher variables: a world of one)"
        if self.master_addr is not None:
            head += f"; master {self.master_addr}:{self.master_port} ({self.master_from})"
        elif self.master_from:
            head += f"; master not known ({self.master_from})"
        return head + (f"; warning: {self.warning}" if self.warning else "")


def env_int(env: Mapping[str, str], name: str, source: str, *, minimum: int = 0) -> int | None:
    """``env[name]`` as an int (None when unset or empty); a ValueError naming the variable and ``source`` (the
    launcher) for a value that is not an integer or is below ``minimum``."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} (from {source}) is not an integer") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} (from {source}) must be >= {minimum}")
    return value


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if env.get(n, "").strip()), None)


MAX_NODELIST_DIGITS = 18  # a host number in a hostlist range: Slurm's are far shorter; longer is corrupt input


def _range_values(part: str, bad: Callable[[str], ValueError]) -> list[tuple[int, int, int]]:
    """The pieces of one bracket ``[01-04,07]`` as (low, high, width), checked (never expanded: a range of 10^8
    hosts costs three integers)."""
    out = []
    for piece in part.split(","):
        lo, sep, hi = piece.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise bad(f"range [{part}] is not numbers like 01-04")
        if max(len(lo), len(hi)) > MAX_NODELIST_DIGITS:
            raise bad(f"range [{part}] has a number of more than {MAX_NODELIST_DIGITS} digits")
        low, high = int(lo), int(hi) if sep else int(lo)
        if high < low:
            raise bad(f"range {piece} runs backwards")
        out.append((low, high, len(lo)))
    return out


def _combine(choices: list[list[tuple[int, int, int]] | str]) -> Iterator[str]:
    """Every host of one item, lazily: text parts are fixed, bracket parts run through their ranges (the last
    bracket fastest, as Slurm lists them)."""
    if not choices:
        yield ""
        return
    head, rest = choices[0], choices[1:]
    if isinstance(head, str):
        for tail in _combine(rest):
            yield head + tail
        return
    for low, high, width in head:
        for v in range(low, high + 1):
            for tail in _combine(rest):
                yield str(v).zfill(width) + tail


def expand_nodelist(nodelist: str, *, name: str = "nodelist") -> Iterator[str]:
    """The hosts of a Slurm hostlist, in Slurm's order: ``"node[01-03,07]"`` -> node01 node02 node03 node07,
    ``"a1,b2"`` -> a1 b2, ``"gpu-[1-2]-[3-4]"`` -> gpu-1-3 gpu-1-4 gpu-2-3 gpu-2-4. A range keeps the zero padding
    of its lower end. Lazy: the whole list is checked first (a malformed list, or a number of more than
    :data:`MAX_NODELIST_DIGITS` digits, raises a ValueError naming ``name``), then hosts are made one at a time, so
    taking the first host of ``node[0-100000000]`` builds one name."""

    def bad(why: str) -> ValueError:
        shown = nodelist if len(nodelist) <= 200 else nodelist[:200] + "..."
        return ValueError(f"{name}={shown!r} is not a Slurm hostlist ({why}); expected e.g. 'node[01-04,07],gpu1'")

    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise bad("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise bad("']' without '['")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise bad("'[' without ']'")
    items.append(nodelist[start:])
    parsed: list[list[list[tuple[int, int, int]] | str]] = []
    for item in items:
        item = item.strip()
        if not item:
            raise bad("an empty host name")
        parts = re.split(r"\[([^\]]*)\]", item)  # text, range, text, range, ..., text
        parsed.append([part if k % 2 == 0 else _range_values(part, bad) for k, part in enumerate(parts)])
    return itertools.chain.from_iterable(_combine(choices) for choices in parsed)


def parse_tasks_per_node(value: str, *, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks per node, one entry per node: ``"4(x2),3"`` -> [4, 4, 3], ``"8"`` -> [8]; a ValueError naming
    ``name`` otherwise."""
    out: list[int] = []
    for piece in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", piece)
        if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"{name}={value!r} is not a tasks-per-node list; expected e.g. '4(x2),3' or '8'")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _check(source: str, rank: int, size: int, local: int, local_size: int, names: tuple[str, str, str, str]) -> None:
    if size < 1:
        raise ValueError(f"{names[1]}={size} (from {source}) must be at least 1")
    if rank >= size:
        raise ValueError(f"{names[0]}={rank} (from {source}) is not below {names[1]}={size}")
    if local_size < 1 or local_size > size:
        raise ValueError(f"{names[3]}={local_size} (from {source}) must be in [1, {names[1]}={size}]")
    if local >= local_size:
        raise ValueError(f"{names[2]}={local} (from {source}) is not below {names[3]}={local_size}")


def _ranks(
    env: Mapping[str, str], source: str, names: tuple[str, str, str, str], *, size_given: bool = True
) -> tuple[int, int, int, int]:
    rank = env_int(env, names[0], source)
    size = env_int(env, names[1], source, minimum=1)
    assert rank is not None and size is not None
    local = env_int(env, names[2], source)
    local_size = env_int(env, names[3], source, minimum=1)
    if local_size is None:  # no per-node count: at most the world on this node (a LOCAL_RANK alone, no WORLD_SIZE,
        _check(source, rank, size, 0, 1, names)  # is a device choice of a single process: taken as given)
        if local is not None and size_given and local >= size:
            raise ValueError(
                f"{names[2]}={local} (from {source}) is not below {names[1]}={size}: a node holds at "
                f"most the job's ranks (without {names[3]}, local ranks must be < {names[1]})"
            )
        return rank, size, rank if local is None else local, size
    if local is None:
        local = rank % local_size
    _check(source, rank, size, local, local_size, names)
    return rank, size, local, local_size


def _slurm_local_size(env: Mapping[str, str], size: int) -> tuple[int, str | None]:
    """Tasks on this node and the variable they came from."""
    var = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"))
    if var is None:
        nodes = _first(env, NODELIST_VARS)
        if nodes is not None and len(list(itertools.islice(expand_nodelist(env[nodes], name=nodes), 2))) > 1:
            raise ValueError(
                f"{nodes}={env[nodes]!r} names several nodes but none of SLURM_STEP_TASKS_PER_NODE, "
                "SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE is set: the tasks on this node are unknown"
            )
        return size, None
    per_node = parse_tasks_per_node(env[var], name=var)
    if len(set(per_node)) == 1:
        return per_node[0], var
    node = env_int(env, "SLURM_NODEID", "Slurm")
    if node is None or node >= len(per_node):
        raise ValueError(
            f"{var}={env[var]!r} gives different task counts per node, and SLURM_NODEID="
            f"{env.get('SLURM_NODEID')!r} does not index it (0..{len(per_node) - 1})"
        )
    return per_node[node], var


def discover(
    environ: Mapping[str, str] | None = None, *, master_addr: str | None = None, master_port: int | None = None
) -> LaunchInfo:
    """Read the launcher's variables from ``environ`` (default ``os.environ``) and return a :class:`LaunchInfo`.
    ``master_addr`` / ``master_port`` given here win over ``MASTER_ADDR`` / ``MASTER_PORT``, which win over
    anything derived. Never raises for a missing address (``master_addr`` is then None); raises ValueError for
    values that are not integers or not consistent, naming the variable and the launcher."""
    env = os.environ if environ is None else environ
    read: dict[str, str] = {}
    warning = ""
    if (env.get("RANK", "").strip() and env.get("WORLD_SIZE", "").strip()) or not any(
        env.get(v, "").strip() for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
    ):  # torchrun; or only some of its variables and no other launcher (then RANK=0, WORLD_SIZE=1 by default)
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        present = {n: env[n] for n in names if env.get(n, "").strip()}
        source = "torchrun" if present else "none"
        filled = {"RANK": "0", "WORLD_SIZE": "1", **present}
        rank, size, local, local_size = _ranks(filled, source, names, size_given="WORLD_SIZE" in present)
        read = present
    elif env.get("OMPI_COMM_WORLD_RANK", "").strip():
        source = "OpenMPI"
        names = (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )
        _require(env, names[:2], source)
        rank, size, local, local_size = _ranks(env, source, names)
        read = {n: env[n] for n in names if n in env}
    elif _first(env, ("PMI_RANK", "PMIX_RANK")) and env.get("PMI_SIZE", "").strip():
        source = "MPICH/PMI"
        rank_var = _first(env, ("PMI_RANK", "PMIX_RANK"))
        assert rank_var is not None
        names = (rank_var, "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        rank, size, local, local_size = _ranks(env, source, names)
        read = {n: env[n] for n in names if n in env}
    elif env.get("SLURM_PROCID", "").strip():
        source = "Slurm"
        size_var = _first(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
        if size_var is None:
            raise ValueError(
                f"SLURM_PROCID={env['SLURM_PROCID']!r} is set (Slurm) but none of SLURM_STEP_NUM_TASKS, "
                "SLURM_NTASKS, SLURM_NPROCS is: launch with srun --ntasks=N"
            )
        local_size, per_node_var = _slurm_local_size(env, env_int(env, size_var, source, minimum=1) or 1)
        filled = {
            "SLURM_PROCID": env["SLURM_PROCID"],
            size_var: env[size_var],
            "SLURM_LOCALID": env.get("SLURM_LOCALID", ""),
            per_node_var or "tasks on this node": str(local_size),
        }
        names = ("SLURM_PROCID", size_var, "SLURM_LOCALID", per_node_var or "tasks on this node")
        rank, size, local, local_size = _ranks(filled, source, names)
        read = {
            n: env[n]
            for n in ("SLURM_PROCID", size_var, "SLURM_LOCALID", per_node_var or "", "SLURM_NODEID")
            if env.get(n, "").strip()
        }
        if size_var != "SLURM_STEP_NUM_TASKS" and size > 1:
            warning = (
                f"{size_var}={size} but no SLURM_STEP_NUM_TASKS: if this is the batch script itself rather "
                "than a task started by srun, the other ranks will never join; launch with srun"
            )
    else:  # PMI_RANK or PMIX_RANK without PMI_SIZE (and no Slurm task variables)
        var = _first(env, ("PMI_RANK", "PMIX_RANK"))
        assert var is not None
        raise ValueError(
            f"{var}={env[var]!r} is set ({'PMIx' if var == 'PMIX_RANK' else 'PMI'}) but no world size "
            "is (PMI_SIZE or SLURM_NTASKS): set WORLD_SIZE and RANK, or launch with srun / mpirun"
        )
    addr, port, origin, job_port = _master(env, source, master_addr, master_port)
    return LaunchInfo(
        source=source,
        rank=rank,
        world_size=size,
        local_rank=local,
        local_world_size=local_size,
        master_addr=addr,
        master_port=port,
        master_from=origin,
        read=read,
        warning=warning,
        job_port=job_port,
    )


def _require(env: Mapping[str, str], names: tuple[str, ...], source: str) -> None:
    for n in names:
        if not env.get(n, "").strip():
            raise ValueError(f"{names[0]} is set ({source}) but {n} is not")


def _master(
    env: Mapping[str, str], source: str, addr: str | None, port: int | None
) -> tuple[str | None, int | None, str, str]:
    """The rendezvous address and port, a phrase saying where they came from, and ``"SLURM_JOB_ID=J"`` when the
    port is the job id's (derived here, or by ``llmpar launch``, which says so in :data:`PORT_FROM_VAR`)."""
    if addr is not None and (not isinstance(addr, str) or not addr.strip()):
        raise ValueError(f"master_addr={addr!r} must be a host name or address (a non-empty string)")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ValueError(f"master_port={port!r} must be an integer port in [1, 65535]")
    addr_from = "master_addr=" if addr else None
    if addr is None and env.get("MASTER_ADDR", "").strip():
        addr, addr_from = env["MASTER_ADDR"].strip(), "MASTER_ADDR"
    port_from = "master_port=" if port is not None else None
    job_port = ""
    if port is None and env.get("MASTER_PORT", "").strip():
        port, port_from = env_int(env, "MASTER_PORT", "the user", minimum=1), "MASTER_PORT"
        if port is not None and port > 65535:
            raise ValueError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
        marked, _, job_port = env.get(PORT_FROM_VAR, "").partition(":")
        if marked.strip() == str(port) and job_port:  # the launcher derived it (and nothing changed it since)
            port_from = f"MASTER_PORT from {job_port} (set by llmpar launch)"
        else:
            job_port = ""
    in_slurm = source not in ("torchrun", "none") and _first(env, NODELIST_VARS) is not None
    if addr is None and in_slurm:
        var = _first(env, NODELIST_VARS)
        assert var is not None
        addr, addr_from = next(expand_nodelist(env[var].strip(), name=var)), f"first host of {var}"
    if port is None and in_slurm:
        derived = slurm_job_port(env)
        if derived is not None:
            port, job_port = derived
            port_from = f"port from {job_port.partition('=')[0]}"
    if addr is None:
        if source in ("none", "torchrun"):
            return None, port, "", job_port
        return (
            None,
            port,
            f"set MASTER_ADDR to rank 0's host (or pass master_addr=): {source} does not name it",
            job_port,
        )
    if port is None:
        port, port_from = DEFAULT_PORT, f"default port {DEFAULT_PORT}"
    return addr, port, f"{addr_from}, {port_from}", job_port


def slurm_job_port(env: Mapping[str, str]) -> tuple[int, str] | None:
    """``(15000 + job id % 20000, "SLURM_JOB_ID=J")`` from the first of :data:`JOB_ID_VARS` that is set (a
    ValueError naming it when it is not an integer); None outside a Slurm job. The rendezvous port of a Slurm job when
    nothing names one: the same on every task, distinct for jobs whose ids differ mod 20000."""
    var = _first(env, JOB_ID_VARS)
    if var is None:
        return None
    job = env_int(env, var, "Slurm")
    assert job is not None
    return SLURM_PORT_BASE + job % SLURM_PORT_SPAN, f"{var}={job}"


__all__ = ["LaunchInfo", "discover", "env_int", "expand_nodelist", "parse_tasks_per_node", "slurm_job_port"]
