"""bench/gpu_check.sh without a GPU: the plan fits the lease, the outputs land in $OUT after every step and after a
kill, the deadline skips and lists steps, and summary.md carries steps, tests, figures, versions, device and date."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check_summary  # noqa: E402

STEPS = (
    "env",
    "install",
    "build_ext",
    "load_ext",
    "tests_gpu_bf16",
    "tests_gpu_other",
    "tests_optim_cuda",
    "train_bf16",
    "zero3_nccl",
    "bench_optim",
    "bench_gemm",
    "bench_bucket",
    "bench_grouped_mm",
)
WHEELS = ROOT / "bench" / "gpu_wheelhouse.sh"


def _run(args, out: Path, **env):
    full = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _start(args, out: Path, **env) -> subprocess.Popen:
    """:func:`_run` started in the background (``_finish`` waits for it)."""
    full = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}
    pipe = subprocess.PIPE
    return subprocess.Popen(["bash", str(SCRIPT), *args], env=full, stdout=pipe, stderr=pipe, text=True, cwd=ROOT)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def env_runs(tmp_path_factory):
    """The whole script's runs of the tests below, started together by the first that asks (each is seconds of
    Python starting; every run has its own $OUT and work folder): {name: (out folder, process)}."""
    root = tmp_path_factory.mktemp("gpu_check_runs")
    wheelhouse = _fake_wheelhouse(root / "wh")
    plan = {
        "only_env": (["--only", "env"], root / "only_env", {}),
        "deadline": ([], root / "deadline", {"GPU_CHECK_DEADLINE": "0"}),
        "wheelhouse": (
            ["--only", "env"],
            root / "wheelhouse",
            {"GPU_CHECK_WHEELHOUSE": str(wheelhouse), "GPU_CHECK_WORKERS": "3"},
        ),
        "bare": (["--only", "env"], root / "bare", {"GPU_CHECK_WHEELHOUSE": str(root / "nothing")}),
    }
    for _, out, _ in plan.values():
        out.mkdir()
    runs = {name: (out, _start(args, out, **env)) for name, (args, out, env) in plan.items()}
    yield runs
    for _, proc in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _tar_names(out: Path) -> set[str]:
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        return set(tar.getnames())


def _fake_wheelhouse(folder: Path) -> Path:
    """A wheelhouse holding one wheel: a stand-in pytest_xdist whose module says where it came from."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "pytest_xdist-3.8.0-py3-none-any.whl"
    info = "pytest_xdist-3.8.0.dist-info"
    files = {
        "xdist/__init__.py": '__version__ = "3.8.0-from-the-wheelhouse"\n',
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: pytest-xdist\nVersion: 3.8.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return folder


def _no_xdist_python() -> bool:
    return subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True).returncode != 0


def test_plan_lists_every_step_within_eight_minutes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _run(["--plan"], out)
    assert proc.returncode == 0, proc.stderr
    budgets = dict(re.findall(r"^  (\w+)\s+(\d+)s  ", proc.stdout, flags=re.M))
    assert tuple(budgets) == STEPS
    deadline = int(re.search(r"global deadline (\d+)s", proc.stdout).group(1))
    assert deadline <= 480 and sum(map(int, budgets.values())) <= deadline
    assert int(budgets["build_ext"]) >= 40 and int(budgets["tests_gpu_other"]) >= 70  # measured ~30 s; est. 35-55 s
    # bench_gemm: ~26 Triton variants, ~30 autotuned keys, 32 graph captures (65-85 s); env: a cold torch import
    assert int(budgets["bench_gemm"]) >= 85 and int(budgets["env"]) >= 25
    assert re.search(r"^  CUDA_HOME=\S+ \(", proc.stdout, flags=re.M), proc.stdout
    assert f"output: {out}/summary.md" in proc.stdout
    assert "tests 1, benchmarks 2" in proc.stdout and "MAX_JOBS=16" in proc.stdout
    timeouts = [int(t) for t in re.search(r"per-test timeout (\d+)s / (\d+)s / (\d+)s", proc.stdout).groups()]
    assert [
        t < int(budgets[n]) for t, n in zip(timeouts, ("tests_gpu_bf16", "tests_gpu_other", "tests_optim_cuda"))
    ] == [True] * 3
    route = re.search(r"^  pytest-xdist: (.*)$", proc.stdout, flags=re.M).group(1)
    if _no_xdist_python():
        for wheelhouse, words in ((_fake_wheelhouse(tmp_path / "wh"), "from "), (tmp_path / "none", "MISSING")):
            plan = _run(["--plan"], out, GPU_CHECK_WHEELHOUSE=str(wheelhouse)).stdout
            assert words in re.search(r"^  pytest-xdist: (.*)$", plan, flags=re.M).group(1), plan
        assert "bash bench/gpu_wheelhouse.sh" in plan and "serially" in plan
    else:
        assert route.startswith("in ")
    assert list(out.iterdir()) == [], "--plan must run nothing"
    text = SCRIPT.read_text()
    assert "bench_zero" not in text and "gloo" not in text, "no CPU / gloo benchmarks in the GPU check"
    assert re.search(r'PY="\$\{PYTHON:-python3\}"', text)


