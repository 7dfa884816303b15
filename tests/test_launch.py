"""``llmpar launch``: DeepSpeed's hostfile and --include / --exclude rules, the commands each launcher runs
(--dry-run), and a real two-node launch simulated on this machine (two torch.distributed.run agents meeting
through c10d). The elastic restart (a real --num_gpus 2 --max_restarts 1 launch) is in test_elastic.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections import OrderedDict

import pytest

from llmpar import cli
from llmpar.launch import build_commands, describe, filter_pool, launch_from_args, parse_hostfile, resolve_pool
from llmpar.launch.cli import build_parser
from llmpar.launch.commands import exported_env

from multirank import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTFILE = """# the cluster
worker-0 slots=4

worker-1   slots=4   # the second node
worker-2 slots=2
"""


def _pool() -> OrderedDict:
    return parse_hostfile(HOSTFILE.splitlines(), name="hosts")


def test_hostfile_format():
    assert list(_pool().items()) == [("worker-0", 4), ("worker-1", 4), ("worker-2", 2)]


@pytest.mark.parametrize(
    "text, match",
    [
        ("worker-0 slots=4\nworker-1 4\n", r"hosts:2: 'worker-1 4' is not a hostfile entry.*HOST slots=N"),
        ("worker-0 slots=4\nworker-0 slots=2\n", r"hosts:2: host 'worker-0' is listed again \(first on line 1\)"),
        ("# only comments\n\n", r"hosts: no hosts"),
        ("w slots=0\n", r"hosts:1: host 'w' has slots=0"),
        ("w slots=2 extra\n", r"hosts:1: 'w slots=2 extra' is not a hostfile entry"),
        ("a slots=2\nw slots=" + "9" * 20 + "\n", r"hosts:2: host 'w' has slots=9{20}: slots must be in 1..4096"),
        ("w slots=4097\n", r"hosts:1: host 'w' has slots=4097: slots must be in 1\.\.4096"),
    ],
)
def test_bad_hostfile_names_the_line(text, match):
    with pytest.raises(ValueError, match=match):
        parse_hostfile(text.splitlines(), name="hosts")


@pytest.mark.parametrize(
    "include, exclude, expect",
    [
        # DeepSpeed's own examples (runner.py's help), checked against deepspeed.launcher.runner when written
        ("worker-0@worker-1:0,2", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        ("", "worker-1:0", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3], "worker-2": [0, 1]}),
        ("", "worker-1@worker-0:3", {"worker-0": [0, 1, 2], "worker-2": [0, 1]}),
        ("worker-2@worker-0:1", "", {"worker-0": [1], "worker-2": [0, 1]}),  # hostfile order, not the filter's
        ("worker-1:3@worker-1:1", "", {"worker-1": [1, 3]}),  # one host named twice: slots merge
        ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
    ],
)
def test_include_exclude(include, exclude, expect):
    assert filter_pool(_pool(), include, exclude) == OrderedDict(expect)


@pytest.mark.parametrize(
    "include, exclude, match",
    [
        ("worker-0", "worker-1", r"--include 'worker-0' and --exclude 'worker-1': give one of them"),
        ("worker-9", "", r"--include 'worker-9': host 'worker-9' is not in the pool \(hosts: worker-0, worker-1"),
        ("worker-2:2", "", r"host 'worker-2' has no slot 2 \(it has slots 0-1\)"),
        ("", "worker-1:x", r"--exclude 'worker-1:x': slots 'x' of 'worker-1' must be integers"),
        ("worker-0@", "", r"'' is not NAME or NAME:SLOT"),
        ("", "worker-0@worker-1@worker-2", r"--exclude .* leaves no host and slot"),
    ],
)
def test_bad_include_exclude(include, exclude, match):
    with pytest.raises(ValueError, match=match):
        filter_pool(_pool(), include, exclude)


def test_num_nodes_and_gpus_trim_or_refuse(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(HOSTFILE)
    kw = dict(hostfile=str(path), include="", exclude="", local_slots=1)
    assert resolve_pool(**kw, num_nodes=2, num_gpus=3) == OrderedDict(
        [("worker-0", [0, 1, 2]), ("worker-1", [0, 1, 2])]
    )
    with pytest.raises(ValueError, match=r"--num_nodes 4: the hostfile has 3 host\(s\)"):
        resolve_pool(**kw, num_nodes=4, num_gpus=None)
    with pytest.raises(ValueError, match=r"--num_gpus 3: more than the hostfile gives worker-2 \(slots=2\)"):
        resolve_pool(**kw, num_nodes=None, num_gpus=3)
    with pytest.raises(ValueError, match=r"--num_nodes / --num_gpus cannot be combined with --include"):
        resolve_pool(**{**kw, "include": "worker-0"}, num_nodes=None, num_gpus=2)
    with pytest.raises(ValueError, match=r"--hostfile .*nope: cannot be read"):
        resolve_pool(**{**kw, "hostfile": str(tmp_path / "nope")}, num_nodes=None, num_gpus=None)


# ---------------------------------------------------------------------------------------------------- dry runs
ENV = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "HOME_ONLY": "x", "LLMPAR_TIMEOUT_S": "60"}


def _commands(argv: list[str], tmp_path, environ: dict | None = None):
    (tmp_path / "hosts").write_text(HOSTFILE)
    args = build_parser().parse_args(["launch", *argv, "train.py", "--deepspeed_config", "ds.json"])
    cwd = os.getcwd()
    os.chdir(tmp_path)  # no ./.deepspeed_env from the repository
    try:
        return build_commands(launch_from_args(args), ENV if environ is None else environ)
    finally:
        os.chdir(cwd)


def _torchrun_flags(argv: list[str]) -> dict[str, str]:
    """torch.distributed.run's own ``--flag=value`` / ``--flag`` arguments (up to the script)."""
    out = {}
    for a in argv[argv.index("torch.distributed.run") + 1 :]:
        if not a.startswith("--"):
            break
        key, _, value = a[2:].partition("=")
        out[key] = value
    return out


