"""The command lines a launch runs, one per node it starts from here: a translation onto PyTorch's launcher
(``python -m torch.distributed.run``, c10d rendezvous so that ``--max_restarts`` works), ``ssh``, ``srun`` or
``mpirun``. llmpar schedules nothing itself.

    torchrun   this machine is one node: ``torch.distributed.run`` here (``--standalone`` on one node without a
               ``--master_port``; else c10d at ``master_addr:master_port``). Several nodes: run the same command on
               each node (same ``--master_addr``); with a hostfile, ``--node_rank`` says which host this is.
    ssh        every host of the hostfile: ``ssh HOST 'cd CWD && env VARS python -m torch.distributed.run ...'``,
               all started from here; the rendezvous is the first host (or ``--master_addr``).
    slurm      ``srun`` inside an allocation: one task per rank, or with ``--max_restarts`` one task per node running
               ``torch.distributed.run``.
    mpi        OpenMPI's ``mpirun``: one process per rank; it has no restarts, so ``--max_restarts`` is refused.
Each srun / mpirun task starts through ``python -m llmpar.launch.rank`` (``rank.py``), which writes torchrun's
variables from Slurm's / OpenMPI's before the script starts (so transformers and accelerate read the job's sizes);
torchrun / ssh ranks go through it too when they get DeepSpeed's ``--local_rank=N`` argument (the default, not
under srun / mpirun: DeepSpeed's Slurm and MPI runners pass none), bound cores or a log file each.
``ssh`` and ``mpi`` forward the variables DeepSpeed's launcher forwards (``NCCL_*``, ``PYTHON*``, ``UCX_*``,
``MV2_*``, ``MLFLOW*``, and llmpar's ``LLMPAR_*``) and the ``KEY=VALUE`` lines of ``~/.deepspeed_env`` and
``./.deepspeed_env``. A host's slots other than ``0..n-1`` (``--include host:1,3``) become its
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Mapping

from llmpar.launcher_env import DEFAULT_PORT, PORT_FROM_VAR, expand_nodelist, slurm_job_port

LAUNCHERS = ("torchrun", "slurm", "mpi", "ssh")
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "MV2_", "MLFLOW", "LLMPAR_")
ENV_FILE = ".deepspeed_env"
# torch.distributed.run's agent shares its rendezvous TCPStore with the workers and keeps it across restarts without
# a per-attempt prefix (pytorch/pytorch#135712): a restarted rank can read a dead peer's address left by the previous
# attempt and fail to connect. With this set, rank 0 of each attempt hosts a fresh store instead.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True, kw_only=True)
class NodeCommand:
    """One command this launch runs here: ``argv`` with ``env`` set on top of this process's environment; it
    starts node ``node`` (``host``; for srun / mpirun: every node)."""

    node: int
    host: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The command as a shell line (what ``--dry-run`` prints)."""
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.argv)])


@dataclass(frozen=True, kw_only=True)
class Launch:
    """A launch, parsed and checked (``cli.py`` builds it from the flags). ``hosts``: the active {host: slots} of a
    hostfile (None without one); ``nnodes`` / ``nproc``: the node count and processes per node without a hostfile."""

    script: str
    script_args: list[str]
    module: bool = False
    hosts: "OrderedDict[str, list[int]] | None" = None
    nnodes: int = 1
    nproc: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    launcher: str | None = None
    launcher_args: list[str] = field(default_factory=list)
    rdzv_id: str | None = None
    visible: str | None = None  # CUDA_VISIBLE_DEVICES of a single local node filtered by --include / --exclude
    local_rank_arg: bool = True  # --local_rank=N after the script (torchrun / ssh routes, as DeepSpeed's launch.py)
    no_python: bool = False
    bind_cores: bool = False
    bind_core_list: str | None = None
    rank_log_dir: str | None = None
    log_prefix: str = "llmpar"
    ssh_port: int | None = None
    venv_script: str | None = None


def _visible(slots: list[int]) -> str | None:
    return None if slots == list(range(len(slots))) else ",".join(map(str, slots))