def test_only_env_writes_summary_and_tarball_to_out(env_runs):
    tmp_path, proc = env_runs["only_env"]
    proc = _finish(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.tar.gz", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| env | ok |" in summary and "| bench_gemm | not selected |" in summary
    for field in ("- date: ", "- device: ", "- versions: python ", "torch ", "triton "):
        assert field in summary
    assert re.search(r"CUDA_HOME=\S+ \(", summary), summary  # the toolkit build_ext would use
    assert {"logs/env.log", "steps.tsv", "summary.md", "env.json"} <= _tar_names(tmp_path)


def test_deadline_skips_and_lists_the_remaining_steps(env_runs):
    tmp_path, proc = env_runs["deadline"]
    proc = _finish(proc)
    assert proc.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert f"Skipped at the deadline: {', '.join(STEPS)}." in summary
    assert summary.count("SKIPPED (deadline)") == len(STEPS)


def test_unknown_step_and_argument_are_errors(tmp_path):
    assert _run(["--only", "env,nope"], tmp_path).returncode == 2
    assert _run(["--fast"], tmp_path).returncode == 2


def test_a_killed_run_still_leaves_its_outputs(tmp_path):
    """A step that hangs, then SIGTERM to the script: the step is marked KILLED and both files are written."""
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho hanging\nexec sleep 60\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake)}
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--only", "install"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    summary, deadline = out / "summary.md", time.time() + 30
    while time.time() < deadline and not (summary.exists() and "| install | running |" in summary.read_text()):
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    text = summary.read_text()
    assert "| install | KILLED |" in text, text
    assert "logs/install.log" in _tar_names(out)


@pytest.mark.skipif(not _no_xdist_python(), reason="the test python has xdist: nothing to install")
def test_env_step_installs_missing_wheels_offline(env_runs):
    """The env step installs what python lacks from the wheelhouse (offline) and the test steps then see it: the
    summary names the xdist that came from the wheelhouse and the workers the tests would use."""
    out, proc = env_runs["wheelhouse"]
    proc = _finish(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    assert "tests: pytest-xdist, 3 workers (pytest-xdist 3.8.0-from-the-wheelhouse)" in summary, summary
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        log = tar.extractfile("logs/env.log").read().decode()
    assert "installed offline into" in log and "pytest-xdist" in log and "execnet: MISSING" in log
    bare_out, bare = env_runs["bare"]
    bare = _finish(bare)
    assert "tests: SERIAL: no pytest-xdist" in (bare_out / "summary.md").read_text(), bare.stdout


def test_wheelhouse_script_arguments(tmp_path):
    assert subprocess.run(["bash", str(WHEELS), "--bogus"], capture_output=True).returncode == 2
    proc = subprocess.run(
        ["bash", str(WHEELS), "--status"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELHOUSE": str(tmp_path)},
    )
    assert proc.returncode == 0 and "pytest-xdist==3.8.0" in proc.stdout and "ninja==" in proc.stdout


def test_killed_test_step_still_counts_what_passed(tmp_path):
    log = tmp_path / "t.log"
    log.write_text(
        "[gw3] [ 45%] PASSED tests/test_a.py::test_x[bf16-5]\n"
        "[gw1] [ 46%] FAILED tests/test_a.py::test_y[bf16]\n"
        "tests/test_b.py::test_z PASSED                    [ 50%]\n"
        "tests/test_b.py::test_w SKIPPED (no triton)       [ 51%]\n"
    )
    assert gpu_check_summary._pytest_line(log) == (
        "killed before the end; finished so far (pytest -v lines): 2 passed, 1 failed, 1 skipped; "
        "failed: tests/test_a.py::test_y[bf16]"
    )
    log.write_text(
        log.read_text() + "FAILED tests/test_a.py::test_y[bf16] - AssertionError\n"
        "===== 1 failed, 2 passed, 1 skipped in 9.10s =====\n"
    )
    assert (
        gpu_check_summary._pytest_line(log) == "1 failed, 2 passed, 1 skipped in 9.10s; failed: "
        "tests/test_a.py::test_y[bf16]"
    )


def test_summary_renders_tests_and_figures(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "steps.tsv").write_text(
        "tests_gpu_bf16\tok\t31\t50\tpytest bf16\n"
        "train_bf16\tok\t20\t35\ttrain\nbench_gemm\tSKIPPED (deadline)\t\t70\tgemm\n"
    )
    (tmp_path / "logs" / "tests_gpu_bf16.log").write_text(
        "....\n  tests/test_ops_gemm_ext.py:250: UserWarning: linear_lt act=1: cuBLASLt's GELU epilogue is 0.000412 "
        "off tanh-GELU (torch.float32 bound 4.1e-06): it evaluates tanh approximately\n"
        "===== 41 passed, 3 skipped in 29.80s =====\n"
    )
    (tmp_path / "results" / "train.json").write_text(
        json.dumps(
            {
                "losses": [5.5, 4.0, 3.1],
                "tokens_per_s": 123456.0,
                "n_params": 478720,
                "dtype": "bfloat16",
                "engine": "Engine",
                "zero_stage": 2,
                "mem_mb": [812.0],
                "mem_kind": "CUDA peak",
                "wall_s": 9.5,
            }
        )
    )
    (tmp_path / "results" / "optim_cuda.md").write_text("# optim_cuda\n\n| name | speedup |\n|---|---|\n| a | 2 |\n")
    gpu_check_summary.record_env(tmp_path, "deadline 460s")
    text = gpu_check_summary.render(tmp_path)
    assert "- tests_gpu_bf16: 41 passed, 3 skipped in 29.80s" in text
    assert "- finding: cuBLASLt's GELU epilogue is 0.000412 off tanh-GELU (torch.float32 bound 4.1e-06)" in text
    assert (
        "- train: demo GPT (0.48M params, bfloat16, Engine, ZeRO-2): 123,456 tokens/s; loss 5.500 -> 3.100 "
        "over 3 steps" in text
    )
    assert "- build: nvcc " in text and "ninja unknown (build_ext did not run)" in text
    assert "### optim_cuda" in text and "| a | 2 |" in text
    assert "Skipped at the deadline: bench_gemm." in text
    assert "- settings: deadline 460s" in text


def test_dtype_groups_partition_the_gpu_tests():
    """`--dtype-group bf16` and `other` (tests/dtype_select.py) split the GPU selection exactly, bf16 cases first."""
    files = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]
    assert files

    def start(*extra):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "--collect-only",
                "-p",
                "no:cacheprovider",
                "-p",
                "dtype_select",
                "-m",
                "gpu",
                *extra,
                *files,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT / "tests",
        )

    def collected(proc):
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, stdout[-3000:] + stderr[-2000:]
        return {ln for ln in stdout.splitlines() if "::" in ln}

    # the three collections run side by side (each is mostly Python and torch starting)
    procs = [start(), start("--dtype-group", "bf16"), start("--dtype-group", "other")]
    everything, bf16, other = (collected(p) for p in procs)
    assert bf16 and other and not bf16 & other and bf16 | other == everything
    assert all("float32" not in t for t in bf16)


