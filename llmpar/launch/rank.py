"""``python -m llmpar.launch.rank [--OPTION[=VALUE] ...] SCRIPT [ARGS]``: what ``llmpar launch`` runs in each rank's
process before the user's script (DeepSpeed's per-rank launcher ``deepspeed.launcher.launch``, as one ``exec``):

  1. torchrun's variables: a task of ``srun`` / ``mpirun`` (no ``RANK`` / ``WORLD_SIZE`` yet) gets ``RANK``,
     ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` from the launcher's own
     (``llmpar.launcher_env``'s rules, ``init_distributed``'s), so code that reads them before ``init_distributed``
     (transformers' ``TrainingArguments``, accelerate's ``PartialState``) sees the job; a port derived from
     ``SLURM_JOB_ID`` is marked (``LLMPAR_MASTER_PORT_FROM``) so that a port clash can say so;
  2. ``--bind_cores_to_rank``: this rank's share of the cores (``--bind_core_list``, else the CPUs this process may
     use): ``len(cores) // local ranks`` cores each, in order, set with ``os.sched_setaffinity`` (inherited by the
     script) and ``OMP_NUM_THREADS`` (DeepSpeed does the same with ``numactl -C``);
  3. ``--enable_each_rank_log=DIR``: the script's stdout and stderr go to ``DIR/<PREFIX>_rank<R>.log``;
  4. ``exec``: ``python -u SCRIPT [--local_rank=N] ARGS`` (``--pass_local_rank``: DeepSpeed's argument, right after
     the script), ``python -u -m MODULE ...`` (``--module``), or ``SCRIPT ...`` itself (``--no_python``).

Options come first, each ``--name`` or ``--name=value``; the first argument not starting with ``--`` is the script.
This module imports no torch (the script does; ``llmpar.launcher_env`` is standard library only). A bad option or
launcher variable exits 2 with a message naming it.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

from llmpar.launcher_env import PORT_FROM_VAR, discover

FLAGS = ("pass_local_rank", "module", "no_python", "bind_cores_to_rank")
VALUED = ("bind_core_list", "enable_each_rank_log", "log_name_prefix")


def parse_core_list(text: str, *, flag: str = "--bind_core_list") -> list[int]:
    """``"0,2-4,7"`` -> [0, 2, 3, 4, 7] (DeepSpeed's syntax: numbers and inclusive ranges, ascending, no overlap);
    a ValueError naming ``flag`` otherwise."""
    out: list[int] = []
    for piece in text.split(","):
        lo, sep, hi = piece.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or len(lo) > 6 or len(hi) > 6:
            raise ValueError(
                f"{flag} {text!r}: {piece!r} is not a core number or range like 2-5 (expected e.g. '0,2-4,7')"
            )
        low, high = int(lo), int(hi) if sep else int(lo)
        if high < low or (out and low <= out[-1]):
            raise ValueError(f"{flag} {text!r}: ranges must ascend without overlap ({piece!r})")
        out.extend(range(low, high + 1))
    return out


def rank_cores(pool: Sequence[int], local_rank: int, local_world_size: int, *, source: str) -> list[int]:
    """Local rank ``local_rank``'s cores: the ``local_rank``-th of ``local_world_size`` equal consecutive slices of
    ``pool`` (the remainder unused, as DeepSpeed). Fewer cores than local ranks raises a ValueError."""
    per = len(pool) // local_world_size
    if per < 1:
        raise ValueError(
            f"--bind_cores_to_rank: {len(pool)} core(s) ({source}) for {local_world_size} ranks on this "
            "node: each rank needs at least one (give --bind_core_list, or start fewer ranks per node)"
        )
    return list(pool[per * local_rank : per * (local_rank + 1)])


def parse(argv: Sequence[str]) -> tuple[dict[str, str | bool], list[str]]:
    """(options, [script, *args]) of the wrapper's command line (module docstring)."""
    options: dict[str, str | bool] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, eq, value = argv[i][2:].partition("=")
        if name in FLAGS and not eq:
            options[name] = True
        elif name in VALUED and eq:
            options[name] = value
        else:
            raise ValueError(
                f"llmpar.launch.rank: unknown option {argv[i]!r} (flags: {', '.join(FLAGS)}; with "
                f"=VALUE: {', '.join(VALUED)})"
            )
        i += 1
    if i == len(argv):
        raise ValueError("llmpar.launch.rank: no script to run")
    if options.get("module") and options.get("no_python"):
        raise ValueError("--no_python and --module cannot be combined (as in DeepSpeed): a module runs under python")
    return options, list(argv[i:])


def rank_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], int, int, int]:
    """(the script's environment, global rank, local rank, local world size): ``environ`` plus torchrun's
    variables read from whichever launcher started this process."""
    info = discover(environ)
    env = dict(environ)
    if info.source not in ("torchrun", "none"):
        env.update(info.torchrun_env())
        if info.job_port and info.master_port is not None:
            env[PORT_FROM_VAR] = f"{info.master_port}:{info.job_port}"
    return env, info.rank, info.local_rank, info.local_world_size


def command(options: Mapping[str, str | bool], program: Sequence[str], local_rank: int) -> list[str]:
    """The argv the wrapper execs (module docstring, step 4)."""
    script, args = program[0], list(program[1:])
    extra = [f"--local_rank={local_rank}"] if options.get("pass_local_rank") else []
    if options.get("no_python"):
        return [script, *extra, *args]
    return [sys.executable, "-u", *(["-m"] if options.get("module") else []), script, *extra, *args]


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Prepare this rank (module docstring) and exec its script; returns only on an error (exit status 2)."""
    try:
        options, program = parse(sys.argv[1:] if argv is None else argv)
        env, rank, local_rank, local_world = rank_environment(os.environ if environ is None else environ)
        if options.get("bind_cores_to_rank"):
            allowed = sorted(os.sched_getaffinity(0))
            listed = options.get("bind_core_list")
            if isinstance(listed, str):
                pool = parse_core_list(listed)
                outside = [c for c in pool if c not in allowed]
                if outside:
                    raise ValueError(
                        f"--bind_core_list {listed!r}: core(s) {outside} are not among the CPUs this "
                        f"process may use ({allowed})"
                    )
                source = f"--bind_core_list {listed}"
            else:
                pool, source = allowed, "the CPUs this process may use"
            cores = rank_cores(pool, local_rank, local_world, source=source)
            os.sched_setaffinity(0, cores)
            env["OMP_NUM_THREADS"] = str(len(cores))
        argv_out = command(options, program, local_rank)
        log_dir = options.get("enable_each_rank_log")
        if isinstance(log_dir, str):
            os.makedirs(log_dir, exist_ok=True)
            prefix = options.get("log_name_prefix") or "llmpar"
            fd = os.open(
                os.path.join(log_dir, f"{prefix}_rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
            )
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
    except (ValueError, OSError) as err:
        print(f"llmpar launch: error: {err}", file=sys.stderr)
        return 2
    try:
        os.execvpe(argv_out[0], argv_out, env)
    except OSError as err:
        print(f"llmpar launch: error: cannot run {argv_out[0]!r}: {err.strerror or err}", file=sys.stderr)
        return 127 if isinstance(err, FileNotFoundError) else 126
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
