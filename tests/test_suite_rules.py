"""The suite's own machinery: the tiers and the durations budget (tests/suite_rules.py, run by pytester on small test
files), the DeepSpeed op-build cache and the golden DeepSpeed references (tests/reference_runs.py)."""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import pytest

import reference_runs
import suite_rules
from reference_runs import References, StaleGolden, ds_extensions

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent
CONFTEST = """
import pytest
from suite_rules import (
    pytest_collection_modifyitems, pytest_configure, pytest_report_header, pytest_runtest_call,
    pytest_runtest_makereport, pytest_runtest_setup,
)

@pytest.fixture
def ds_ext_dir(tmp_path):
    return tmp_path
"""
MARKERS = "[pytest]\nmarkers =\n" + "".join(f"    {m}: -\n" for m in ("unit", "ranks", "e2e", "gpu", "smoke", "slow"))


@pytest.fixture
def suite(pytester, monkeypatch):
    """A pytester folder with the suite's hooks as its conftest; the budget variables unset, and wall time counted
    as it is (what other processes take of the machine is not known: as on a quiet machine)."""
    for var in ("LLMPAR_TEST_BUDGET", "LLMPAR_TEST_BUDGET_SCALE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(suite_rules, "_machine", lambda: (0.0, 0))
    pytester.makeini(MARKERS)
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "conftest.py").write_text(CONFTEST)  # below the root, as tests/conftest.py is
    return pytester


def _write(pytester, name: str, text: str) -> None:
    (pytester.path / "tests" / f"{name}.py").write_text(text)


# ------------------------------------------------------------------------------------------------- the budget

SLOW_TESTS = """
import time
import pytest

def test_quick():
    pass

def test_slow_unmarked():
    time.sleep(0.4)

@pytest.mark.slow
def test_slow_without_a_reason():
    time.sleep(0.4)

@pytest.mark.slow(reason="a convergence run")
def test_slow_with_a_reason():
    time.sleep(0.4)

@pytest.mark.slow("the reason as an argument")
def test_slow_with_a_positional_reason():
    time.sleep(0.4)

@pytest.fixture(scope="module")
def expensive():
    time.sleep(0.4)

def test_slow_setup(expensive):
    pass

@pytest.fixture(scope="session")
def built_once():
    time.sleep(0.4)

def test_slow_only_by_a_session_fixture(built_once):
    pass

def test_slow_and_failing():
    time.sleep(0.4)
    assert False, "its own failure"
"""


