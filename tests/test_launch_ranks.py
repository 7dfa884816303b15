"""``llmpar launch`` as a stand-in for DeepSpeed's ``deepspeed`` launcher, and what each rank's process gets before
its script (``llmpar/launch/rank.py``): DeepSpeed's ``--local_rank=N`` and launcher flags (every flag DeepSpeed
0.19's runner defines is accepted), cores bound per rank, a log file per rank, the pid file; and srun / mpirun tasks
that see torchrun's variables before the script starts (an HF ``TrainingArguments`` reads them at once), with
``srun`` / ``mpirun`` simulated by small stand-ins on PATH that start N local processes with Slurm's / OpenMPI's
variables, as the real ones do on one node."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys

import pytest

from llmpar.launch import build_commands, launch_from_args, rank
from llmpar.launch.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "LLMPAR_MASTER")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _deepspeed_runner_flags() -> list[str]:
    """The option strings of DeepSpeed's ``deepspeed`` command (its runner.py, read as text: no import)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("DeepSpeed is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "launcher", "runner.py")
    with open(path) as f:
        text = f.read()
    calls = re.findall(r"add_argument\(((?:\s*[\"'][^\"']*[\"']\s*,)+)", text)
    flags = sorted({s for call in calls for s in re.findall(r"[\"'](-[^\"']+)[\"']", call)})
    assert len(flags) > 20, flags  # the parse found the parser
    return flags


# a value for each DeepSpeed runner option that takes one (the others are switches); None: tested on its own
SAMPLE = {
    "--hostfile": ["hosts"],
    "-H": ["hosts"],
    "--include": ["w1"],
    "-i": ["w1"],
    "--exclude": ["w1"],
    "-e": ["w1"],
    "--num_nodes": ["1"],
    "--num_gpus": ["2"],
    "--num_accelerators": ["2"],
    "--master_port": ["29511"],
    "--master_addr": ["127.0.0.1"],
    "--node_rank": ["0"],
    "--launcher": ["torchrun"],
    "--launcher_args": [""],
    "--enable_each_rank_log": ["logs"],
    "--bind_core_list": ["0-1"],
    "--ssh_port": ["2222"],
    "--venv_script": ["venv/bin/activate"],
    "--log_level": ["warning"],
    "--autotuning": None,
}


def test_every_deepspeed_launcher_flag_is_accepted(tmp_path, capsys, monkeypatch):
    """Each option of DeepSpeed's runner parses (no argparse error) and a launch with it dry-runs; the flags with
    no meaning on the route are said once. ``--autotuning`` (no autotuner here) is refused, naming it."""
    parser = build_parser()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    for flag in _deepspeed_runner_flags():
        values = SAMPLE.get(flag, [])
        if values is None:
            continue
        if flag in ("--include", "-i", "--exclude", "-e"):
            extra = ["-H", "hosts"]
        else:
            extra = ["--num_gpus", "2"] if flag not in ("--num_gpus", "--num_accelerators") else []
        args = parser.parse_args(["launch", "--dry-run", *extra, flag, *values, "train.py", "--lr", "1"])
        assert main(args) == 0, (flag, capsys.readouterr().err)
        capsys.readouterr()
    args = parser.parse_args(["launch", "--dry-run", "--autotuning", "tune", "train.py"])
    assert main(args) == 2 and "--autotuning tune: llmpar has no autotuner" in capsys.readouterr().err
    args = parser.parse_args(
        [
            "launch",
            "--dry-run",
            "--num_gpus",
            "2",
            "--no_ssh_check",
            "--ssh_port",
            "22",
            "--venv_script",
            "v.sh",
            "--bind_core_list",
            "0",
            "--force_multi",
            "train.py",
        ]
    )
    assert main(args) == 0
    err = capsys.readouterr().err
    for said in (
        "--no_ssh_check: llmpar launch makes no ssh check",
        "--ssh_port: used by --launcher ssh only",
        "--venv_script: used by --launcher ssh only",
        "--bind_core_list: used with --bind_cores_to_rank",
        "--force_multi: without --hostfile",
    ):
        assert err.count(said) == 1, (said, err)
    args = parser.parse_args(["launch", "--dry-run", "-q", "--num_gpus", "2", "--no_ssh_check", "train.py"])
    assert main(args) == 0 and capsys.readouterr().err == ""  # --quiet: errors only


