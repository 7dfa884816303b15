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
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from llmpar.launch.commands import LAUNCHERS, Launch, NodeCommand, build_commands
from llmpar.launch.resources import resolve_pool


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``launch`` to the ``llmpar`` command."""
    p = subparsers.add_parser("launch", help="start a script on many processes / nodes (DeepSpeed's launcher flags "
                              "over torchrun, ssh, srun, mpirun)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("-H", "--hostfile", default=None, help="MPI-style hostfile: lines 'HOST slots=N' (DeepSpeed's format)")
    add("-i", "--include", default="", help="hosts / slots to use: NODE[:SLOT,...][@NODE...], e.g. 'w0@w1:0,2'")
    add("-e", "--exclude", default="", help="hosts / slots not to use (same format as --include)")
    add("--num_nodes", "--nnodes", "--num-nodes", dest="num_nodes", type=int, default=None,
        help="nodes: the first N hosts of the hostfile; without one, the job's node count (run on each node)")
    add("--num_gpus", "--num_accelerators", "--nproc_per_node", "--nproc-per-node", "--num-gpus", dest="num_gpus",
        type=int, default=None, help="processes per node (slots 0..N-1 of each host); default: the hostfile's slots, "
        "else this machine's GPU count (1 on a CPU-only machine)")
    add("--node_rank", "--node-rank", dest="node_rank", type=int, default=None,
        help="which host of the hostfile this node is (--launcher torchrun on several nodes; without a hostfile "
             "the c10d rendezvous numbers the nodes)")
    add("--master_addr", "--master-addr", dest="master_addr", default=None,
        help="rendezvous host (default: the first host; 127.0.0.1 on one node)")
    add("--master_port", "--master-port", dest="master_port", type=int, default=None,
        help="rendezvous port (default: a free port on one node, else 29500; under Slurm 15000 + job id %% 20000)")
    add("--max_restarts", "--max-restarts", dest="max_restarts", type=int, default=0,
        help="restart every rank up to N times when one fails (torch.distributed.run's agent)")
    add("--launcher", choices=LAUNCHERS, default=None,
        help="torchrun (this node), ssh (every host of the hostfile), slurm (srun), mpi (OpenMPI mpirun); default "
             "ssh for a hostfile of several hosts without --node_rank, else torchrun")
    add("--launcher_args", "--launcher-args", dest="launcher_args", default="",
        help="extra arguments for torch.distributed.run / ssh / srun / mpirun, one quoted string")
    add("--rdzv_id", "--rdzv-id", dest="rdzv_id", default=None, help="rendezvous id (default: SLURM_JOB_ID or llmpar)")
    add("--module", action="store_true", help="the script is a module name (python -m)")
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
    if args.node_rank is not None and args.node_rank < 0:
        raise ValueError(f"--node_rank {args.node_rank}: must be >= 0")
    need_local = args.hostfile is None and args.num_gpus is None
    hosts = resolve_pool(hostfile=args.hostfile, include=args.include, exclude=args.exclude,
                         num_nodes=args.num_nodes, num_gpus=args.num_gpus, local_slots=_local_slots() if need_local
                         else 1)
    try:
        launcher_args = shlex.split(args.launcher_args)
    except ValueError as e:
        raise ValueError(f"--launcher_args {args.launcher_args!r}: {e}") from None
    local = hosts if args.hostfile is None else None
    slots = next(iter(local.values())) if local is not None else []
    return Launch(script=args.script, script_args=list(args.script_args), module=args.module,
                  hosts=hosts if args.hostfile is not None else None, nnodes=args.num_nodes or 1,
                  nproc=len(slots) or 1, node_rank=args.node_rank, master_addr=args.master_addr,
                  master_port=args.master_port, max_restarts=args.max_restarts, launcher=args.launcher,
                  launcher_args=launcher_args, rdzv_id=args.rdzv_id,
                  visible=(None if slots == list(range(len(slots))) else ",".join(map(str, slots))))


def describe(commands: list[NodeCommand]) -> str:
    """The ``--dry-run`` text: per command, a comment naming the node it starts, then the shell line."""
    lines = []
    for c in commands:
        where = f"every node {c.host}" if c.host.startswith("(") else f"node {c.node} ({c.host})"
        lines += [f"# {where}", c.shell()]
    return "\n".join(lines)


def run_commands(commands: list[NodeCommand], poll_s: float = 0.2) -> int:
    """Run the commands side by side; SIGINT / SIGTERM are passed on to them. When one fails the others are
    terminated. Returns the first non-zero exit status (0 when every command succeeded)."""
    procs = [subprocess.Popen(c.argv, env={**os.environ, **c.env}) for c in commands]

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
    try:
        commands = build_commands(launch_from_args(args))
    except ValueError as err:
        print(f"llmpar launch: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(describe(commands))
        return 0
    for c in commands:
        print(f"llmpar launch: {c.shell()}", file=sys.stderr, flush=True)
    return run_commands(commands)


__all__ = ["build_parser", "describe", "launch_from_args", "main", "register", "run_commands"]