def test_budget_fails_slow_tests_that_give_no_reason(suite, monkeypatch):
    _write(suite, "test_budget", SLOW_TESTS)
    monkeypatch.setenv("LLMPAR_TEST_BUDGET", "0.3")
    result = suite.runpytest("-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=4, failed=4)  # a session fixture's setup is not charged
    out = result.stdout.str()
    for name in ("test_slow_unmarked", "test_slow_without_a_reason", "test_slow_setup"):
        assert f"FAILED tests/test_budget.py::{name}" in out and f"tests/test_budget.py::{name} took 0." in out
    assert "(its slow marker gives no reason)" in out and "over the suite's budget of 0.3 s" in out
    assert "its own failure" in out  # a failing test keeps its own failure
    assert "llmpar durations budget: 0.3 s per test" in out


@pytest.mark.parametrize("env", [{"LLMPAR_TEST_BUDGET_SCALE": "10"}, {"LLMPAR_TEST_BUDGET": "0"}])
def test_budget_scales_or_turns_off(suite, monkeypatch, env):
    _write(suite, "test_budget", "import time\n\ndef test_slow_unmarked():\n    time.sleep(0.4)\n")
    monkeypatch.setenv("LLMPAR_TEST_BUDGET", "0.3")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.parametrize("var, value", [("LLMPAR_TEST_BUDGET", "-1"), ("LLMPAR_TEST_BUDGET_SCALE", "fast")])
def test_budget_refuses_bad_settings(suite, monkeypatch, var, value):
    _write(suite, "test_budget", "def test_quick():\n    pass\n")
    monkeypatch.setenv(var, value)
    result = suite.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "LLMPAR_TEST_BUDGET" in result.stderr.str()


def test_a_busy_machine_is_not_counted():
    """(wall clock, machine busy CPU s, own CPU s) samples: the time other processes took of the cores is not
    charged to the test; its own CPU is."""
    counted = suite_rules.counted_seconds
    assert counted((0.0, 0.0, 0.0), (30.0, 31.0, 30.0), cores=2) == pytest.approx(29.5)  # quiet: its wall time
    assert counted((0.0, 0.0, 0.0), (30.0, 60.0, 20.0), cores=2) == pytest.approx(10.0)  # others took 40 CPU s
    assert counted((0.0, 5.0, 0.0), (30.0, 5.0, 20.0), cores=2) == pytest.approx(30.0)  # never below 0 others
    assert counted((0.0, 0.0, 0.0), (30.0, 60.0, 0.0), cores=0) == 30.0  # /proc/stat unreadable: wall time
    busy, cores = suite_rules._machine()
    assert cores == len(os.sched_getaffinity(0)) or cores >= os.cpu_count()  # every core /proc/stat counts
    assert busy > 0


def test_slow_reason_reads_the_marker():
    """Only a non-empty string is a reason."""

    class Item:
        def __init__(self, mark):
            self.mark = mark

        def get_closest_marker(self, name):
            return self.mark

    assert suite_rules.slow_reason(Item(pytest.mark.slow(reason="why").mark)) == "why"
    assert suite_rules.slow_reason(Item(pytest.mark.slow("why").mark)) == "why"
    for mark in (pytest.mark.slow.mark, pytest.mark.slow(reason=" ").mark, pytest.mark.slow(reason=3).mark, None):
        assert suite_rules.slow_reason(Item(mark)) is None


# -------------------------------------------------------------------------------------------------- the tiers

TIERED_TESTS = """
import os
import subprocess
import sys
import multiprocessing
import pytest
from multirank import multirank, run_ranks

def _body():
    return 1

def launch(cmd):
    return subprocess.run(cmd, check=True)

def helper():
    return run_ranks(_body, 2)

def test_plain():
    assert sum([1, 2]) == 3

def test_ranks_through_a_helper():
    helper()

@multirank(2)
def test_decorated():
    pass

def test_a_job_through_a_helper():
    launch([sys.executable, "-c", "pass"])

@pytest.fixture
def launched():
    return launch([sys.executable, "-c", "pass"])

def test_a_job_in_a_fixture(launched):
    pass

def test_against_deepspeed(ds_ext_dir):
    pass

@pytest.mark.gpu
def test_on_a_gpu():
    pass

def test_processes_of_its_own():
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=print)

def test_a_job_out_of_sight():
    os.system(f"{sys.executable} -c pass")

def test_processes_out_of_sight():
    ctx = multiprocessing.get_context("fork")
    p = getattr(ctx, "Proc" + "ess")(target=int)
    p.start()
    p.join()

@pytest.mark.e2e
def test_a_job_declared():
    os.system(f"{sys.executable} -c pass")
"""


def test_tiers_come_from_what_a_test_does(suite):
    _write(suite, "test_tiers", TIERED_TESTS)
    items, _ = suite.inline_genitems("-p", "no:cacheprovider")
    tiers = {t: {i.name for i in items if i.get_closest_marker(t)} for t in ("unit", "ranks", "e2e", "gpu")}
    assert tiers["unit"] == {"test_plain", "test_a_job_out_of_sight", "test_processes_out_of_sight"}
    assert tiers["ranks"] == {"test_ranks_through_a_helper", "test_decorated[2]", "test_processes_of_its_own"}
    assert tiers["e2e"] == {
        "test_a_job_through_a_helper",
        "test_a_job_in_a_fixture",
        "test_against_deepspeed",
        "test_a_job_declared",
    }
    assert tiers["gpu"] == {"test_on_a_gpu"}
    # -m selects on them (the markers are added before pytest's own selection)
    result = suite.runpytest("-p", "no:cacheprovider", "--collect-only", "-q", "-m", "ranks and not e2e")
    assert sorted(line.split("::")[1] for line in result.stdout.lines if "::" in line) == sorted(tiers["ranks"])


@pytest.mark.e2e  # its inner tests start a Python job and a process
def test_a_unit_test_that_starts_a_job_or_processes_fails_naming_its_tier(suite):
    _write(suite, "test_tiers", TIERED_TESTS)
    result = suite.runpytest("-p", "no:cacheprovider", "-k", "plain or out_of_sight or declared", "-rf")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "test_a_job_out_of_sight is tiered unit but started a job" in out and "@pytest.mark.e2e" in out
    assert "test_processes_out_of_sight is tiered unit but ran on several ranks" in out and "mark.ranks" in out


def test_smoke_entries_name_tests():
    """Every SMOKE entry names a test function defined in its file (a rename would empty `make test-fast`'s smoke
    of that tier; collecting tests/ with -m smoke also checks it)."""
    for entry in suite_rules.SMOKE:
        path, name = entry.split("::")
        tree = ast.parse((TESTS.parent / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name.split("[")[0] in names, entry


# ------------------------------------------------------------------------------------ DeepSpeed's op builds


def _build(folder: Path, name: str, *, lock: bool = False, so: bytes = b"so") -> Path:
    d = folder / name
    d.mkdir(parents=True)
    (d / f"{name}.so").write_bytes(so)
    (d / "build.ninja").write_text("rule")
    if lock:
        (d / "lock").write_text("")
    return d


def test_op_builds_are_seeded_from_the_cache_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMPAR_DS_EXT_CACHE", str(tmp_path / "cache"))
    cache = reference_runs.ds_ext_cache()
    if cache is None:
        pytest.skip("DeepSpeed is not installed: no cache")
    cached = _build(cache, "shm_comm")
    _build(cache, "killed_midway", lock=True)
    session = tmp_path / "session"
    session.mkdir()
    with ds_extensions(session) as path:
        assert sorted(p.name for p in path.iterdir()) == ["shm_comm"]  # the finished build only
        built = path / "shm_comm" / "shm_comm.so"
        assert built.stat().st_mtime_ns == (cached / "shm_comm.so").stat().st_mtime_ns  # mtimes kept for ninja
        _build(path, "cpu_adam")  # built in this session
        _build(path, "under_way", lock=True)
        time.sleep(0.01)
        built.write_bytes(b"rebuilt")  # ninja rebuilt it (its sources changed)
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [
        "cpu_adam",
        "killed_midway",
        "shm_comm",
    ]
    assert (cache / "shm_comm" / "shm_comm.so").read_bytes() == b"rebuilt"
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no copy left aside


def test_ops_the_cache_seeded_are_not_built_again(tmp_path, monkeypatch):
    for folder in reference_runs.DS_OPS.values():
        _build(tmp_path, folder)
    monkeypatch.setattr(reference_runs.subprocess, "run", None)  # no build may start
    assert reference_runs.build_missing_ops(tmp_path) == []


def test_op_build_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LLMPAR_DS_EXT_CACHE", "off")
    assert reference_runs.ds_ext_cache() is None


# ---------------------------------------------------------------------------------------- golden references


@pytest.fixture
def golden_root(tmp_path, monkeypatch):
    monkeypatch.setattr(reference_runs, "ROOT", tmp_path)
    monkeypatch.setattr(reference_runs, "GOLDEN", tmp_path / "golden")
    monkeypatch.delenv("LLMPAR_GOLDEN", raising=False)
    (tmp_path / "script.py").write_text("print(1)\n")
    return tmp_path


def _references(calls: list, *, record=lambda case: {"loss": [1.0, 0.5]}, package: str = "pytest") -> References:
    def run(case, spec, tmp, ext):
        calls.append(case)
        return record(case)

    def same(case, live, golden):
        assert live == golden, f"{case}: {live} != {golden}"

    return References(
        "toy",
        run=run,
        cases={"a": {"lr": 1}, "b": {"lr": 2}},
        live={"a"},
        sources=["script.py"],
        packages=(package,),
        same=same,
    )


def test_golden_cases_are_read_and_live_cases_run_and_are_checked(golden_root, tmp_path):
    calls: list = []
    refs = _references(calls)
    refs.refresh(tmp_path)
    assert calls == ["a", "b"]
    data = json.loads((golden_root / "golden" / "toy" / "b.json").read_text())
    assert data["spec"] == {"lr": 2} and data["versions"]["pytest"] == pytest.__version__
    assert set(data["sources"]) == {"script.py"} and data["record"] == {"loss": [1.0, 0.5]}
    calls.clear()
    assert refs.get("b", tmp_path, tmp_path) == {"loss": [1.0, 0.5]} and calls == []  # read
    assert refs.get("a", tmp_path, tmp_path) == {"loss": [1.0, 0.5]} and calls == ["a"]  # run
    # DeepSpeed here gives something else than its golden (same versions): the live case says so
    drifted = _references(calls, record=lambda case: {"loss": [1.0, 0.6]})
    with pytest.raises(AssertionError, match="differs from its golden file"):
        drifted.get("a", tmp_path, tmp_path)


def test_a_golden_from_other_inputs_names_make_golden(golden_root, tmp_path):
    refs = _references([])
    refs.refresh(tmp_path)
    (golden_root / "script.py").write_text("print(2)\n")
    with pytest.raises(StaleGolden, match=r"sources \['script.py'\] changed.*make golden"):
        refs.get("b", tmp_path, tmp_path)
    refs.refresh(tmp_path)
    refs.cases["b"] = {"lr": 3}
    with pytest.raises(StaleGolden, match="its spec changed"):
        refs.get("b", tmp_path, tmp_path)


def test_other_versions_run_live_and_missing_goldens_fail(golden_root, tmp_path):
    calls: list = []
    refs = _references(calls)
    with pytest.raises(AssertionError, match="no golden file golden/toy/b.json: run `make golden`"):
        refs.get("b", tmp_path, tmp_path)
    refs.refresh(tmp_path)
    path = golden_root / "golden" / "toy" / "b.json"
    data = json.loads(path.read_text())
    data["versions"]["pytest"] = "0.0.1"
    path.write_text(json.dumps(data))
    calls.clear()
    assert refs.get("b", tmp_path, tmp_path) == {"loss": [1.0, 0.5]} and calls == ["b"]  # live: not the golden's
    os.environ["LLMPAR_GOLDEN"] = "live"
    try:
        calls.clear()
        refs.get("a", tmp_path, tmp_path)
        assert calls == ["a"]
    finally:
        del os.environ["LLMPAR_GOLDEN"]
    # the reference's package is not installed: golden cases are still read, live ones skip
    absent = _references(calls, package="no-such-package-here")
    absent.refresh(tmp_path)
    calls.clear()
    assert absent.get("b", tmp_path, tmp_path) == {"loss": [1.0, 0.5]} and calls == []
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        absent.get("a", tmp_path, tmp_path)


def test_the_suites_goldens_are_current():
    """Every golden file of every suite was made from the sources and the spec its test has now."""
    import importlib

    for suite, module in reference_runs.SUITES.items():
        try:
            refs = importlib.import_module(module).REFERENCES
        except pytest.skip.Exception:
            continue  # the module's own dependencies are missing
        for case in refs.cases:
            assert refs.path(case).is_file(), f"{suite}/{case}: no golden file: run `make golden`"
            refs.golden(case)  # StaleGolden if made from other inputs