def _commands(argv: list[str], tmp_path, environ: dict | None = None):
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    (tmp_path / "one").write_text("w0 slots=2\n")
    args = build_parser().parse_args(["launch", *argv, "train.py", "--lr", "1"])
    return build_commands(launch_from_args(args), environ or {})


def _after(argv: list[str], token: str) -> list[str]:
    return argv[argv.index(token) + 1 :]


def test_deepspeed_flags_on_each_route(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (c,) = _commands(
        [
            "--num_gpus",
            "2",
            "--no_python",
            "--bind_cores_to_rank",
            "--bind_core_list",
            "0,1",
            "--enable_each_rank_log",
            "logs",
        ],
        tmp_path,
    )
    opts = _after(c.argv, "llmpar.launch.rank")
    assert opts[:4] == ["--pass_local_rank", "--no_python", "--bind_cores_to_rank", "--bind_core_list=0,1"]
    assert opts[4] == "--enable_each_rank_log=logs" and re.fullmatch(r"--log_name_prefix=\d{14}", opts[5])
    assert opts[6:] == ["train.py", "--lr", "1"]
    cmds = _commands(["-H", "hosts", "--ssh_port", "2200", "--venv_script", "/v/act", "--no_local_rank"], tmp_path)
    assert [c.argv[:4] for c in cmds] == [["ssh", "-p", "2200", h] for h in ("w0", "w1")]
    assert cmds[0].argv[4].startswith(". /v/act && cd ") and "llmpar.launch.rank" not in cmds[0].argv[4]
    (c,) = _commands(["-H", "hosts", "--no_ssh", "--node_rank", "1"], tmp_path)  # this node only: torchrun
    assert "torch.distributed.run" in c.argv and "--nnodes=2" in c.argv and c.argv[0] != "ssh"
    with pytest.raises(ValueError, match=r"give this node's --node_rank"):
        _commands(["-H", "hosts", "--no_ssh"], tmp_path)
    with pytest.raises(ValueError, match=r"--no_ssh starts this node only \(torchrun\), not --launcher slurm"):
        _commands(["--no_ssh", "--launcher", "slurm"], tmp_path)
    (c,) = _commands(["-H", "one", "--force_multi"], tmp_path)  # one host, still over ssh
    assert c.argv[:2] == ["ssh", "w0"]
    (c,) = _commands(["--launcher", "mpi", "--num_gpus", "2"], tmp_path, {"SLURM_JOB_ID": "123042"})
    assert "LLMPAR_MASTER_PORT_FROM=18042:SLURM_JOB_ID=123042" in c.argv and "--pass_local_rank" not in c.argv
    with pytest.raises(ValueError, match=r"--no_python and --module cannot be combined"):
        _commands(["--no_python", "--module"], tmp_path)
    with pytest.raises(ValueError, match=r"--bind_core_list '2-1'"):
        _commands(["--bind_cores_to_rank", "--bind_core_list", "2-1"], tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"--enable_each_rank_log afile: is a file"):
        _commands(["--enable_each_rank_log", "afile"], tmp_path)


def test_rank_wrapper_pieces():
    assert rank.parse_core_list("0,2-4,7") == [0, 2, 3, 4, 7]
    for bad in ("1,1", "3-2", "a", "0,,1", "1-"):
        with pytest.raises(ValueError, match="--bind_core_list"):
            rank.parse_core_list(bad)
    assert [rank.rank_cores([4, 5, 6, 7, 8], r, 2, source="s") for r in (0, 1)] == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"--bind_cores_to_rank: 2 core\(s\) \(s\) for 3 ranks"):
        rank.rank_cores([0, 1], 0, 3, source="s")
    opts, program = rank.parse(["--pass_local_rank", "--bind_core_list=0-3", "x.py", "--lr", "--pass_local_rank"])
    assert opts == {"pass_local_rank": True, "bind_core_list": "0-3"} and program == [
        "x.py",
        "--lr",
        "--pass_local_rank",
    ]
    assert rank.command(opts, program, 3) == [
        sys.executable,
        "-u",
        "x.py",
        "--local_rank=3",
        "--lr",
        "--pass_local_rank",
    ]
    assert rank.command({"no_python": True}, ["./run.sh", "a"], 1) == ["./run.sh", "a"]
    assert rank.command({"module": True, "pass_local_rank": True}, ["pkg.m"], 0)[2:] == [
        "-m",
        "pkg.m",
        "--local_rank=0",
    ]
    for bad in (["--bogus", "x.py"], ["--bind_core_list", "x.py"], ["--module"], ["--module", "--no_python", "x"]):
        with pytest.raises(ValueError):
            rank.parse(bad)
    slurm = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "gpu[7-8]",
        "SLURM_JOB_ID": "123042",
        "PATH": "/bin",
    }
    env, r, local, local_world = rank.rank_environment(slurm)
    assert (r, local, local_world) == (3, 1, 2)
    assert {k: env[k] for k in (*_TORCHRUN, "LLMPAR_MASTER_PORT_FROM", "PATH")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu7",
        "MASTER_PORT": "18042",
        "LLMPAR_MASTER_PORT_FROM": "18042:SLURM_JOB_ID=123042",
        "PATH": "/bin",
    }
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert rank.rank_environment(torchrun)[0] == torchrun  # torchrun's own: as they are
    probe = (
        "import sys; from llmpar.launch import rank; print(rank.rank_environment(dict(SLURM_PROCID='0', "
        "SLURM_NTASKS='1'))[0]['WORLD_SIZE'], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "False"], out.stderr  # the wrapper does not import torch before the exec


# ------------------------------------------------------------------------------------------- real launches
DS_JOB = r"""
import argparse, json, os, sys
parser = argparse.ArgumentParser()  # DeepSpeedExamples' shape: -1 means "not distributed"
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--tag")
args = parser.parse_args()
stat = open(f"/proc/{os.getppid()}/stat").read()  # the torchrun agent; its parent is llmpar launch
launcher = int(stat[stat.rindex(")") + 2:].split()[1])
pid_file = f"/tmp/{launcher}.deepspeed"
print(json.dumps({"local_rank": args.local_rank, "tag": args.tag, "env_local": os.environ["LOCAL_RANK"],
                  "rank": os.environ["RANK"], "cores": sorted(os.sched_getaffinity(0)),
                  "omp": os.environ.get("OMP_NUM_THREADS"), "agent": os.getppid(),
                  "pids": open(pid_file).read().split() if os.path.exists(pid_file) else None}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN and not k.startswith(_LAUNCH_PREFIXES)}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""), **extra}


def _rank_logs(folder) -> list[dict]:
    logs = sorted(folder.iterdir())
    assert [re.fullmatch(r"\d{14}_rank(\d)\.log", p.name).group(1) for p in logs] == ["0", "1"], logs
    return [json.loads(p.read_text().strip().splitlines()[-1]) for p in logs]


def test_deepspeed_script_gets_local_rank_cores_logs_and_pid_file(tmp_path, ds_ext_dir):
    """``llmpar launch --num_gpus 2 --bind_cores_to_rank --enable_each_rank_log logs --save_pid job.py --tag t``:
    each rank's DeepSpeed-shaped script parses ``--local_rank`` = its LOCAL_RANK, runs on its own half of the
    cores with OMP_NUM_THREADS to match, prints into its own log file, and finds /tmp/<launcher pid>.deepspeed
    naming its torchrun agent; the pid file is gone after the launch. Stock ``deepspeed`` with the same flags (but
    core binding, which needs numactl there) gives the script the same arguments, log names and pid file."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    (tmp_path / "job.py").write_text(DS_JOB)
    flags = ["--num_gpus", "2", "--enable_each_rank_log", "logs", "--save_pid", "job.py", "--tag", "t"]
    proc = subprocess.run(
        [sys.executable, "-m", "llmpar.launch", "--bind_cores_to_rank", *flags],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _rank_logs(tmp_path / "logs")
    half = len(allowed) // 2
    for r, g in enumerate(got):
        assert (g["local_rank"], g["tag"], g["env_local"], g["rank"]) == (r, "t", str(r), str(r))
        assert g["cores"] == allowed[r * half : (r + 1) * half] and g["omp"] == str(half)
        assert g["pids"] == [str(g["agent"])]
    launcher_pid = re.search(r"pid (\d+), started", proc.stderr).group(1)
    assert not os.path.exists(f"/tmp/{launcher_pid}.deepspeed")
    if importlib.util.find_spec("deepspeed") is None:
        return
    (tmp_path / "logs").rename(tmp_path / "ours")
    stock = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "deepspeed"), *flags],
        cwd=tmp_path,
        env=_env(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(ds_ext_dir)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert stock.returncode == 0, stock.stderr[-3000:]
    theirs = _rank_logs(tmp_path / "logs")
    for g in theirs:
        assert g["pids"] == [str(g["agent"])]
    keys = ("local_rank", "tag", "env_local", "rank")
    assert [[g[k] for k in keys] for g in got] == [[g[k] for k in keys] for g in theirs]


FAKE_SRUN = r'''#!{python}
"""srun on one node: --ntasks-per-node=N local processes with the variables srun sets."""
import os, subprocess, sys
args = sys.argv[1:]
opts = {{}}
while args[0].startswith("--"):
    k, _, v = args.pop(0)[2:].partition("=")
    opts[k] = v
assert opts["nodes"] == "1", opts
n = int(opts["ntasks-per-node"])
procs = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
                                      "SLURM_NODEID": "0", "SLURM_NTASKS": str(n), "SLURM_STEP_NUM_TASKS": str(n),
                                      "SLURM_STEP_TASKS_PER_NODE": str(n), "SLURM_STEP_NODELIST": "127.0.0.1"}})
         for i in range(n)]
sys.exit(max(p.wait() for p in procs))
'''
FAKE_MPIRUN = r'''#!{python}
"""OpenMPI's mpirun on one node: -n N processes with the variables it sets (-x K=V exported)."""
import os, subprocess, sys
args, env, n = sys.argv[1:], dict(os.environ), None
while args[0].startswith("-"):
    flag = args.pop(0)
    value = args.pop(0)
    if flag == "-n":
        n = int(value)
    elif flag == "-x":
        k, _, v = value.partition("=")
        env[k] = v
procs = [subprocess.Popen(args, env={{**env, "OMPI_COMM_WORLD_RANK": str(i), "OMPI_COMM_WORLD_SIZE": str(n),
                                      "OMPI_COMM_WORLD_LOCAL_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)}})
         for i in range(n)]
sys.exit(max(p.wait() for p in procs))
'''
HF_JOB = r"""
import json, os, sys
seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                       "MASTER_PORT", "LLMPAR_MASTER_PORT_FROM")}
if sys.argv[2] == "hf":  # what HF Trainer scripts do first: TrainingArguments reads the job from the environment
    import torch.distributed as dist
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, use_cpu=True, report_to=[])
    seen.update(world=args.world_size, process=args.process_index, local=args.local_process_index,
                group=dist.get_world_size() if dist.is_initialized() else None)
with open(os.path.join(sys.argv[1], f"{sys.argv[2]}{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
"""


def test_srun_and_mpirun_tasks_see_torchrun_variables_before_the_script(tmp_path):
    """The Slurm route of docs/launching.md (``--launcher slurm``, srun simulated) with an HF-Trainer-shaped script:
    each task sees RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_* before any llmpar call, so transformers'
    TrainingArguments counts 2 processes and meets the other task (the port from SLURM_JOB_ID, marked as such);
    the same through ``--launcher mpi`` (mpirun simulated)."""
    from test_cluster_env import _slurm_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("mpirun", FAKE_MPIRUN)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(stat.S_IRWXU)
    (tmp_path / "job.py").write_text(HF_JOB)
    port, job = _slurm_port()
    env = _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=str(job), SLURM_JOB_NODELIST="127.0.0.1")
    for launcher, kind in (("slurm", "hf"), ("mpi", "plain")):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmpar.launch",
                "--launcher",
                launcher,
                "--num_nodes",
                "1",
                "--num_gpus",
                "2",
                "job.py",
                str(tmp_path),
                kind,
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, (launcher, proc.stderr[-3000:])
    for r in (0, 1):
        want = {
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LLMPAR_MASTER_PORT_FROM": f"{port}:SLURM_JOB_ID={job}",
        }
        hf = json.loads((tmp_path / f"hf{r}.json").read_text())
        assert hf == {**want, "world": 2, "process": r, "local": r, "group": 2}, hf
        assert json.loads((tmp_path / f"plain{r}.json").read_text()) == want
