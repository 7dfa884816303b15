"""bench/harness.py: stats of repeats, side-by-side ratios in the right direction, the multi-rank max, and
well-formed JSON / markdown results (asserting orderings, never absolute timings); the plots (bench/plot_results.py),
no absolute machine paths in any committed result, and the pytest-benchmark suites of bench/suites/ (run once,
saved, compared, rendered by bench/benchmark_table.py)."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from harness import Timing, compare, markdown_table, measure, measure_distributed, write_results  # noqa: E402
from multirank import run_ranks  # noqa: E402


def _fast():
    time.sleep(0.001)


def _slow():
    time.sleep(0.006)


def test_measure_statistics():
    calls = []
    t = measure(lambda: calls.append(1), warmup=2, repeats=7, number=3, name="noop")
    assert len(calls) == 2 + 7 * 3
    assert len(t.times_s) == 7 and t.min_s <= t.median_s and t.iqr_s >= 0
    row = t.row()
    assert row["name"] == "noop" and row["repeats"] == 7
    fixed = Timing(times_s=[1.0, 2.0, 3.0, 4.0, 100.0])
    assert fixed.median_s == 3.0 and fixed.min_s == 1.0 and fixed.iqr_s == pytest.approx(2.0)


def test_compare_orders_and_ratios():
    order = []
    cases = {"slow": lambda: (order.append("slow"), _slow()), "fast": lambda: (order.append("fast"), _fast())}
    cmp = compare(cases, baseline="slow", warmup=1, repeats=5)
    assert cmp.fastest() == "fast"
    assert cmp.ratio("fast") < 1 < cmp.speedup("fast") and cmp.speedup("slow") == pytest.approx(1.0)
    timed = order[2:]  # after one warm-up call each
    assert timed[0::2].count("slow") in (2, 3)  # rounds start with alternating cases: interleaved, not blocked
    rows = cmp.rows(size=8)
    assert [r["name"] for r in rows] == ["slow", "fast"] and rows[0]["size"] == 8 and rows[0]["baseline"] is True
    assert cmp.table().startswith("| name | median_ms |")


def test_argument_errors():
    with pytest.raises(ValueError, match="baseline='nope'"):
        compare({"a": _fast}, baseline="nope")
    with pytest.raises(ValueError, match="repeats=0"):
        measure(_fast, repeats=0)
    with pytest.raises(ValueError, match="do_bench"):
        measure(_fast, timer="do_bench", device="cpu")


def test_write_results_json_and_markdown(tmp_path):
    rows = [{"size": 4, "name": "a", "median_ms": 1.5, "ok": True}, {"size": 8, "name": "b|c", "median_ms": 3.25}]
    paths = write_results(
        "unit_case", rows, meta={"dtype": "fp32"}, out_dir=tmp_path, curve={"x": "size", "y": ["median_ms"]}
    )
    data = json.loads(paths["json"].read_text())
    assert data["name"] == "unit_case" and data["rows"] == rows and data["meta"] == {"dtype": "fp32"}
    assert data["command"].startswith("python ") and data["date"]
    for key in ("cpu", "cores", "torch", "triton", "gpus"):
        assert key in data["machine"]
    md = paths["md"].read_text()
    assert md.startswith("# unit_case") and "- dtype: fp32" in md and "torch " in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table[0] == "| size | name | median_ms | ok |" and len(table) == 4
    assert all(len(re.split(r"(?<!\\)\|", line)) == 6 for line in table)  # 4 cells, escaped '|' kept inside
    assert ("png" in paths) == paths.get("png", tmp_path / "none").exists()  # a plot only where matplotlib is
    with pytest.raises(ValueError, match="name="):
        write_results("a/b", rows, out_dir=tmp_path)


def test_markdown_table_empty():
    assert markdown_table([]) == "(no rows)\n"


class _FakeGpu:
    """A GPU timeline for the harness's CUDA logic on CPU: a call costs ``launch`` seconds of host time, then ``gpu``
    seconds on the device once the launch has reached it; an event records when the device reaches it. A graph
    replay is one launch for all its calls. ``fail`` makes capture raise (an op that cannot be captured)."""

    def __init__(self, launch: float, gpu: float, fail: bool = False) -> None:
        self.launch, self.gpu, self.fail = launch, gpu, fail
        self.host = self.free = 0.0
        self.capturing, self.captured, self.replays, self.calls = False, 0, 0, 0

    def call(self) -> None:
        if self.capturing:
            if self.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.captured += 1
            return
        self.calls += 1
        self._run(self.gpu)

    def sync(self, device=None) -> None:
        self.host = max(self.host, self.free)

    def _run(self, work: float) -> None:
        self.host += self.launch
        self.free = max(self.free, self.host) + work

    def events(self):
        gpu = self

        class Event:
            def record(self) -> None:
                self.t = max(gpu.host, gpu.free)

            def synchronize(self) -> None:
                gpu.host = max(gpu.host, self.t)

            def elapsed_time(self, end) -> float:
                return (end.t - self.t) * 1e3

        return Event(), Event()

    def capture(self, fn, number, device):
        self.capturing = True
        try:
            for _ in range(number):
                fn()
        finally:
            self.capturing = False
        n = self.captured

        def replay() -> None:
            self.replays += 1
            self._run(n * self.gpu)

        return replay


def _fake_gpu(monkeypatch, **kw) -> _FakeGpu:
    import harness

    gpu = _FakeGpu(**kw)
    monkeypatch.setattr(harness, "_events", gpu.events)
    monkeypatch.setattr(harness, "_capture", gpu.capture)
    monkeypatch.setattr(harness, "_sync", gpu.sync)
    return gpu


def test_cuda_samples_hold_enough_back_to_back_calls(monkeypatch):
    """One call between events counts the launch path too (100 + 200 us for 200 us of work); number=None packs
    ceil(2 ms / one call) calls into each sample and reports per call: the launch is paid once per sample."""
    launch, work = 100e-6, 200e-6
    gpu = _fake_gpu(monkeypatch, launch=launch, gpu=work)
    one = measure(gpu.call, warmup=1, repeats=5, device="cuda", number=1)
    assert one.median_s == pytest.approx(launch + work) and one.row()["calls"] == 1
    auto = measure(gpu.call, warmup=1, repeats=5, device="cuda")
    n = math.ceil(2e-3 / (launch + work))
    assert auto.number == n == 7 and auto.timer == "cuda events"
    assert auto.median_s == pytest.approx((launch + n * work) / n)
    calls = gpu.calls
    measure(gpu.call, warmup=2, repeats=4, device="cuda", number=3)
    assert gpu.calls - calls == 2 + 4 * 3


def test_cuda_graph_removes_the_launch_path_and_falls_back(monkeypatch):
    """A launch-bound op (150 us launch, 50 us work): back-to-back calls still measure the launch, a graph of them
    measures the work; an op that cannot be captured is timed back to back, and the row says so."""
    launch, work = 150e-6, 50e-6
    gpu = _fake_gpu(monkeypatch, launch=launch, gpu=work)
    cmp = compare({"eager": gpu.call, "graph": gpu.call}, baseline="eager", warmup=1, repeats=4, device="cuda")
    eager = cmp.timings["eager"]
    assert eager.timer == "cuda events" and eager.median_s == pytest.approx(launch + work / eager.number)
    g = measure(gpu.call, warmup=1, repeats=4, device="cuda", graph="auto")
    assert g.timer == "cuda graph" and gpu.replays == 4 and gpu.captured == g.number == 10
    assert g.median_s == pytest.approx((launch + g.number * work) / g.number)
    assert g.median_s < 0.5 * eager.median_s
    failing = _fake_gpu(monkeypatch, launch=launch, gpu=work, fail=True)
    f = measure(failing.call, warmup=1, repeats=3, device="cuda", graph="auto")
    assert f.timer == "cuda events" and "not captured (RuntimeError: operation not permitted" in f.note
    assert f.row()["note"] == f.note and f.median_s == pytest.approx(launch + work / f.number)
    with pytest.raises(RuntimeError, match="capturing"):
        measure(failing.call, warmup=1, repeats=3, device="cuda", graph=True)
    with pytest.raises(ValueError, match="graph='yes'"):
        measure(gpu.call, device="cuda", graph="yes")
    with pytest.raises(ValueError, match="number=0"):
        compare({"a": gpu.call}, baseline="a", device="cuda", number=0)


def test_calls_per_sample():
    from harness import calls_per_sample

    assert calls_per_sample(3e-4) == 7 and calls_per_sample(5e-3) == 1 and calls_per_sample(1e-9) == 100
    assert calls_per_sample(0.0) == 100 and calls_per_sample(1e-3, target_s=1e-2, max_number=4) == 4


def _dist_body():
    delay = 0.02 if dist.get_rank() == 1 else 0.0
    t = measure_distributed(lambda: time.sleep(delay), warmup=1, repeats=3, name="sleepy")
    return t.times_s


def test_measure_distributed_takes_the_slowest_rank():
    r0, r1 = run_ranks(_dist_body, 2, timeout=60)
    assert r0 == r1 and len(r0) == 3
    assert min(r0) >= 0.02


def test_command_line_records_no_machine_paths(monkeypatch, tmp_path):
    import tempfile

    import harness

    root = Path(harness.__file__).resolve().parents[1]
    scratch = Path(tempfile.gettempdir()) / "llmpar-bench-x"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            str(root / "bench" / "bench_zero.py"),
            "--dir",
            str(scratch),
            f"--out={root / 'bench' / 'results'}",
            "--repeats",
            "3",
            "/opt/data.bin",
        ],
    )
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = harness.command_line()
    assert line == (
        'python bench/bench_zero.py --dir "$TMPDIR/llmpar-bench-x" --out=bench/results --repeats 3 /opt/data.bin'
    )
    assert str(root) not in line


# ---------------------------------------------------------------- plots, path hygiene, the pytest-benchmark suites

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TEXT_SUFFIXES = {".json", ".md", ".txt", ".csv", ".log", ".yaml", ".yml"}
# an absolute path on a POSIX machine or a Windows one (not "$TMPDIR/...", "~/...", URLs or repo-relative paths)
ABSOLUTE = re.compile(r"(?<![\w$~.:/])/(?:work|tmp|root|home|Users|mnt|scratch|private|var/folders)/|[A-Za-z]:\\\\")


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _run_pytest(*args: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env_vars}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_write_results_plots_ratio_bars_by_default(tmp_path):
    rows = [
        {"case": "a", "name": "torch", "median_ms": 2.0, "speedup": 1.0, "baseline": True},
        {"case": "a", "name": "llmpar", "median_ms": 1.0, "speedup": 2.0, "baseline": False},
    ]
    paths = write_results("ratios", rows, out_dir=tmp_path)
    data = json.loads(paths["json"].read_text())
    assert "plot" not in data  # no curve given: the default plot, nothing to record
    if _has_matplotlib():
        assert paths["png"].exists() and paths["png"].stat().st_size < 100_000
        assert "![ratios](ratios.png)" in paths["md"].read_text()
    plain = write_results("no_ratios", [{"what": "x", "median_ms": 1.0}], out_dir=tmp_path)
    assert "png" not in plain and not (tmp_path / "no_ratios.png").exists()  # nothing to plot: no empty figure
    curve = {"x": "size", "y": ["median_ms"], "logx": True}
    sized = write_results("sized", [{"size": s, "median_ms": s / 10} for s in (1, 2, 4)], out_dir=tmp_path, curve=curve)
    assert json.loads(sized["json"].read_text())["plot"] == curve  # kept so plot_results can redraw it


def test_plot_results_picks_panels_and_skips_existing(tmp_path):
    import plot_results as pr

    rows = [
        {
            "schedule": "gpipe",
            "pp": 2,
            "step_ms": 3.0,
            "bubble_formula": 0.2,
            "bubble_measured_mean": 0.21,
            "speedup_vs_gpipe": 1.0,
            "per_stage": "0.33 0.09",
        },
        {
            "schedule": "1f1b",
            "pp": 2,
            "step_ms": 2.0,
            "bubble_formula": 0.2,
            "bubble_measured_mean": 0.15,
            "speedup_vs_gpipe": 1.5,
            "per_stage": "0.20 0.10",
        },
    ]
    assert pr.ratio_columns(rows) == ["speedup_vs_gpipe"]
    assert pr.formula_pairs(rows) == [("bubble_measured_mean", "bubble_formula")]
    assert pr.label_columns(rows, set()) == ["schedule"]  # pp does not vary; per-stage figures are data
    assert pr.size_curve([{"size": s, "median_ms": 1.0} for s in (1, 2, 4)]) == ("size", "median_ms")
    src = tmp_path / "pipe.json"
    src.write_text(json.dumps({"name": "pipe", "rows": rows}))
    (tmp_path / "pipe.md").write_text("# pipe\n")
    assert pr.main([str(src)]) == 0
    if _has_matplotlib():
        png = tmp_path / "pipe.png"
        assert png.exists() and png.stat().st_size < 100_000
        assert (tmp_path / "pipe.md").read_text().endswith("![pipe](pipe.png)\n")
        assert pr.plot_json(src) is None and pr.plot_json(src, force=True) == png  # existing plots kept unless forced
    assert pr.plot_json(tmp_path / "pipe.md") is None  # not JSON: skipped with a message, no exception


def test_write_results_records_no_machine_paths(tmp_path):
    import tempfile

    root = Path(__file__).resolve().parents[1]
    scratch = Path(tempfile.gettempdir()) / "llmpar-x"
    rows = [{"file": str(root / "bench" / "results" / "a.json"), "dir": str(scratch), "n": 1}]
    paths = write_results("paths", rows, meta={"note": f"data under {scratch} and {root}"}, out_dir=tmp_path)
    text = paths["json"].read_text() + paths["md"].read_text()
    assert str(root) not in text and str(scratch) not in text
    data = json.loads(paths["json"].read_text())
    assert data["rows"][0]["file"] == "bench/results/a.json" and data["rows"][0]["dir"] == "$TMPDIR/llmpar-x"
    assert data["meta"]["note"] == "data under $TMPDIR/llmpar-x and ."


def test_committed_results_are_valid_and_hold_no_absolute_paths():
    bad = []
    for path in sorted(RESULTS.rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        if path.suffix == ".json":
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                bad.append(f"{rel}: not valid JSON ({e})")
        for n, line in enumerate(text.splitlines(), 1):
            if str(ROOT) in line or ABSOLUTE.search(line):
                bad.append(f"{rel}:{n}: an absolute machine path: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)


def test_results_tables_have_small_plots():
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed")
    import plot_results as pr

    for path in sorted(RESULTS.glob("*.json")):
        png = path.with_suffix(".png")
        if pr._panels(json.loads(path.read_text())):
            assert png.exists(), f"{path.name} has no plot: run python bench/plot_results.py"
    for png in RESULTS.rglob("*.png"):
        assert png.stat().st_size < 100_000, f"{png.name} is {png.stat().st_size // 1024} KB (keep plots < 100 KB)"


def _saved_run(benchmarks: list[dict]) -> dict:
    return {
        "machine_info": {"node": "", "cpu": {"brand_raw": "Test CPU", "count": 4}, "python_version": "3.11.0"},
        "llmpar": {"torch": "2.13.0", "triton": None, "llmpar": "0.1.0", "gpus": []},
        "commit_info": {"id": "0123456789abcdef", "dirty": False},
        "datetime": "2026-01-01T00:00:00",
        "version": "5.3.1",
        "command": "pytest bench/ --benchmark-only",
        "benchmarks": benchmarks,
    }


def _case(group: str, impl: str, median: float) -> dict:
    return {
        "group": group,
        "name": f"test_x[cpu-{impl}]",
        "param": f"cpu-{impl}",
        "extra_info": {"impl": impl},
        "stats": {"median": median, "iqr": median / 10, "rounds": 7},
    }


def test_benchmark_table_renders_ratios_per_group(tmp_path):
    import benchmark_table as bt

    data = _saved_run(
        [
            _case("op a cpu", "llmpar", 1e-3),
            _case("op a cpu", "torch", 2e-3),
            _case("op b cpu", "torch", 4e-6),
            _case("op b cpu", "llmpar", 8e-6),
            _case("lonely cpu", "llmpar", 1.5),
        ]
    )
    rows = bt.rows(data)
    assert [(r["group"], r["impl"]) for r in rows][:2] == [("op a cpu", "torch"), ("op a cpu", "llmpar")]
    assert [r["time_vs_torch"] for r in rows] == [1.0, 0.5, 1.0, 2.0, None]
    md = bt.render(data, source="bench/results/pytest-benchmark/x.json")
    assert "| op a cpu | torch | 2 ms | 200 µs | 7 | 1.00 |" in md and "|  | llmpar | 1 ms |" in md
    assert "| op b cpu | torch | 4 µs |" in md and "| lonely cpu | llmpar | 1.5 s |" in md
    assert "Test CPU (4 cores)" in md and "commit 0123456" in md and "`pytest bench/ --benchmark-only`" in md
    assert "| op cpu | llmpar | 2 | 1.00 | 0.50 | 2.00 |" in md  # geomean of 0.5 and 2
    src = tmp_path / "0001_x.json"
    src.write_text(json.dumps(data))
    assert bt.main([str(src), "--out", str(tmp_path / "ops.md")]) == 0
    assert (tmp_path / "ops.md").read_text().startswith("# llmpar op micro-benchmarks")
    assert (tmp_path / "ops.png").exists() == _has_matplotlib()


def test_suites_stay_out_of_the_test_run():
    import tomllib

    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["testpaths"] == ["tests"]  # `pytest` and `make test` never collect bench/
    assert "$(PYTEST) -q -ra tests" in (ROOT / "Makefile").read_text()  # the test target names tests/ only


def test_suites_run_once_on_cpu():
    """Every suite's cases once, untimed, at the smallest size (--benchmark-disable: --benchmark-only cannot go with
    it; LLMPAR_BENCH_QUICK=1); all ops, impls and devices still collected."""
    out = _run_pytest("bench", "--benchmark-disable", "-v", "-rs", LLMPAR_BENCH_QUICK="1")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout and "error" not in out.stdout.lower()
    assert "far too slow to benchmark" in out.stdout  # Triton on CPU: skipped, with the reason
    for test in (
        "test_linear_act_forward",
        "test_linear_act_fwd_bwd",
        "test_bias_act_backward",
        "test_pack_bucket",
        "test_unpack_bucket",
        "test_adamw_step",
        "test_grad_norm",
        "test_cross_entropy",
    ):
        assert re.search(rf"::{test}\[cpu-\S*-llmpar\S*\] (PASSED|SKIPPED)", out.stdout), test


def test_suite_save_compare_and_table(tmp_path):
    """--benchmark-save into a storage folder, --benchmark-compare against it, and the saved JSON's table."""
    import benchmark_table as bt

    sel = [
        "bench/suites/test_bench_grad_norm.py",
        "-k",
        "cpu and 1Mx64 and fp32",
        "--benchmark-max-time=0.01",
        "--benchmark-min-rounds=2",
        f"--benchmark-storage={tmp_path}",
    ]
    first = _run_pytest(*sel, "--benchmark-only", "--benchmark-save=unit", "-q")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    saved = list(tmp_path.glob("*/0001_unit.json"))
    assert len(saved) == 1, list(tmp_path.rglob("*"))
    text = saved[0].read_text()
    assert str(ROOT) not in text and not ABSOLUTE.search(text) and '"node": ""' in text
    data = bt.load(saved[0])
    assert {b["extra_info"]["impl"] for b in data["benchmarks"]} == {"torch", "llmpar"}
    assert data["command"].startswith("pytest ") and "test_bench_grad_norm.py" in data["command"]
    assert "$TMPDIR/" in data["command"] and data["llmpar"]["torch"]  # the storage path made portable
    second = _run_pytest(*sel, "--benchmark-only", "--benchmark-compare=0001", "-q")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    assert "0001_unit" in second.stdout and "NOW" in second.stdout
    assert "machine_info is different" not in second.stdout + second.stderr  # volatile fields kept out of it
    assert "| grad_norm fp32 1Mx64 cpu | torch |" in bt.render(data)
