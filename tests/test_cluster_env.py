"""Launcher discovery: torchrun / OpenMPI / MPICH-PMI / Slurm variables -> rank, sizes, master (llmpar.launcher_env),
and processes started with only Slurm's or only OpenMPI's variables joining one world (init_distributed)."""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from llmpar.distributed.discovery import export
from llmpar.launcher_env import discover, expand_nodelist, parse_tasks_per_node

_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("a1,b2", ["a1", "b2"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("gpu-[1-2]-[3-4]", ["gpu-1-3", "gpu-1-4", "gpu-2-3", "gpu-2-4"]),
        ("gpu[3,1],cpu[09-10]x", ["gpu3", "gpu1", "cpu09x", "cpu10x"]),
        ("127.0.0.1", ["127.0.0.1"]),
    ],
)
def test_nodelist_expansion(nodelist, hosts):
    assert list(expand_nodelist(nodelist)) == hosts


def test_nodelist_is_expanded_lazily():
    """The first host of a huge range without building the range (it took a list of 10^8 names, MemoryError)."""
    import tracemalloc

    tracemalloc.start()
    try:
        assert next(expand_nodelist("node[0-3000000]")) == "node0"
        assert tracemalloc.get_traced_memory()[1] < 1 << 20  # peak: < 1 MiB (the old list of 3M names: ~200 MiB)
    finally:
        tracemalloc.stop()
    env = {
        **SLURM,
        "SLURM_STEP_NODELIST": "node[0-100000000]",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    }
    assert discover(env).master_addr == "node0"
    assert list(itertools.islice(expand_nodelist("a[8-9]-[1-100000000],b"), 3)) == ["a8-1", "a8-2", "a8-3"]


@pytest.mark.parametrize(
    "nodelist",
    [
        "node[01-04",
        "node]1[",
        "node[a-b]",
        "node[4-2]",
        "a,,b",
        "n[[1]]",
        "n[1-]",
        "n[1-" + "9" * 19 + "]",
        "n[" + "1" * 5000 + "]",
    ],
)
def test_bad_nodelist_raises_naming_the_variable(nodelist):
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST=.*not a Slurm hostlist"):
        list(expand_nodelist(nodelist, name="SLURM_JOB_NODELIST"))


@pytest.mark.parametrize(
    "value, counts",
    [
        ("8", [8]),
        ("4(x2)", [4, 4]),
        ("4(x2),3", [4, 4, 3]),
        ("2,1,2", [2, 1, 2]),
        (" 3(x3) ", [3, 3, 3]),
    ],
)
def test_tasks_per_node_forms(value, counts):
    assert parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "x", "4(2)", "0", "4(x0)", "4(x2", "-1"])
def test_bad_tasks_per_node_raises(value):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE="):
        parse_tasks_per_node(value)


SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_JOB_ID": "123042",
    "SLURM_NODEID": "1",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
}
PMI = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "1234",
}


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, ("none", 0, 1, 0, 1, None, None)),
        (TORCHRUN, ("torchrun", 1, 2, 1, 2, "h", 1234)),
        ({**SLURM, **TORCHRUN}, ("torchrun", 1, 2, 1, 2, "h", 1234)),  # torchrun inside an allocation wins
        (SLURM, ("Slurm", 5, 8, 1, 4, "node01", 15000 + 123042 % 20000)),
        (
            {
                **SLURM,
                "SLURM_STEP_NODELIST": "gpu[7-8]",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_PROCID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                "SLURM_LOCALID": "0",
            },
            ("Slurm", 1, 2, 0, 1, "gpu7", 18042),
        ),
        (
            {**SLURM, "SLURM_TASKS_PER_NODE": "4,3", "SLURM_NTASKS": "7", "SLURM_NODEID": "1"},
            ("Slurm", 5, 7, 1, 3, "node01", 18042),
        ),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "", "SLURM_NTASKS_PER_NODE": "4"}, ("Slurm", 5, 8, 1, 4, "node01", 18042)),
        ({**SLURM, "MASTER_ADDR": "login3", "MASTER_PORT": "2999"}, ("Slurm", 5, 8, 1, 4, "login3", 2999)),
        ({**SLURM, **OMPI}, ("OpenMPI", 3, 6, 0, 3, "node01", 18042)),  # mpirun in an allocation: Slurm's host
        (OMPI, ("OpenMPI", 3, 6, 0, 3, None, None)),
        ({**OMPI, "MASTER_ADDR": "10.0.0.1"}, ("OpenMPI", 3, 6, 0, 3, "10.0.0.1", 29500)),
        ({**OMPI, **PMI, "MASTER_ADDR": "m"}, ("OpenMPI", 3, 6, 0, 3, "m", 29500)),
        ({**PMI, **SLURM}, ("MPICH/PMI", 2, 4, 0, 2, "node01", 18042)),
        (
            {"PMIX_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "7"},
            ("MPICH/PMI", 1, 2, 1, 2, "m", 7),
        ),
        ({"PMIX_RANK": "1", **SLURM}, ("Slurm", 5, 8, 1, 4, "node01", 18042)),  # PMIx without a size: Slurm's
        ({"WORLD_SIZE": "1"}, ("torchrun", 0, 1, 0, 1, None, None)),
        ({"LOCAL_RANK": "3"}, ("torchrun", 0, 1, 3, 1, None, None)),  # --local_rank=3 alone: kept as before
        ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": ""}, ("OpenMPI", 3, 6, 0, 3, None, None)),  # rank % local size
    ],
)
def test_discovery_precedence_and_overrides(env, want):
    info = discover(env)
    assert (
        info.source,
        info.rank,
        info.world_size,
        info.local_rank,
        info.local_world_size,
        info.master_addr,
        info.master_port,
    ) == want
    if want[0] != "none":
        assert info.read and all(env[k] == v for k, v in info.read.items())


def test_arguments_win_over_variables_and_describe_says_where_from():
    info = discover({**SLURM, "MASTER_ADDR": "x"}, master_addr="head", master_port=4321)
    assert (info.master_addr, info.master_port, info.master_from) == ("head", 4321, "master_addr=, master_port=")
    for bad in ({"master_addr": ""}, {"master_port": 0}, {"master_port": 70000}, {"master_port": "80"}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            discover(SLURM, **bad)
    text = discover(SLURM).describe()
    assert text.startswith("rank 5 of 8 (local 1 of 4) from Slurm: SLURM_PROCID=5 SLURM_NTASKS=8 SLURM_LOCALID=1")
    assert "master node01:18042 (first host of SLURM_JOB_NODELIST, port from SLURM_JOB_ID)" in text
    assert "batch script itself" in text  # no SLURM_STEP_NUM_TASKS: warned
    assert "set MASTER_ADDR" in discover(OMPI).describe()
    out: dict[str, str] = {}
    export(discover(SLURM), out)
    assert out == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "18042",
    }


