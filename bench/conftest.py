"""pytest set-up for the op micro-benchmark suites in bench/suites/ (pytest-benchmark).

    pytest bench/ --benchmark-only                                    # CPU, and CUDA when present (~1 min on CPU)
    pytest bench/ --benchmark-only --benchmark-save=cpu               # saved under bench/results/pytest-benchmark/
    pytest bench/ --benchmark-only --benchmark-compare                # against the newest saved run of this machine
    pytest bench/ --benchmark-disable                                 # every case once, untimed (a smoke test)

``pytest`` alone (testpaths = tests) and ``make test`` never collect these. What this file sets, unless the command
line (or PYTEST_ADDOPTS) sets it:
- ``--benchmark-max-time=0.2`` (pytest-benchmark's 1 s per case would make the CPU suite take minutes; pass
  ``--benchmark-max-time=1`` for steadier medians) and ``--benchmark-storage=bench/results/pytest-benchmark`` (so
  ``--benchmark-save`` / ``--benchmark-compare`` use the committed folder from any working directory);
- ``LLMPAR_AUTOTUNE_CONFIGS=2`` (Triton autotuning bounded, as in bench/gpu_check.sh); TRITON_INTERPRET is never
  set: Triton cases run on CUDA only (the CPU interpreter is far too slow to time);
- import paths: bench/ (the harness, plot_results) and tests/ (the references the benchmarks take as baselines);
- ``LLMPAR_BENCH_THREADS=n``: torch CPU threads for the run (default: torch's). On a machine shared with other work,
  1 thread gives far steadier medians (a descheduled worker thread stalls every parallel op); recorded in the JSON.
Saved JSON carries no host name and no absolute machine paths, and gains the command and llmpar's machine record
(torch / triton / llmpar versions, GPUs, git commit, torch threads: ``harness.machine_info``) under ``"llmpar"``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
STORAGE = BENCH / "results" / "pytest-benchmark"
DEFAULTS = {  # option dest: (command-line flag, value when not given)
    "benchmark_max_time": ("--benchmark-max-time", "0.2"),
    "benchmark_storage": ("--benchmark-storage", str(STORAGE)),
}

for path in (ROOT / "tests", BENCH):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("LLMPAR_AUTOTUNE_CONFIGS", "2")
if os.environ.get("LLMPAR_BENCH_THREADS"):
    import torch

    torch.set_num_threads(int(os.environ["LLMPAR_BENCH_THREADS"]))


def _given(config: pytest.Config, flag: str) -> bool:
    args = list(config.invocation_params.args) + shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))
    return any(a == flag or a.startswith(flag + "=") for a in map(str, args))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Our defaults, set before pytest-benchmark reads its options (its own pytest_configure runs after this)."""
    for dest, (flag, value) in DEFAULTS.items():
        if hasattr(config.option, dest) and not _given(config, flag):
            setattr(config.option, dest, value)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["node"] = ""  # the host name says nothing about the numbers


def command(config: pytest.Config) -> str:
    """The pytest command that ran, with LLMPAR_BENCH_THREADS when set (paths made portable by the caller)."""
    threads = os.environ.get("LLMPAR_BENCH_THREADS")
    env = f"LLMPAR_BENCH_THREADS={threads} " if threads else ""
    return env + "pytest " + " ".join(shlex.quote(str(a)) for a in config.invocation_params.args)


def pytest_benchmark_update_json(config: pytest.Config, benchmarks: list, output_json: dict) -> None:
    """The command and llmpar's machine record (versions, GPUs, commit, threads) added at the top level (kept out of
    ``machine_info``, which --benchmark-compare checks for equality: the commit changes every run); no absolute
    machine paths in what is saved (``harness.portable``)."""
    import torch

    from harness import machine_info, portable

    output_json["command"] = command(config)
    output_json["llmpar"] = {**machine_info(), "torch_threads": torch.get_num_threads()}
    output_json.update(portable(dict(output_json)))


@pytest.fixture(scope="session")
def world1_group():
    """A gloo process group of one rank (the tensor-parallel ops take a group; at tp=1 they never communicate)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()
