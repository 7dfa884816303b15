"""This process's launch as torch.distributed and the engine see it. The launcher's variables are read by
:func:`llmpar.launcher_env.discover` (precedence, master address and port rules there, standard library only so that
``llmpar launch`` shares them); here the result is written back as torchrun's variables before the rendezvous
(:func:`export`), a port clash is explained (:func:`port_in_use`), and the local rank is read for the engine
(:func:`local_rank`) and checked against DeepSpeed's ``--local_rank`` argument (:func:`adopt_local_rank`).
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

from llmpar.launcher_env import LOCAL_RANK_VARS, LaunchInfo, env_int


def export(info: LaunchInfo, environ: MutableMapping[str, str] | None = None) -> None:
    """Write ``info``'s torchrun-style variables into ``environ`` (default ``os.environ``), so that torch's env://
    rendezvous and every reader of LOCAL_RANK / LOCAL_WORLD_SIZE see what the launcher decided."""
    (os.environ if environ is None else environ).update(info.torchrun_env())


def local_rank(default: int, environ: Mapping[str, str] | None = None) -> int:
    """This process's local rank as the launcher set it (:data:`~llmpar.launcher_env.LOCAL_RANK_VARS`: torchrun's /
    DeepSpeed's ``LOCAL_RANK``, else OpenMPI's), ``default`` without one; a ValueError naming the variable when it is
    not an integer."""
    env = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARS:
        if env.get(name) not in (None, ""):
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return default


def adopt_local_rank(value: int, environ: MutableMapping[str, str] | None = None) -> None:
    """DeepSpeed's ``--local_rank`` convention, before the process group starts: a non-negative ``value`` must equal
    ``LOCAL_RANK`` when the launcher set it, and stands in for it when it did not (written to ``environ``, default
    ``os.environ``: DeepSpeed's engine reads ``LOCAL_RANK``, so does llmpar's device choice)."""
    if value < 0:  # DeepSpeed's default -1: nothing given
        return
    env = os.environ if environ is None else environ
    given = env_int(env, LOCAL_RANK_VARS[0], "the launcher")
    if given is not None and given != value:
        raise ValueError(
            f"args.local_rank={value} but the environment has LOCAL_RANK={env[LOCAL_RANK_VARS[0]]}: launch with one "
            "launcher (torchrun sets LOCAL_RANK, DeepSpeed's launcher sets both alike)"
        )
    if given is None:
        env[LOCAL_RANK_VARS[0]] = str(value)


def port_in_use(launch: LaunchInfo) -> str:
    """What rank 0 says when the rendezvous port is taken: where the port came from and how to choose another."""
    port, where = launch.master_port, f"{launch.master_addr}:{launch.master_port}"
    fix = (
        "set MASTER_PORT to a free port, the same for every rank (e.g. `export MASTER_PORT=$((15000 + RANDOM % "
        "20000))` in the batch script, before srun), or pass `llmpar launch --master_port PORT` or "
        "init_distributed(master_port=...)"
    )
    if launch.job_port:
        return (
            f"the rendezvous port {port} is already in use on {where}: the port came from {launch.job_port} "
            f"(15000 + job id % 20000), so another job on this node whose id is equal mod 20000 (or another "
            f"program) holds it; {fix}"
        )
    return f"the rendezvous port {port} ({launch.master_from}) is already in use on {where}; {fix}"


__all__ = ["adopt_local_rank", "export", "local_rank", "port_in_use"]