@pytest.mark.parametrize(
    "env, needle",
    [
        ({**SLURM, "SLURM_PROCID": "two"}, r"SLURM_PROCID='two' \(from Slurm\) is not an integer"),
        ({**SLURM, "SLURM_PROCID": "8"}, r"SLURM_PROCID=8 \(from Slurm\) is not below SLURM_NTASKS=8"),
        ({**SLURM, "SLURM_LOCALID": "4"}, r"SLURM_LOCALID=4 \(from Slurm\) is not below SLURM_TASKS_PER_NODE=4"),
        ({**SLURM, "SLURM_NTASKS": "0"}, r"SLURM_NTASKS='0' \(from Slurm\) must be >= 1"),
        ({**SLURM, "SLURM_JOB_ID": "12a"}, r"SLURM_JOB_ID='12a' \(from Slurm\) is not an integer"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "4,3", "SLURM_NODEID": ""}, r"SLURM_TASKS_PER_NODE='4,3'.*SLURM_NODEID"),
        ({**SLURM, "SLURM_JOB_NODELIST": "node[1-"}, r"SLURM_JOB_NODELIST='node\[1-' is not a Slurm hostlist"),
        ({"SLURM_PROCID": "0"}, "none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": ""}, r"SLURM_JOB_NODELIST='node\[01-02\]' names several nodes but none of"),
        (
            {**OMPI, "OMPI_COMM_WORLD_RANK": "6"},
            r"OMPI_COMM_WORLD_RANK=6 \(from OpenMPI\) is not below OMPI_COMM_WORLD_SIZE",
        ),
        (
            {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "7"},
            r"OMPI_COMM_WORLD_LOCAL_SIZE=7 \(from OpenMPI\) must be in \[1, ",
        ),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_RANK is set \\(OpenMPI\\) but OMPI_COMM_WORLD_SIZE is not"),
        ({**PMI, "PMI_SIZE": "1.5"}, r"PMI_SIZE='1.5' \(from MPICH/PMI\) is not an integer"),
        ({"PMIX_RANK": "0"}, "PMIX_RANK='0' is set .* but no world size"),
        ({"PMI_RANK": "1"}, r"PMI_RANK='1' is set \(PMI\) but no world size is \(PMI_SIZE"),  # was "PMIX_RANK=None"
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "7"},
            r"LOCAL_RANK=7 \(from torchrun\) is not below WORLD_SIZE=2",
        ),
        (
            {**PMI, "MPI_LOCALNRANKS": "", "MPI_LOCALRANKID": "4"},
            r"MPI_LOCALRANKID=4 \(from MPICH/PMI\) is not below PMI_SIZE",
        ),
        ({**SLURM, "SLURM_STEP_NODELIST": "n[0-" + "9" * 19 + "]"}, r"SLURM_STEP_NODELIST=.*more than 18 digits"),
        ({**TORCHRUN, "RANK": "2"}, r"RANK=2 \(from torchrun\) is not below WORLD_SIZE=2"),
        ({**TORCHRUN, "RANK": "-1"}, r"RANK='-1' \(from torchrun\) must be >= 0"),
        (
            {**OMPI, "MASTER_ADDR": "m", "MASTER_PORT": "http"},
            r"MASTER_PORT='http' \(from the user\) is not an integer",
        ),
    ],
)
def test_bad_values_raise_naming_the_variable_and_launcher(env, needle):
    with pytest.raises(ValueError, match=needle):
        discover(env)


def _clean_env(**launch: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN and not k.startswith(_LAUNCH_PREFIXES)}
    return {**env, "OMP_NUM_THREADS": "1", **launch}