def _fake_toolkit(root: Path) -> Path:
    """A CUDA toolkit layout (header, runtime library) whose bin/nvcc answers --dryrun with its TOP, as nvcc does."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "lib64").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    (root / "lib64" / "libcudart.so.13").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "#$ _HERE_={root}/bin" >&2\necho "#$ TOP={root}/bin/.." >&2\n')
    nvcc.chmod(0o755)
    return root


@pytest.mark.parametrize("how", ["wrapper script", "link", "environment", "none"])
def test_plan_resolves_the_real_cuda_home(tmp_path, how):
    """CUDA_HOME is the real toolkit whatever nvcc on PATH is (a wrapper script elsewhere, a link out of the
    toolkit), a valid CUDA_HOME from the environment is kept, an invalid one is not; --plan prints it."""
    kit = _fake_toolkit(tmp_path / "cuda-13.0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if how == "wrapper script":
        (bin_dir / "nvcc").write_text(f'#!/bin/sh\nexec {kit}/bin/nvcc "$@"\n')
        (bin_dir / "nvcc").chmod(0o755)
    elif how == "link":
        (bin_dir / "nvcc").symlink_to(kit / "bin" / "nvcc")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CUDA_HOME": str(kit) if how == "environment" else str(tmp_path)}
    out = tmp_path / "out"
    out.mkdir()
    proc = _run(["--plan"], out, **env)
    assert proc.returncode == 0, proc.stderr
    line = re.search(r"^  CUDA_HOME=(\S+) \((.*)\)$", proc.stdout, flags=re.M)
    assert line, proc.stdout
    if how == "none":  # nvcc nowhere, the environment's CUDA_HOME not a toolkit: said, not guessed
        real = Path("/usr/local/cuda")
        if (real / "include" / "cuda_runtime.h").exists():
            assert line.group(1) == str(real.resolve())
        else:
            assert line.group(1) == "NONE" and "build_ext will fail" in line.group(2)
        assert "lacks include/cuda_runtime.h" in line.group(2)
    else:
        assert line.group(1) == str(kit), line.group(0)


def test_env_record_is_written_before_the_slow_probes(tmp_path, monkeypatch):
    """A first env.json (date, settings) exists before the probes run: an env step killed while importing torch or
    asking nvcc still leaves them for summary.md."""

    def stuck() -> str:
        raise KeyboardInterrupt  # stands in for the step's timeout killing it here

    monkeypatch.setattr(gpu_check_summary, "_cuda_toolkit", stuck)
    with pytest.raises(KeyboardInterrupt):
        gpu_check_summary.record_env(tmp_path, "deadline 470s, CUDA_HOME=/opt/cuda (from the environment)")
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["settings"].endswith("CUDA_HOME=/opt/cuda (from the environment)") and env["date"]
    assert "- settings: deadline 470s, CUDA_HOME=/opt/cuda" in gpu_check_summary.render(tmp_path)