def _program(argv: list[str]) -> list[str]:
    """What torch.distributed.run starts per rank (after its own flags)."""
    start = argv.index("torch.distributed.run") + 1
    return argv[start + len(_torchrun_flags(argv)) :]


WRAP = ["-m", "llmpar.launch.rank"]  # the per-rank wrapper (llmpar/launch/rank.py)


def test_dry_run_torchrun_one_node(tmp_path):
    (c,) = _commands(["--num_gpus", "2"], tmp_path)
    assert c.argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert _program(c.argv) == [*WRAP, "--pass_local_rank", "train.py", "--deepspeed_config", "ds.json"]
    assert _torchrun_flags(c.argv) == {"nnodes": "1", "nproc_per_node": "2", "standalone": "", "max_restarts": "0"}
    assert c.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#135712: restarts get a fresh store
    (c,) = _commands(["--nproc_per_node", "3", "--master_port", "2345", "--max_restarts", "2", "--module"], tmp_path)
    flags = _torchrun_flags(c.argv)
    assert (flags["nproc_per_node"], flags["rdzv_endpoint"], flags["rdzv_backend"], flags["max_restarts"]) == (
        "3",
        "127.0.0.1:2345",
        "c10d",
        "2",
    )
    assert _program(c.argv) == [*WRAP, "--pass_local_rank", "--module", "train.py", "--deepspeed_config", "ds.json"]
    (c,) = _commands(["--nproc_per_node", "3", "--module", "--no_local_rank"], tmp_path)  # nothing to do per rank
    assert _program(c.argv) == ["-m", "train.py", "--deepspeed_config", "ds.json"]
    (c,) = _commands(["-H", "hosts", "-i", "worker-1:1,3"], tmp_path)  # one host left: a local launch
    assert _torchrun_flags(c.argv)["nproc_per_node"] == "2" and c.env["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_dry_run_filters_this_machine(tmp_path, monkeypatch):
    """Without a hostfile the pool is this machine's devices (as DeepSpeed's): ``--exclude localhost:0``."""
    monkeypatch.setattr("llmpar.launch.cli._local_slots", lambda: 4)
    (c,) = _commands(["--exclude", "localhost:0"], tmp_path)
    assert _torchrun_flags(c.argv)["nproc_per_node"] == "3" and c.env["CUDA_VISIBLE_DEVICES"] == "1,2,3"
    (c,) = _commands([], tmp_path)
    assert _torchrun_flags(c.argv)["nproc_per_node"] == "4" and "CUDA_VISIBLE_DEVICES" not in c.env
    with pytest.raises(ValueError, match=r"host 'localhost' has no slot 4 \(it has slots 0-3\)"):
        _commands(["--include", "localhost:4"], tmp_path)


def test_dry_run_torchrun_node_of_many(tmp_path):
    (c,) = _commands(["--nnodes", "2", "--master_addr", "10.0.0.1", "--num_gpus", "4"], tmp_path)
    flags = _torchrun_flags(c.argv)  # no --node_rank: c10d numbers the nodes (torchrun ignores it, with a warning)
    assert flags == {
        "nnodes": "2",
        "nproc_per_node": "4",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "10.0.0.1:29500",
        "rdzv_id": "llmpar",
        "max_restarts": "0",
    }
    (c,) = _commands(["-H", "hosts", "--node_rank", "2", "--launcher", "torchrun"], tmp_path, {"SLURM_JOB_ID": "77"})
    flags = _torchrun_flags(c.argv)
    assert (flags["nnodes"], flags["nproc_per_node"], flags["rdzv_endpoint"], flags["rdzv_id"]) == (
        "3",
        "2",
        "worker-0:29500",
        "77",
    )
    with pytest.raises(ValueError, match=r"--node_rank 2: expected 0..1 \(--nnodes 2\)"):
        _commands(["--nnodes", "2", "--master_addr", "a", "--node_rank", "2"], tmp_path)
    with pytest.raises(ValueError, match=r"--nnodes 2: give --master_addr"):
        _commands(["--nnodes", "2"], tmp_path)
    with pytest.raises(ValueError, match=r"--launcher torchrun starts one node, and the hostfile has 3"):
        _commands(["-H", "hosts", "--launcher", "torchrun"], tmp_path)
    with pytest.raises(ValueError, match=r"--node_rank 3: expected 0..2"):
        _commands(["-H", "hosts", "--node_rank", "3"], tmp_path)


def test_dry_run_ssh(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("# extra\nFOO=bar baz\n")
    assert exported_env(ENV, home=str(home), cwd=str(tmp_path)) == {
        "LLMPAR_TIMEOUT_S": "60",
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/src",
        "FOO": "bar baz",
    }
    cmds = _commands(
        ["-H", "hosts", "-e", "worker-0:0", "--master_port", "3456", "--launcher_args", "-p 2222"], tmp_path
    )  # several hosts: ssh is the default
    assert [(c.node, c.host) for c in cmds] == [(0, "worker-0"), (1, "worker-1"), (2, "worker-2")]
    for i, c in enumerate(cmds):
        assert c.argv[:4] == ["ssh", "-p", "2222", c.host] and not c.env
        remote = shlex.split(c.argv[4])
        assert remote[:4] == ["cd", str(tmp_path), "&&", "env"]
        assigned = dict(a.split("=", 1) for a in remote[4:] if "=" in a and not a.startswith("-"))
        assert assigned["NCCL_DEBUG"] == "INFO" and assigned["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert "HOME_ONLY" not in assigned
        assert assigned.get("CUDA_VISIBLE_DEVICES") == ("1,2,3" if i == 0 else None)
        flags = _torchrun_flags(remote)
        assert (flags["nnodes"], flags["nproc_per_node"], flags["rdzv_endpoint"]) == (
            "3",
            ["3", "4", "2"][i],
            "worker-0:3456",
        )
    text = describe(cmds)
    assert text.splitlines()[0] == "# node 0 (worker-0)" and text.count("ssh -p 2222 worker-") == 3
    with pytest.raises(ValueError, match=r"--launcher ssh needs --hostfile"):
        _commands(["--launcher", "ssh"], tmp_path)


def test_dry_run_slurm(tmp_path):
    (c,) = _commands(["--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "4"], tmp_path)
    # every task through the wrapper (torchrun's variables before the script), no --local_rank (as DeepSpeed's runner)
    assert (
        c.argv
        == [
            "srun",
            "--nodes=2",
            "--ntasks-per-node=4",
            sys.executable,
            "-u",
            *WRAP,
            "train.py",
            "--deepspeed_config",
            "ds.json",
        ]
        and c.env == {}
    )
    env = {"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    (c,) = _commands(
        ["--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "4", "--max_restarts", "1"], tmp_path, env
    )
    assert c.argv[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", sys.executable]
    flags = _torchrun_flags(c.argv)
    assert (
        flags["nnodes"],
        flags["nproc_per_node"],
        flags["rdzv_endpoint"],
        flags["rdzv_id"],
        flags["max_restarts"],
    ) == ("2", "4", "gpu07:15123", "123", "1")  # port: 15000 + job id % 20000
    (c,) = _commands(["--launcher", "slurm", "-H", "hosts", "-i", "worker-0@worker-1"], tmp_path)
    assert c.argv[:4] == ["srun", "--nodes=2", "--nodelist=worker-0,worker-1", "--ntasks-per-node=4"]
    with pytest.raises(ValueError, match=r"--launcher slurm starts the same processes on every node"):
        _commands(["--launcher", "slurm", "-H", "hosts"], tmp_path)
    with pytest.raises(ValueError, match=r"--node_rank is for --launcher torchrun; slurm"):
        _commands(["--launcher", "slurm", "--node_rank", "0"], tmp_path)
    with pytest.raises(ValueError, match=r"outside a Slurm allocation .* give --master_addr or --hostfile"):
        _commands(["--launcher", "slurm", "--num_gpus", "2", "--max_restarts", "1"], tmp_path)


@pytest.mark.parametrize(
    "job", [{"SLURM_JOB_ID": "123042"}, {"SLURM_JOBID": "123042"}, {"SLURM_JOB_ID": "", "SLURM_JOBID": "123042"}]
)
def test_the_launcher_and_its_tasks_derive_one_port(tmp_path, job):
    """The port ``llmpar launch --launcher mpi`` gives its tasks inside a Slurm job is the one each task derives from
    the job id itself (``llmpar.launcher_env``'s rule, which ``init_distributed`` reads), whichever job-id variable
    Slurm set; the variables come from one module that imports no torch (checked in a fresh interpreter)."""
    from llmpar.launcher_env import discover

    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", **job}
    (c,) = _commands(["--launcher", "mpi", "--num_gpus", "2"], tmp_path, env)
    given = dict(c.argv[j + 1].split("=", 1) for j in range(len(c.argv) - 1) if c.argv[j] == "-x")
    task = {**env, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"}
    info = discover(task)
    assert given["MASTER_PORT"] == str(info.master_port) == "18042", (given, info.describe())
    named = next(k for k, v in job.items() if v)  # the variable Slurm set (an empty one is not set)
    assert given["LLMPAR_MASTER_PORT_FROM"] == f"18042:{info.job_port}" == f"18042:{named}=123042"
    probe = (
        "import sys, llmpar.launcher_env, llmpar.launch, llmpar.launch.rank; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


def test_dry_run_mpi(tmp_path):
    (c,) = _commands(["--launcher", "mpi", "-H", "hosts", "-i", "worker-0:0,1@worker-2"], tmp_path)
    i = c.argv.index(sys.executable)
    assert c.argv[:7] == ["mpirun", "-n", "4", "-H", "worker-0:2,worker-2:2", "--npernode", "2"]
    exported = [c.argv[j + 1] for j in range(7, i) if c.argv[j] == "-x"]
    assert {"MASTER_ADDR=worker-0", "MASTER_PORT=29500", "NCCL_DEBUG=INFO", "PYTHONPATH=/src"} <= set(exported)
    assert c.argv[i:] == [sys.executable, "-u", *WRAP, "train.py", "--deepspeed_config", "ds.json"]
    with pytest.raises(ValueError, match=r"--max_restarts 1: mpirun does not restart ranks"):
        _commands(["--launcher", "mpi", "--num_gpus", "2", "--max_restarts", "1"], tmp_path)
    with pytest.raises(ValueError, match=r"--launcher mpi on 2 nodes without a hostfile: give --master_addr"):
        _commands(["--launcher", "mpi", "--num_nodes", "2", "--num_gpus", "2"], tmp_path)


def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys):
    assert "llmpar.launch" in cli._COMMAND_MODULES  # `llmpar launch` is this parser
    args = build_parser().parse_args(["launch", "--num_gpus", "0", "--dry-run", "x.py"])
    assert args.func(args) == 2
    assert "--num_gpus 0: must be >= 1" in capsys.readouterr().err
    args = build_parser().parse_args(["launch", "--num_gpus", "2", "--launcher_args", "'-x", "--dry-run", "x.py"])
    assert args.func(args) == 2
    assert '--launcher_args "\'-x": No closing quotation' in capsys.readouterr().err
    args = build_parser().parse_args(["launch", "--num_gpus", "9" * 20, "--dry-run", "x.py"])  # not OverflowError
    assert args.func(args) == 2
    assert f"--num_gpus {'9' * 20}: processes per node must be in 1..4096" in capsys.readouterr().err
    args = build_parser().parse_args(["launch", "--num_gpus", "2", "--dry-run", "x.py", "--lr", "1"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# node 0 (localhost)" and out[1].endswith("x.py --lr 1")


def test_train_started_by_srun_is_a_rank_of_that_job(monkeypatch, capsys):
    """``llmpar train`` in a task of ``srun`` (``--launcher slurm``) is a rank of the srun job (the launcher
    discovery of init_distributed), not a new torchrun job of --nproc ranks: 3 tasks do not divide by --tp 2."""
    from llmpar.train import command

    for k in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_"))] + ["RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(k, raising=False)
    for k, v in {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "3",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "3",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_ID": "5",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(command, "_relaunch", lambda args: pytest.fail("llmpar train relaunched under torchrun"))
    args = cli.build_parser().parse_args(["train", "--tp", "2", "--steps", "1"])
    assert command.main(args) == 2
    assert "--tp=2 does not divide the 3 ranks" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- a real two-node launch
SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
import argparse
import llmpar
parser = argparse.ArgumentParser()  # a DeepSpeed script's: the launcher passes --local_rank=N
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("rest", nargs=2)
args = parser.parse_args()
env = llmpar.init_distributed()
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
with open(os.path.join(args.rest[0], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": x.item(), "arg": args.rest[1],
               "node_env": os.environ["GROUP_RANK"], "local": os.environ["LOCAL_RANK"],
               "arg_local": args.local_rank}, f)
"""


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    """Two nodes simulated on localhost: the same hostfile (``127.0.0.1 slots=1``, ``localhost slots=1``) on both,
    ``--node_rank 0`` and ``--node_rank 1`` (as on two machines); the two torch.distributed.run agents meet through
    c10d at the first host, one rank each, one world of 2. Through ``python -m llmpar.launch`` (``llmpar launch``
    without loading torch in the launching process)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    (tmp_path / "hosts").write_text("# two nodes, one slot each\n127.0.0.1 slots=1\nlocalhost slots=1\n")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmpar.launch",
                "--hostfile",
                "hosts",
                "--node_rank",
                str(n),
                "--master_port",
                str(port),
                str(script),
                str(tmp_path),
                "hello world",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert all("--nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:" in o for o in outs)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(g["rank"], g["world"], g["sum"], g["arg"], g["local"], g["arg_local"]) for g in got] == [
        (0, 2, 3.0, "hello world", "0", 0),
        (1, 2, 3.0, "hello world", "0", 0),
    ]
    assert sorted(g["node_env"] for g in got) == ["0", "1"]  # one rank on each simulated node