def rank_options(launch: Launch) -> list[str] | None:
    """The per-rank wrapper's options (``llmpar/launch/rank.py``), or None when the script can start directly.
    srun / mpirun tasks always go through it (torchrun's variables before the script); torchrun / ssh ranks when
    they get ``--local_rank`` (DeepSpeed's launch.py passes it there; its Slurm and MPI runners do not), cores,
    a log file each, or run the script without python."""
    opts = ["--pass_local_rank"] if launch.local_rank_arg and launch.launcher in ("torchrun", "ssh") else []
    opts += ["--no_python"] if launch.no_python else []
    if launch.bind_cores:
        opts.append("--bind_cores_to_rank")
        opts += [f"--bind_core_list={launch.bind_core_list}"] if launch.bind_core_list is not None else []
    if launch.rank_log_dir is not None:
        opts += [f"--enable_each_rank_log={launch.rank_log_dir}", f"--log_name_prefix={launch.log_prefix}"]
    if not opts and launch.launcher not in ("slurm", "mpi"):
        return None
    return opts + (["--module"] if launch.module else [])


def _program(launch: Launch) -> list[str]:
    """What follows ``python -u`` (or torch.distributed.run's flags): the script, or the wrapper and the script."""
    opts = rank_options(launch)
    if opts is None:
        return (["-m", launch.script] if launch.module else [launch.script]) + list(launch.script_args)
    return ["-m", "llmpar.launch.rank", *opts, launch.script, *launch.script_args]


