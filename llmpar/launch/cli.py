"""``llmpar launch [flags] script.py [script args]``: DeepSpeed's launcher flags, translated onto PyTorch's
launcher (``torch.distributed.run``), ``ssh``, ``srun`` or ``mpirun`` (``commands.py``), which then run the job.

    llmpar launch --num_gpus 8 train.py --deepspeed_config ds.json        # one node, 8 ranks (on CPU: 8 processes)
    llmpar launch --hostfile hosts --include "w0@w1:0,1" train.py          # ssh to w0 (all slots) and w1 (slots 0,1)
    llmpar launch --nnodes 2 --master_addr w0 --num_gpus 8 train.py        # the same command on each of 2 nodes
    llmpar launch --launcher slurm --num_nodes 4 --num_gpus 8 train.py     # in an sbatch script: srun, 32 ranks
    llmpar launch --max_restarts 3 --num_gpus 8 train.py                   # a rank that dies restarts every rank
    llmpar launch --dry-run ...                                            # print the commands, run nothing

Torchrun's spellings are accepted too (``--nnodes``, ``--nproc_per_node``, dashes for underscores). The exit
status is the job's (the first failing node's under ssh), 2 for bad flags.

DeepSpeed's launcher flags mean what they mean there: each rank's script gets ``--local_rank=N`` after the script
(torchrun / ssh routes; ``--no_local_rank`` drops it; srun / mpirun tasks get none, as under DeepSpeed),
``--no_python`` runs the script as an executable, ``--bind_cores_to_rank`` [``--bind_core_list 0,2-5``] gives each
local rank its own consecutive cores (``sched_setaffinity``, ``OMP_NUM_THREADS``), ``--enable_each_rank_log DIR``
writes ``DIR/<time>_rank<R>.log`` per rank, ``--no_ssh`` starts this node only (torchrun, with ``--node_rank``),
``--force_multi`` uses ssh for a one-host hostfile, ``--ssh_port`` / ``--venv_script`` go to ssh (``. SCRIPT``
first on each host), ``--save_pid`` writes ``/tmp/<this pid>.deepspeed`` with the started commands' pids,
``--log_level`` / ``--quiet`` set what this command prints. A flag with no meaning on the chosen route
(``--no_ssh_check``: no ssh check is made) is accepted and said once.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable

from llmpar.launch.commands import LAUNCHERS, Launch, NodeCommand, build_commands, resolve_launcher
from llmpar.launch.rank import parse_core_list
from llmpar.launch.resources import MAX_SLOTS, resolve_pool

PID_DIR = "/tmp"  # --save_pid writes PID_DIR/<pid of this command>.deepspeed (DeepSpeed's place and name)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``launch`` to the ``llmpar`` command."""
    p = subparsers.add_parser(
        "launch",
        help="start a script on many processes / nodes (DeepSpeed's launcher flags over torchrun, ssh, srun, mpirun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("-H", "--hostfile", default=None, help="MPI-style hostfile: lines 'HOST slots=N' (DeepSpeed's format)")
    add("-i", "--include", default="", help="hosts / slots to use: NODE[:SLOT,...][@NODE...], e.g. 'w0@w1:0,2'")
    add("-e", "--exclude", default="", help="hosts / slots not to use (same format as --include)")
    add(
        "--num_nodes",
        "--nnodes",
        "--num-nodes",
        dest="num_nodes",
        type=int,
        default=None,
        help="nodes: the first N hosts of the hostfile; without one, the job's node count (run on each node)",
    )
    add(
        "--num_gpus",
        "--num_accelerators",
        "--nproc_per_node",
        "--nproc-per-node",
        "--num-gpus",
        dest="num_gpus",
        type=int,
        default=None,
        help="processes per node (slots 0..N-1 of each host); default: the hostfile's slots, "
        "else this machine's GPU count (1 on a CPU-only machine)",
    )
    add(
        "--node_rank",
        "--node-rank",
        dest="node_rank",
        type=int,
        default=None,
        help="which host of the hostfile this node is (--launcher torchrun on several nodes; without a hostfile "
        "the c10d rendezvous numbers the nodes)",
    )
    add(
        "--master_addr",
        "--master-addr",
        dest="master_addr",
        default=None,
        help="rendezvous host (default: the first host; 127.0.0.1 on one node)",
    )
    add(
        "--master_port",
        "--master-port",
        dest="master_port",
        type=int,
        default=None,
        help="rendezvous port (default: a free port on one node, else 29500; under Slurm 15000 + job id %% 20000)",
    )
    add(
        "--max_restarts",
        "--max-restarts",
        dest="max_restarts",
        type=int,
        default=0,
        help="restart every rank up to N times when one fails (torch.distributed.run's agent)",
    )
    add(
        "--launcher",
        choices=LAUNCHERS,
        default=None,
        help="torchrun (this node), ssh (every host of the hostfile), slurm (srun), mpi (OpenMPI mpirun); default "
        "ssh for a hostfile of several hosts without --node_rank, else torchrun",
    )
    add(
        "--launcher_args",
        "--launcher-args",
        dest="launcher_args",
        default="",
        help="extra arguments for torch.distributed.run / ssh / srun / mpirun, one quoted string",
    )
    add("--rdzv_id", "--rdzv-id", dest="rdzv_id", default=None, help="rendezvous id (default: SLURM_JOB_ID or llmpar)")
    add("--module", action="store_true", help="the script is a module name (python -m)")
    add(
        "--no_local_rank",
        "--no-local-rank",
        dest="no_local_rank",
        action="store_true",
        help="do not pass --local_rank=N to the script (DeepSpeed's flag; srun / mpirun tasks never get it)",
    )
    add(
        "--no_python",
        "--no-python",
        dest="no_python",
        action="store_true",
        help="run the script as an executable, not under python",
    )
    add(
        "--bind_cores_to_rank",
        action="store_true",
        help="give each local rank its own consecutive cores (sched_setaffinity) and OMP_NUM_THREADS = its core count",
    )
    add(
        "--bind_core_list",
        default=None,
        help="the cores --bind_cores_to_rank shares out, e.g. '0,2-5' (default: the CPUs the rank may use)",
    )
    add(
        "--enable_each_rank_log",
        default=None,
        metavar="DIR",
        help="each rank's stdout and stderr to DIR/<time>_rank<R>.log",
    )
    add("--force_multi", action="store_true", help="use ssh even for a hostfile of one host")
    add("--no_ssh", action="store_true", help="start this node only (torchrun; --node_rank names it in the hostfile)")
    add("--no_ssh_check", action="store_true", help="accepted (DeepSpeed's flag): llmpar launch makes no ssh check")
    add("--ssh_port", type=int, default=None, help="ssh's port (--launcher ssh)")
    add("--venv_script", default=None, help="a script each ssh host sources before the command (--launcher ssh)")
    add("--save_pid", action="store_true", help=f"write the started commands' pids to {PID_DIR}/<pid>.deepspeed")
    add(
        "--log_level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="what this command prints: info shows the commands, warning only notes, error only errors",
    )
    add("-q", "--quiet", action="store_true", help="print errors only (--log_level error)")
    add("--autotuning", default="", choices=["tune", "run"], help="DeepSpeed's autotuner: not in llmpar (refused)")
    add("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="print the commands per node and exit")
    add("script", help="the training script (or module with --module)")
    add("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=main)


def build_parser() -> argparse.ArgumentParser:
    """A parser of ``llmpar launch``'s flags alone (``python -m llmpar.launch``; tests)."""
    parser = argparse.ArgumentParser(prog="llmpar")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def _local_slots() -> int:
    import torch

    return torch.cuda.device_count() or 1


def launch_from_args(args: argparse.Namespace) -> Launch:
    """The checked :class:`Launch` of the parsed flags (a bad value raises a ValueError naming the flag)."""
    import shlex

    for name in ("num_nodes", "num_gpus"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} {value}: must be >= 1")
    if args.num_gpus is not None and args.num_gpus > MAX_SLOTS:
        raise ValueError(f"--num_gpus {args.num_gpus}: processes per node must be in 1..{MAX_SLOTS}")
    if args.autotuning:
        raise ValueError(
            f"--autotuning {args.autotuning}: llmpar has no autotuner; run DeepSpeed's, or size the "
            "batch with `llmpar plan`"
        )
    if args.bind_core_list is not None:
        parse_core_list(args.bind_core_list)
    log_dir = None if args.enable_each_rank_log in (None, "None") else args.enable_each_rank_log
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ValueError(f"--enable_each_rank_log {log_dir}: is a file; give a directory (created if missing)")
    launcher = args.launcher
    if args.no_ssh:
        if launcher not in (None, "torchrun"):
            raise ValueError(f"--no_ssh starts this node only (torchrun), not --launcher {launcher}")
        launcher = "torchrun"
    elif args.force_multi and launcher is None and args.hostfile is not None:
        launcher = "ssh"
    if args.node_rank is not None and args.node_rank < 0:
        raise ValueError(f"--node_rank {args.node_rank}: must be >= 0")
    need_local = args.hostfile is None and args.num_gpus is None
    hosts = resolve_pool(
        hostfile=args.hostfile,
        include=args.include,
        exclude=args.exclude,
        num_nodes=args.num_nodes,
        num_gpus=args.num_gpus,
        local_slots=_local_slots() if need_local else 1,
    )
    try:
        launcher_args = shlex.split(args.launcher_args)
    except ValueError as e:
        raise ValueError(f"--launcher_args {args.launcher_args!r}: {e}") from None
    local = hosts if args.hostfile is None else None
    slots = next(iter(local.values())) if local is not None else []
    return Launch(
        script=args.script,
        script_args=list(args.script_args),
        module=args.module,
        hosts=hosts if args.hostfile is not None else None,
        nnodes=args.num_nodes or 1,
        nproc=len(slots) or 1,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        launcher=launcher,
        launcher_args=launcher_args,
        rdzv_id=args.rdzv_id,
        visible=(None if slots == list(range(len(slots))) else ",".join(map(str, slots))),
        local_rank_arg=not args.no_local_rank,
        no_python=args.no_python,
        bind_cores=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        rank_log_dir=log_dir,
        log_prefix=time.strftime("%Y%m%d%H%M%S"),
        ssh_port=args.ssh_port,
        venv_script=args.venv_script,
    )


def notes(args: argparse.Namespace, launch: Launch) -> list[str]:
    """One line per DeepSpeed launcher flag given that means nothing on this launch's route (said once)."""
    kind, out = resolve_launcher(launch), []
    if args.no_ssh_check:
        out.append("--no_ssh_check: llmpar launch makes no ssh check (an unreachable host fails its own ssh)")
    if kind != "ssh":
        for flag, value in (("--ssh_port", args.ssh_port), ("--venv_script", args.venv_script)):
            if value is not None:
                out.append(f"{flag}: used by --launcher ssh only; this launch runs {kind} in this environment")
    if args.force_multi and args.hostfile is None:
        out.append("--force_multi: without --hostfile there is no host to reach by ssh; running on this machine")
    if args.bind_core_list is not None and not args.bind_cores_to_rank:
        out.append("--bind_core_list: used with --bind_cores_to_rank (as in DeepSpeed); no cores are bound")
    if args.no_local_rank and kind in ("slurm", "mpi"):
        out.append(f"--no_local_rank: {kind} tasks get no --local_rank anyway (they read LOCAL_RANK)")
    return out


def describe(commands: list[NodeCommand]) -> str:
    """The ``--dry-run`` text: per command, a comment naming the node it starts, then the shell line."""
    lines = []
    for c in commands:
        where = f"every node {c.host}" if c.host.startswith("(") else f"node {c.node} ({c.host})"
        lines += [f"# {where}", c.shell()]
    return "\n".join(lines)


def run_commands(
    commands: list[NodeCommand], poll_s: float = 0.2, on_start: Callable[[list[int]], None] | None = None
) -> int:
    """Run the commands side by side; SIGINT / SIGTERM are passed on to them. When one fails the others are
    terminated. ``on_start`` gets their pids once all started. Returns the first non-zero exit status (0 when every
    command succeeded)."""
    procs = [subprocess.Popen(c.argv, env={**os.environ, **c.env}) for c in commands]
    if on_start is not None:
        on_start([p.pid for p in procs])

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = 0
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed and not status:
                status = failed[0]
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(poll_s)
        return status or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``llmpar launch``: build the commands, print them (``--dry-run``) or run them."""
    level = LOG_LEVELS.index("error" if args.quiet else args.log_level)
    try:
        launch = launch_from_args(args)
        commands = build_commands(launch)
        said = notes(args, launch)
        if launch.rank_log_dir is not None and not args.dry_run:
            os.makedirs(launch.rank_log_dir, exist_ok=True)
    except (ValueError, OSError) as err:
        print(f"llmpar launch: error: {err}", file=sys.stderr)
        return 2
    if level <= LOG_LEVELS.index("warning"):
        for line in said:
            print(f"llmpar launch: note: {line}", file=sys.stderr, flush=True)
    if args.dry_run:
        print(describe(commands))
        return 0
    if level <= LOG_LEVELS.index("info"):
        for c in commands:
            print(f"llmpar launch: {c.shell()}", file=sys.stderr, flush=True)
    if not args.save_pid:
        return run_commands(commands)
    pid_file = os.path.join(PID_DIR, f"{os.getpid()}.deepspeed")

    def save(pids: list[int]) -> None:
        with open(pid_file, "w") as f:
            f.write("".join(f"{p}\n" for p in pids))
        if level <= LOG_LEVELS.index("info"):
            print(f"llmpar launch: pid {os.getpid()}, started {pids} (in {pid_file})", file=sys.stderr, flush=True)

    try:
        return run_commands(commands, on_start=save)
    finally:
        if os.path.exists(pid_file):
            os.remove(pid_file)


__all__ = ["build_parser", "describe", "launch_from_args", "main", "notes", "register", "run_commands"]
