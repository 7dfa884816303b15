"""The suite's own rules, as pytest hooks (tests/conftest.py imports them): tiers, a smoke set and a durations budget.

Tiers (markers, declared in pyproject.toml), each test in one or more of them:
  ``ranks``  runs on several ranks: the multi-rank harness (tests/multirank.py: ``run_ranks``, ``@multirank``) or
             processes of its own (``multiprocessing`` / ``torch.multiprocessing``);
  ``e2e``    starts a job in other processes (a ``subprocess``: torchrun, a script, the CLI, a fresh interpreter, the
             Triton interpreter's pytest) or compares with a DeepSpeed run (the ``ds_ext_dir`` fixture);
  ``gpu``    needs a CUDA device (declared by the test; skipped without one);
  ``unit``   none of those: one process, no job (what ``make test-fast`` runs, with the ``smoke`` set).
``ranks`` and ``e2e`` are found by reading the test: the names its code, its fixtures and the helpers of tests/ they
call load (transitively, a few calls deep). A test can also declare them (``@pytest.mark.e2e``) where the job is
started out of sight (inside llmpar); a test tiered ``unit`` that starts a Python job or a multi-rank run anyway
fails, naming the marker it needs, so the tiers stay true.

Durations budget: a test whose setup and call take longer than ``LLMPAR_TEST_BUDGET`` seconds (20: the slowest
unmarked tests take ~10 s on a quiet 2-core machine) times ``LLMPAR_TEST_BUDGET_SCALE`` (1; ``make test`` passes
``TEST_BUDGET_SCALE``, for a slower machine) fails, unless it carries ``@pytest.mark.slow(reason="...")`` saying why
it is worth its time. A busy machine does not fail a test: the seconds counted are its wall time less the time
other processes took of the machine's cores meanwhile (/proc/stat, less the CPU of the test's own processes, ranks
and jobs), and less the setup of session fixtures (what a session builds once: llmpar's CPU extension, DeepSpeed's
ops on a cold cache). ``LLMPAR_TEST_BUDGET=0`` turns the budget off.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "ranks", "e2e", "gpu")
# a few tests of the other tiers that `make test-fast` runs beside the unit tier: the harness, ZeRO parity on 2 ranks,
# pipeline parity (pp=2, every schedule), the training command as a job, one live DeepSpeed comparison (node ids,
# checked to exist)
SMOKE = (
    "tests/test_harness.py::test_decorated_body_sees_its_world",
    "tests/test_zero.py::test_stages_match_single_process_fp64",
    "tests/test_pipeline_ranks.py::test_pp2_every_schedule_matches_single_process",
    "tests/test_train.py::test_command_trains_through_initialize",
    "tests/test_deepspeed_scripts.py::test_cifar_script_matches_deepspeed[2]",
)
# names that, loaded by a test or a helper it calls, start ranks (the harness, or processes of the test's own:
# multiprocessing / torch.multiprocessing) / a job in other processes
_RANKS_NAMES = frozenset({"run_ranks", "multirank", "Process", "spawn", "start_processes"})
_JOB_NAMES = frozenset({"subprocess", "Popen", "run_interpreted", "check_output", "check_call"})
_DEPTH = 4  # calls followed from the test into the helpers of tests/
# executables that make a subprocess a job (a Python process, a launcher, a script); tools a library runs on its own
# (ptxas, ninja, a compiler, uname) are not jobs
_JOB_EXECUTABLES = frozenset({"torchrun", "llmpar", "deepspeed", "accelerate", "srun", "mpirun", "bash", "sh"})

DEFAULT_BUDGET = 20.0


def _budget() -> float:
    """Seconds a test may take without a reason: LLMPAR_TEST_BUDGET x LLMPAR_TEST_BUDGET_SCALE (0: no budget)."""
    try:
        base = float(os.environ.get("LLMPAR_TEST_BUDGET", DEFAULT_BUDGET))
        scale = float(os.environ.get("LLMPAR_TEST_BUDGET_SCALE", "1"))
    except ValueError as err:
        raise pytest.UsageError(f"LLMPAR_TEST_BUDGET / LLMPAR_TEST_BUDGET_SCALE must be numbers: {err}") from None
    if base < 0 or scale <= 0:
        raise pytest.UsageError(
            f"LLMPAR_TEST_BUDGET={base} must be >= 0 (0: off) and LLMPAR_TEST_BUDGET_SCALE={scale} must be > 0"
        )
    return base * scale


# ------------------------------------------------------------------------------------------------------- tiers


def _in_tests(fn: Any, roots: tuple[Path, ...] = (TESTS,)) -> bool:
    path = getattr(getattr(fn, "__code__", None), "co_filename", "")
    return bool(path) and any(Path(path).resolve().is_relative_to(r) for r in roots)


def loaded_names(
    fn: Callable, depth: int = _DEPTH, seen: set | None = None, roots: tuple[Path, ...] = (TESTS,)
) -> set[str]:
    """The global and attribute names ``fn``'s code loads (nested functions and lambdas included), and those of the
    functions defined under ``roots`` (tests/) it names, ``depth`` calls deep."""
    seen = set() if seen is None else seen
    fn = getattr(fn, "__func__", fn)
    body = getattr(fn, "__multirank_body__", None)
    code = getattr(fn, "__code__", None)
    if code is None or fn in seen:
        return set()
    seen.add(fn)
    names: set[str] = {"multirank"} if body is not None else set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    if depth > 0:
        scope = getattr(fn, "__globals__", {})
        for name in list(names):
            obj = scope.get(name)
            if inspect.isfunction(obj) and _in_tests(obj, roots):
                names |= loaded_names(obj, depth - 1, seen, roots)
    return names


def tiers_of(item: pytest.Item) -> set[str]:
    """The tiers of a collected test: what it declares, and what its code and fixtures show."""
    tiers = {t for t in TIERS if item.get_closest_marker(t) is not None}
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    roots = (TESTS, Path(item.path).resolve().parent)  # tests/, and the test's own folder
    funcs = [getattr(item, "obj", None)]
    funcs += [fd.func for defs in fixtures.values() for fd in defs if _in_tests(fd.func, roots)]
    names: set[str] = set()
    seen: set = set()
    for fn in funcs:
        if fn is not None:
            names |= loaded_names(fn, seen=seen, roots=roots)
    if names & _RANKS_NAMES:
        tiers.add("ranks")
    if names & _JOB_NAMES or "ds_ext_dir" in fixtures:
        tiers.add("e2e")
    if not tiers & {"ranks", "e2e", "gpu"}:
        tiers.add("unit")
    return tiers


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add the tier markers (and ``smoke``), check the smoke list, skip ``gpu`` tests without a device."""
    import torch

    ids = set()
    for item in items:
        for tier in sorted(tiers_of(item)):
            if item.get_closest_marker(tier) is None:
                item.add_marker(tier)
        ids.add(item.nodeid)
        if item.nodeid in SMOKE or item.nodeid.split("[")[0] in SMOKE:
            item.add_marker("smoke")
    # a selection of the smoke set (make test-fast) from the whole of tests/: every entry must name a test (a
    # rename must not empty the smoke set); this hook runs before -m / -k deselect anything
    whole = any(Path(str(a)).resolve() == TESTS for a in config.args)
    if whole and "smoke" in (config.option.markexpr or ""):
        bases = ids | {i.split("[")[0] for i in ids}
        missing = [s for s in SMOKE if s not in bases]
        if missing:
            raise pytest.UsageError(f"tests/suite_rules.py SMOKE names tests that do not exist: {missing}")
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# the tier guard: a test tiered unit that starts a Python job or a multi-rank run fails naming the marker it needs
_SEEN: dict[str, list[str]] = {"jobs": [], "processes": []}


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        argv = args[1]
        argv = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv or [])
        exe = os.fsdecode(args[0] or (argv[0] if argv else ""))
    elif event == "os.posix_spawn":
        exe, argv = os.fsdecode(args[0]), list(args[1])
    elif event == "os.system":
        exe = os.fsdecode(args[0])
        argv = [exe]
    else:
        return
    name = os.path.basename(exe.split()[0] if exe else "")
    if exe == sys.executable or name.startswith("python") or name in _JOB_EXECUTABLES:
        _SEEN["jobs"].append(" ".join(os.fsdecode(a) for a in argv)[:200])