def _torchrun(launch: Launch, *, nnodes: int, nproc: int, endpoint: str | None, rdzv_id: str) -> list[str]:
    """torch.distributed.run's command line. No ``--node_rank``: the c10d rendezvous numbers the nodes itself (it
    ignores the flag, with a warning); ranks stay contiguous per node."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}"]
    if endpoint is None:
        argv.append("--standalone")
    else:
        argv += ["--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={rdzv_id}"]
    argv.append(f"--max_restarts={launch.max_restarts}")
    if launch.launcher not in ("ssh", "slurm"):  # there they go to ssh / srun
        argv += launch.launcher_args
    return argv + _program(launch)


def exported_env(environ: Mapping[str, str], home: str | None = None, cwd: str | None = None) -> dict[str, str]:
    """The variables ``ssh`` / ``mpi`` launches forward to the other nodes (module docstring)."""
    out = {k: v for k, v in sorted(environ.items()) if k.startswith(EXPORT_PREFIXES)}
    for folder in (home if home is not None else os.path.expanduser("~"), cwd if cwd is not None else os.getcwd()):
        path = os.path.join(folder, ENV_FILE)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for number, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                key, eq, value = line.partition("=")
                if not eq or not key.strip().isidentifier():
                    raise ValueError(f"{path}:{number}: {line!r} is not KEY=VALUE")
                out[key.strip()] = value.strip()
    return out


def resolve_launcher(launch: Launch) -> str:
    """The launcher to use: the one asked for; else ssh for a hostfile with several hosts and no ``--node_rank``
    (DeepSpeed's multi-node default, with ssh in place of pdsh), torchrun otherwise."""
    if launch.launcher is not None:
        if launch.launcher not in LAUNCHERS:
            raise ValueError(f"--launcher {launch.launcher!r}: expected one of {', '.join(LAUNCHERS)}")
        return launch.launcher
    several = launch.hosts is not None and len(launch.hosts) > 1
    return "ssh" if several and launch.node_rank is None else "torchrun"


def _endpoint_port(launch: Launch, environ: Mapping[str, str]) -> int:
    if launch.master_port is not None:
        return launch.master_port
    derived = slurm_job_port(environ)  # the port every task derives itself (llmpar.launcher_env)
    return derived[0] if derived is not None else DEFAULT_PORT


def _rdzv_id(launch: Launch, environ: Mapping[str, str]) -> str:
    return launch.rdzv_id or environ.get("SLURM_JOB_ID") or "llmpar"


def _fresh_store(environ: Mapping[str, str]) -> dict[str, str]:
    """:data:`FRESH_STORE`, unless the user chose a value for that variable."""
    return {} if any(k in environ for k in FRESH_STORE) else dict(FRESH_STORE)


def _for_torchrun(launch: Launch, environ: Mapping[str, str]) -> list[NodeCommand]:
    hosts, rank = launch.hosts, launch.node_rank
    if hosts is not None and len(hosts) > 1:
        if rank is None:
            raise ValueError(
                f"--launcher torchrun starts one node, and the hostfile has {len(hosts)}: give this "
                "node's --node_rank (and run the same command on every host), or use --launcher ssh"
            )
        names = list(hosts)
        if not 0 <= rank < len(names):
            raise ValueError(f"--node_rank {rank}: expected 0..{len(names) - 1} (the hostfile's hosts)")
        nnodes, slots = len(names), hosts[names[rank]]
        nproc, visible, addr = len(slots), _visible(slots), launch.master_addr or names[0]
    else:
        if hosts is not None:
            nproc, visible = len(next(iter(hosts.values()))), _visible(next(iter(hosts.values())))
        else:
            nproc, visible = launch.nproc, launch.visible
        nnodes, addr = (launch.nnodes if hosts is None else 1), launch.master_addr
        if nnodes > 1:
            if rank is not None and not 0 <= rank < nnodes:
                raise ValueError(f"--node_rank {rank}: expected 0..{nnodes - 1} (--nnodes {nnodes})")
            if addr is None:
                raise ValueError(
                    f"--nnodes {nnodes}: give --master_addr, the address of node 0 that every node "
                    "can reach (its rendezvous runs there)"
                )
        elif rank not in (None, 0):
            raise ValueError(f"--node_rank {rank}: a one-node launch is node 0")
    standalone = nnodes == 1 and launch.master_port is None and launch.master_addr is None
    endpoint = None if standalone else f"{addr or '127.0.0.1'}:{launch.master_port or DEFAULT_PORT}"
    argv = _torchrun(launch, nnodes=nnodes, nproc=nproc, endpoint=endpoint, rdzv_id=_rdzv_id(launch, environ))
    env = {**_fresh_store(environ), **({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {})}
    return [NodeCommand(node=rank or 0, host="localhost", argv=argv, env=env)]


def _for_ssh(launch: Launch, environ: Mapping[str, str]) -> list[NodeCommand]:
    if launch.hosts is None:
        raise ValueError("--launcher ssh needs --hostfile (the hosts to start)")
    if launch.node_rank is not None:
        raise ValueError(
            "--node_rank is for --launcher torchrun (one node per command); --launcher ssh starts "
            "every host of the hostfile"
        )
    names = list(launch.hosts)
    endpoint = f"{launch.master_addr or names[0]}:{_endpoint_port(launch, environ)}"
    exported = {**exported_env(environ), **_fresh_store(environ)}
    out = []
    for i, (host, slots) in enumerate(launch.hosts.items()):
        env = dict(exported)
        if _visible(slots) is not None:
            env["CUDA_VISIBLE_DEVICES"] = _visible(slots)
        inner = _torchrun(
            launch, nnodes=len(names), nproc=len(slots), endpoint=endpoint, rdzv_id=_rdzv_id(launch, environ)
        )
        assignments = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
        remote = f"cd {shlex.quote(os.getcwd())} && " + " ".join(["env", *assignments, shlex.join(inner)])
        if launch.venv_script is not None:  # DeepSpeed's --venv_script: sourced before the command on each host
            remote = f". {shlex.quote(launch.venv_script)} && {remote}"
        port = ["-p", str(launch.ssh_port)] if launch.ssh_port is not None else []
        out.append(NodeCommand(node=i, host=host, argv=["ssh", *port, *launch.launcher_args, host, remote]))
    return out


def _same_slots(launch: Launch, flag: str) -> tuple[int, str | None]:
    """(processes per node, CUDA_VISIBLE_DEVICES) for srun / mpirun, which give every node the same."""
    if launch.hosts is None:
        return launch.nproc, launch.visible
    kinds = {tuple(s) for s in launch.hosts.values()}
    if len(kinds) > 1:
        raise ValueError(
            f"--launcher {flag} starts the same processes on every node, but the hosts' slots differ "
            f"({', '.join(f'{h}: {s}' for h, s in launch.hosts.items())}): use --launcher ssh, or "
            "give every host the same slots"
        )
    slots = list(kinds.pop())
    return len(slots), _visible(slots)


def _for_slurm(launch: Launch, environ: Mapping[str, str]) -> list[NodeCommand]:
    nproc, visible = _same_slots(launch, "slurm")
    nnodes = len(launch.hosts) if launch.hosts is not None else launch.nnodes
    argv = ["srun", f"--nodes={nnodes}"]
    if launch.hosts is not None:
        argv.append(f"--nodelist={','.join(launch.hosts)}")
    env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
    if launch.max_restarts == 0:  # one task per rank: init_distributed reads SLURM_PROCID & co
        argv += [f"--ntasks-per-node={nproc}", *launch.launcher_args, sys.executable, "-u", *_program(launch)]
        if launch.master_addr is not None:
            env["MASTER_ADDR"] = launch.master_addr
        if launch.master_port is not None:
            env["MASTER_PORT"] = str(launch.master_port)
    else:  # one torch.distributed.run agent per node, which restarts the ranks
        addr = launch.master_addr
        if addr is None and launch.hosts is not None:
            addr = next(iter(launch.hosts))
        nodelist = environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST"))
        if addr is None and nodelist:
            addr = next(expand_nodelist(nodelist, name="SLURM_JOB_NODELIST"))
        if addr is None:
            raise ValueError(
                "--launcher slurm --max_restarts: outside a Slurm allocation (no SLURM_JOB_NODELIST) "
                "give --master_addr or --hostfile (the rendezvous host)"
            )
        env.update(_fresh_store(environ))
        argv += ["--ntasks-per-node=1", *launch.launcher_args]
        argv += _torchrun(
            launch,
            nnodes=nnodes,
            nproc=nproc,
            endpoint=f"{addr}:{_endpoint_port(launch, environ)}",
            rdzv_id=_rdzv_id(launch, environ),
        )
    return [NodeCommand(node=0, host="(srun)", argv=argv, env=env)]


def _for_mpi(launch: Launch, environ: Mapping[str, str]) -> list[NodeCommand]:
    if launch.max_restarts:
        raise ValueError(
            f"--max_restarts {launch.max_restarts}: mpirun does not restart ranks; use --launcher "
            "torchrun, ssh or slurm (torch.distributed.run's agent restarts them)"
        )
    nproc, visible = _same_slots(launch, "mpi")
    nnodes = len(launch.hosts) if launch.hosts is not None else launch.nnodes
    addr = launch.master_addr or (next(iter(launch.hosts)) if launch.hosts is not None else None)
    if addr is None and nnodes == 1:
        addr = "127.0.0.1"
    if addr is None and "SLURM_JOB_NODELIST" not in environ:
        raise ValueError(
            f"--launcher mpi on {nnodes} nodes without a hostfile: give --master_addr (MPI names no "
            "rendezvous host; inside Slurm the allocation's first node is used)"
        )
    env = exported_env(environ)
    if addr is not None:
        env["MASTER_ADDR"] = addr
    env["MASTER_PORT"] = str(_endpoint_port(launch, environ))
    derived = slurm_job_port(environ)
    if launch.master_port is None and derived is not None:  # so that a port clash can name the job id
        env[PORT_FROM_VAR] = f"{env['MASTER_PORT']}:{derived[1]}"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    argv = ["mpirun", "-n", str(nnodes * nproc)]
    if launch.hosts is not None:
        argv += ["-H", ",".join(f"{h}:{len(s)}" for h, s in launch.hosts.items())]
    argv += ["--npernode", str(nproc)]
    for k, v in env.items():
        argv += ["-x", f"{k}={v}"]
    argv += [*launch.launcher_args, sys.executable, "-u", *_program(launch)]
    return [NodeCommand(node=0, host="(mpirun)", argv=argv)]


def build_commands(launch: Launch, environ: Mapping[str, str] | None = None) -> list[NodeCommand]:
    """The commands ``launch`` runs from here (module docstring), checked: a flag that does not fit the launcher
    raises a ValueError naming it."""
    environ = os.environ if environ is None else environ
    if launch.max_restarts < 0:
        raise ValueError(f"--max_restarts {launch.max_restarts}: must be >= 0")
    if launch.master_port is not None and not 0 < launch.master_port < 65536:
        raise ValueError(f"--master_port {launch.master_port}: must be in 1..65535")
    if launch.ssh_port is not None and not 0 < launch.ssh_port < 65536:
        raise ValueError(f"--ssh_port {launch.ssh_port}: must be in 1..65535")
    if launch.module and launch.no_python:
        raise ValueError("--no_python and --module cannot be combined (as in DeepSpeed): a module runs under python")
    kind = resolve_launcher(launch)
    if kind in ("slurm", "mpi") and launch.node_rank is not None:
        raise ValueError(f"--node_rank is for --launcher torchrun; {kind} places the nodes itself")
    launch = launch if launch.launcher == kind else replace(launch, launcher=kind)
    return {"torchrun": _for_torchrun, "ssh": _for_ssh, "slurm": _for_slurm, "mpi": _for_mpi}[kind](launch, environ)


__all__ = ["LAUNCHERS", "Launch", "NodeCommand", "build_commands", "exported_env", "resolve_launcher"]