def test_mpi_without_master_addr_fails_at_init_naming_master_addr(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group from an earlier test is live in this process")
    import llmpar

    for k in list(os.environ):
        if k in _TORCHRUN or k.startswith(_LAUNCH_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in OMPI.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(
        RuntimeError, match=r"WORLD_SIZE=6 \(from OpenMPI\) but MASTER_ADDR is not set: set MASTER_ADDR"
    ):
        llmpar.init_distributed(backend="gloo", timeout_s=5)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE='x' \\(from OpenMPI\\)"):
        llmpar.init_distributed(backend="gloo", timeout_s=5)
    assert not dist.is_initialized()


_RANK_SCRIPT = """
import json, os, random, torch
import llmpar
from llmpar.distributed import all_reduce
env = llmpar.init_distributed(backend="gloo", timeout_s=20)
mine = random.Random(1000 + env.rank).uniform(-1.0, 1.0)
t = torch.tensor([mine], dtype=torch.float64)
all_reduce(t, torch.distributed.group.WORLD)
print(json.dumps({"rank": env.rank, "world": env.world_size, "local": env.local_rank,
                  "local_world": env.local_world_size, "mine": mine, "sum": t.item(),
                  "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                        "MASTER_ADDR", "MASTER_PORT")}}))
"""


def _slurm_port() -> tuple[int, int]:
    """A job id whose derived port (15000 + id % 20000) is free now, and that port."""
    for _ in range(200):
        port = random.randrange(15000, 35000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port, 20000 * random.randrange(1, 50) + port - 15000
    pytest.skip("no free port in [15000, 35000)")


def test_processes_with_only_slurm_or_only_openmpi_variables_join_one_world():
    """Two ranks from Slurm's variables (master = first host of SLURM_JOB_NODELIST, port from SLURM_JOB_ID) and
    two from OpenMPI's (MASTER_ADDR / MASTER_PORT given) each meet as one world of 2 and all-reduce a float64."""
    from multirank import free_port

    port, job = _slurm_port()
    launches = {}
    for r in range(2):
        launches["Slurm", r] = _clean_env(
            SLURM_PROCID=str(r),
            SLURM_NTASKS="2",
            SLURM_STEP_NUM_TASKS="2",
            SLURM_LOCALID=str(r),
            SLURM_TASKS_PER_NODE="2",
            SLURM_JOB_NODELIST="127.0.0.[1-1]",
            SLURM_JOB_ID=str(job),
            SLURM_NODEID="0",
        )
    ompi_port = str(free_port())
    for r in range(2):
        launches["OpenMPI", r] = _clean_env(
            OMPI_COMM_WORLD_RANK=str(r),
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_LOCAL_RANK=str(r),
            OMPI_COMM_WORLD_LOCAL_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=ompi_port,
        )
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for key, env in launches.items()
    }
    results = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, f"{key}: {err[-2000:]}"
            results[key] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for source, want_port in (("Slurm", port), ("OpenMPI", int(ompi_port))):
        a, b = results[source, 0], results[source, 1]
        total = a["mine"] + b["mine"]
        for r, got in enumerate((a, b)):
            assert (got["rank"], got["world"], got["local"], got["local_world"]) == (r, 2, r, 2), (source, got)
            assert got["sum"] == total, (source, got)
            assert got["env"] == {
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(want_port),
            }, (source, got)


def test_env_report_shows_the_launcher_and_where_from(monkeypatch):
    from llmpar import env_report

    for k in list(os.environ):
        if k in _TORCHRUN or k.startswith(_LAUNCH_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    data = env_report.collect()
    assert (data["launch"]["source"], data["launch"]["rank"], data["launch"]["master_port"]) == ("Slurm", 5, 18042)
    assert "launcher                     rank 5 of 8 (local 1 of 4) from Slurm: SLURM_PROCID=5" in (
        env_report.format_report(data)
    )
    monkeypatch.setenv("SLURM_PROCID", "five")
    data["launch"] = env_report._launch()
    assert "launcher                     error: environment variable SLURM_PROCID='five' (from Slurm)" in (
        env_report.format_report(data)
    )


@pytest.mark.parametrize("through", ["Slurm", "llmpar launch"])
def test_port_clash_says_the_port_came_from_the_job_id(monkeypatch, through):
    """Two jobs whose ids are equal mod 20000 on one node derive one port: rank 0's bind fails, and the error says
    the port came from SLURM_JOB_ID and how to set MASTER_PORT (read from Slurm's variables directly, or from the
    torchrun variables llmpar launch's per-task wrapper wrote for them), not a bare EADDRINUSE."""
    if dist.is_initialized():
        pytest.skip("a process group from an earlier test is live in this process")
    import llmpar
    from llmpar.launch.rank import rank_environment

    for k in list(os.environ):
        if k.startswith(_LAUNCH_PREFIXES) or k.startswith("LLMPAR_MASTER"):
            monkeypatch.delenv(k)
    for k in _TORCHRUN:  # init_distributed writes them: undone at teardown
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    with socket.socket() as held:  # the other job's store
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port, job = _slurm_port()
        held.bind(("", port))
        held.listen()
        slurm = {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_LOCALID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": str(job + 20000),
        }
        env = slurm if through == "Slurm" else rank_environment(slurm)[0]
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(RuntimeError) as caught:
            llmpar.init_distributed(backend="gloo", timeout_s=10)
    text = str(caught.value)
    assert f"rendezvous port {port} is already in use on 127.0.0.1:{port}" in text, text
    assert f"the port came from SLURM_JOB_ID={job + 20000} (15000 + job id % 20000)" in text, text
    assert "set MASTER_PORT to a free port" in text and "--master_port" in text, text
    assert "EADDRINUSE" in str(caught.value.__cause__)
    assert not dist.is_initialized()