sys.addaudithook(_audit)
_process_start = multiprocessing.process.BaseProcess.start


def _counted_start(self: multiprocessing.process.BaseProcess) -> None:
    """multiprocessing's Process.start, counted (a spawned process raises no audit event)."""
    _SEEN["processes"].append(self.name)
    _process_start(self)


multiprocessing.process.BaseProcess.start = _counted_start  # type: ignore[method-assign]


def _ranks_runs() -> int:
    multirank = sys.modules.get("multirank")
    return getattr(multirank, "RUNS", 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    jobs, processes, runs = len(_SEEN["jobs"]), len(_SEEN["processes"]), _ranks_runs()
    result = yield
    if item.get_closest_marker("unit") is not None:
        started = _SEEN["jobs"][jobs:]
        if _ranks_runs() > runs or len(_SEEN["processes"]) > processes:
            pytest.fail(
                f"{item.nodeid} is tiered unit but ran on several ranks (the multi-rank harness or processes of its "
                "own): mark it @pytest.mark.ranks",
                pytrace=False,
            )
        if started:
            pytest.fail(
                f"{item.nodeid} is tiered unit but started a job ({started[0]!r}): mark it "
                "@pytest.mark.e2e (its job is started out of sight of tests/suite_rules.py's reading)",
                pytrace=False,
            )
    return result


# ---------------------------------------------------------------------------------------------- durations budget


def slow_reason(item: pytest.Item) -> str | None:
    """The reason a ``slow`` marker gives (``reason=`` or its first argument), or None."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return None
    reason = mark.kwargs.get("reason", mark.args[0] if mark.args else None)
    return reason if isinstance(reason, str) and reason.strip() else None


def _machine() -> tuple[float, int]:
    """(CPU seconds all the machine's cores have been busy so far, how many cores /proc/stat counts); (0, 0) where
    /proc/stat cannot tell."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        v = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return 0.0, 0
    cores = sum(1 for line in lines[1:] if line.startswith("cpu"))
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), cores


def _own_cpu() -> float:
    """CPU seconds used by this process, its waited children (a torchrun job and all it started), the ranks of the
    multi-rank pools and the Triton interpreter's worker."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    for module, fn in (("multirank", "workers_cpu"), ("interp", "worker_cpu")):
        counter = getattr(sys.modules.get(module), fn, None)
        if counter is not None:
            own += counter()
    return own


def _sample() -> tuple[float, float, float]:
    busy, _ = _machine()
    return time.monotonic(), busy, _own_cpu()


def counted_seconds(start: tuple[float, float, float], end: tuple[float, float, float], cores: int) -> float:
    """The seconds a test is charged: its wall time less the time the machine's ``cores`` spent on other processes
    meanwhile (their CPU seconds / cores): on a quiet machine its wall time, on a busy one about what it would have
    taken alone."""
    wall = end[0] - start[0]
    others = max(0.0, (end[1] - start[1]) - (end[2] - start[2]))
    return max(0.0, wall - others / cores) if cores else wall


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    item.stash[_START] = _sample()
    item.stash[_ONCE] = 0.0
    _SETTING_UP[:] = [item]
    try:
        return (yield)
    finally:
        _SETTING_UP.clear()


class _SessionFixtures:
    """A session fixture's setup (a build once per session: llmpar's CPU extension, DeepSpeed's ops) is not charged
    to the test that happens to set it up first. A plugin of the whole session, not a conftest hook: pytest asks
    the session node about session fixtures, and a conftest below the root is not asked there."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        if fixturedef.scope != "session" or not _SETTING_UP:
            return (yield)
        item, start = _SETTING_UP[0], _sample()
        try:
            return (yield)
        finally:
            item.stash[_ONCE] = item.stash.get(_ONCE, 0.0) + counted_seconds(start, _sample(), _machine()[1])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    budget = item.config.stash.get(_BUDGET, 0.0)
    if report.when == "call" and report.passed and budget and _START in item.stash:
        start, end = item.stash[_START], _sample()
        took = max(0.0, counted_seconds(start, end, _machine()[1]) - item.stash.get(_ONCE, 0.0))
        if took > budget and slow_reason(item) is None:
            bare = item.get_closest_marker("slow") is not None
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} took {took:.1f} s (setup and call: {end[0] - start[0]:.1f} s of wall time, less what "
                f"other processes took of the machine meanwhile and the session fixtures' setup), over the suite's "
                f"budget of {budget:.1f} s "
                f"(LLMPAR_TEST_BUDGET x LLMPAR_TEST_BUDGET_SCALE): make it faster, or say why it is worth its time "
                f'with @pytest.mark.slow(reason="...")' + (" (its slow marker gives no reason)" if bare else "")
            )
    return report


_START = pytest.StashKey[tuple[float, float, float]]()
_ONCE = pytest.StashKey[float]()  # seconds of the session fixtures the test set up
_SETTING_UP: list[pytest.Item] = []  # the test whose setup runs now
_BUDGET = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_BUDGET] = _budget()
    if not config.pluginmanager.has_plugin("llmpar-session-fixtures"):
        config.pluginmanager.register(_SessionFixtures(), "llmpar-session-fixtures")


def pytest_report_header(config: pytest.Config) -> str:
    budget = config.stash.get(_BUDGET, 0.0)
    return f"llmpar durations budget: {f'{budget:.1f} s per test' if budget else 'off'} (tests/suite_rules.py)"
