"""``llmpar launch``: DeepSpeed's launcher flags over torch.distributed.run, ssh, srun and mpirun (``cli.py``);
the hostfile and ``--include`` / ``--exclude`` rules (``resources.py``); the command lines (``commands.py``)."""

from llmpar.launch.cli import describe, launch_from_args, main, register, run_commands
from llmpar.launch.commands import LAUNCHERS, Launch, NodeCommand, build_commands, exported_env
from llmpar.launch.resources import filter_pool, parse_hostfile, read_hostfile, resolve_pool, trim

__all__ = [
    "LAUNCHERS",
    "Launch",
    "NodeCommand",
    "build_commands",
    "describe",
    "exported_env",
    "filter_pool",
    "launch_from_args",
    "main",
    "parse_hostfile",
    "read_hostfile",
    "register",
    "resolve_pool",
    "run_commands",
    "trim",
]
