"""The shared benchmark runner: time callables, compare them side by side, write results with their provenance.

    from harness import compare, measure, write_results

    t = measure(fn, warmup=5, repeats=30, device="cuda")          # Timing: median / min / IQR of the repeats
    cmp = compare({"torch": ref, "llmpar": ours}, baseline="torch", warmup=5, repeats=30, device="cuda")
    print(cmp.table())                                             # speedup = baseline median / case median
    write_results("fused_adamw", cmp.rows(size=4096), meta={"dtype": "bf16"})  # .json, .md and a .png plot

Timers: on a CUDA device each sample is ``number`` back-to-back calls between two CUDA events, reported per call;
``number=None`` (the default) picks it on CUDA so that a sample lasts about ``SAMPLE_S`` (2 ms): one call between
events would also count the Python launch path (50-150 us) of an op whose GPU work is ~0.2 ms, since the GPU idles
until the launch reaches it. ``graph="auto"`` captures the ``number`` calls in a CUDA graph and times its replay (no
launch path at all), falling back to back-to-back calls where the op cannot be captured; each row says which timer
ran (``timer``) and how many calls a sample held (``calls``). ``timer="do_bench"`` uses ``triton.testing.do_bench``
instead. On CPU: ``time.perf_counter``, one call per sample unless ``number`` says otherwise. ``compare`` interleaves
the repeats of all cases (case order rotated every round), so slow drift and noise bursts hit the baseline and the
candidates alike: ratios come from one run.
Multi-rank (under torchrun): ``measure_distributed`` lines ranks up with a barrier before each repeat and takes
the max over ranks of each repeat (the slowest rank is the step time).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(kw_only=True)
class Timing:
    """Seconds per call of ``repeats`` timed runs (each the mean of ``number`` back-to-back calls), and the timer
    that took them ("perf_counter", "cuda events", "cuda graph", "do_bench"; ``note``: why a graph was not used)."""

    name: str = ""
    times_s: list[float]
    number: int = 1
    timer: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if not self.times_s:
            raise ValueError("a Timing needs at least one repeat")

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def iqr_s(self) -> float:
        """Interquartile range (q3 - q1) of the repeats; 0 for fewer than 2 repeats."""
        if len(self.times_s) < 2:
            return 0.0
        q = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q[2] - q[0]

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "median_ms": self.median_s * 1e3,
            "min_ms": self.min_s * 1e3,
            "iqr_ms": self.iqr_s * 1e3,
            "repeats": len(self.times_s),
            "calls": self.number,
            "timer": self.timer,
            **({"note": self.note} if self.note else {}),
        }


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _check_counts(warmup: int, repeats: int, number: int | None) -> None:
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
        raise ValueError(f"number={number!r} must be an int >= 1, or None (chosen per case on CUDA)")


SAMPLE_S = 2e-3  # number=None on CUDA: back-to-back calls per sample until a sample lasts about this long
MAX_NUMBER = 100


def calls_per_sample(one_call_s: float, *, target_s: float = SAMPLE_S, max_number: int = MAX_NUMBER) -> int:
    """How many back-to-back calls one sample holds so that it lasts >= ``target_s`` (1 for calls that long already,
    at most ``max_number``)."""
    if not one_call_s > 0:
        return max_number
    return max(1, min(max_number, math.ceil(target_s / one_call_s)))


def _sync(device: torch.device | str | None) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def _events() -> tuple[Any, Any]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _time_once(fn: Callable[[], Any], device: torch.device | str | None, number: int) -> float:
    """Seconds per call for ``number`` back-to-back calls of ``fn`` (between two CUDA events on a CUDA device)."""
    if _is_cuda(device):
        start, end = _events()
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / number
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def _capture(fn: Callable[[], Any], number: int, device: torch.device | str) -> Callable[[], Any]:
    """A callable replaying a CUDA graph of ``number`` back-to-back calls of ``fn`` (warmed up on a side stream first,
    as capture requires). Raises whatever capture raises."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(number):
            fn()
    return graph.replay


class _Sampler:
    """How one case is timed: ``sample()`` returns seconds per call of one sample (``number`` calls, eager or one
    graph replay). Built after the case's warm-up (it may time one call to pick ``number``)."""

    def __init__(
        self, fn: Callable[[], Any], device: torch.device | str | None, number: int | None, graph: bool | str
    ) -> None:
        self.fn, self.device, self.note = fn, device, ""
        cuda = _is_cuda(device)
        if number is None:
            number = calls_per_sample(min(_time_once(fn, device, 1) for _ in range(3))) if cuda else 1
        self.number = number
        self.timer = "cuda events" if cuda else "perf_counter"
        self.replay: Callable[[], Any] | None = None
        if graph and cuda:
            try:
                self.replay = _capture(fn, number, device)
                self.timer = "cuda graph"
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured is timed eagerly
                if graph is True:
                    raise
                _sync(device)
                self.note = f"not captured ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
        _sync(device)

    def sample(self) -> float:
        if self.replay is not None:
            return _time_once(self.replay, self.device, 1) / self.number
        return _time_once(self.fn, self.device, self.number)

    def timing(self, name: str, times: list[float]) -> Timing:
        return Timing(name=name, times_s=times, number=self.number, timer=self.timer, note=self.note)


def _check_graph(graph: bool | str) -> None:
    if graph not in (False, True, "auto"):
        raise ValueError(f"graph={graph!r} is not one of False, True, 'auto'")


def measure(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    repeats: int = 20,
    device: torch.device | str | None = None,
    number: int | None = None,
    name: str = "",
    timer: str = "auto",
    graph: bool | str = False,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed samples of ``number`` calls each, per call.

    ``number``: calls per sample; None: 1 on CPU, on CUDA as many as make a sample last ~``SAMPLE_S``.
    ``graph``: on CUDA, time a CUDA graph of the ``number`` calls (True: it must capture; "auto": else eager).
    ``timer``: "auto" (CUDA events on a CUDA device, perf_counter otherwise), "perf_counter", or "do_bench"
    (``triton.testing.do_bench`` on CUDA; ``warmup``/``repeats`` then count calls, converted to its milliseconds).
    """
    _check_counts(warmup, repeats, number)
    _check_graph(graph)
    if timer not in ("auto", "perf_counter", "do_bench"):
        raise ValueError(f"timer={timer!r} is not one of 'auto', 'perf_counter', 'do_bench'")
    if timer == "do_bench":
        if not _is_cuda(device):
            raise ValueError(f"timer='do_bench' needs a CUDA device, got device={device!r}")
        return _do_bench(fn, warmup=warmup, repeats=repeats, name=name)
    for _ in range(warmup):
        fn()
    _sync(device)
    if timer == "perf_counter":
        t = Timing(
            name=name,
            times_s=[_time_once(fn, None, number or 1) for _ in range(repeats)],
            number=number or 1,
            timer="perf_counter",
        )
        _sync(device)
        return t
    sampler = _Sampler(fn, device, number, graph)
    return sampler.timing(name, [sampler.sample() for _ in range(repeats)])


def _do_bench(fn: Callable[[], Any], *, warmup: int, repeats: int, name: str) -> Timing:
    from triton.testing import do_bench

    one = _time_once(fn, "cuda", 1) * 1e3  # a rough call time, to turn call counts into do_bench's milliseconds
    kw = dict(warmup=max(1.0, warmup * one), rep=max(1.0, repeats * one))
    try:
        ms = do_bench(fn, return_mode="all", **kw)
    except (AssertionError, TypeError):  # older triton: no return_mode="all"
        ms = do_bench(fn, quantiles=[0.25, 0.5, 0.75], **kw)
    times = ms if isinstance(ms, list) else [float(ms)]
    return Timing(name=name, times_s=[t / 1e3 for t in times], timer="do_bench")


@dataclass(kw_only=True)
class Comparison:
    """Timings of several cases taken in one interleaved run; ``speedup(name) = median(baseline) / median(name)``."""

    baseline: str
    timings: dict[str, Timing] = field(default_factory=dict)

    def ratio(self, name: str) -> float:
        """Time of ``name`` relative to the baseline (< 1: faster than the baseline)."""
        return self.timings[name].median_s / self.timings[self.baseline].median_s

    def speedup(self, name: str) -> float:
        return 1.0 / self.ratio(name)

    def fastest(self) -> str:
        return min(self.timings, key=lambda n: self.timings[n].median_s)

    def rows(self, **extra: Any) -> list[dict[str, Any]]:
        """One row per case (``extra`` columns first, e.g. the size), with ``speedup`` vs the baseline."""
        out = []
        for name, t in self.timings.items():
            row = {**extra, **t.row(), "speedup": self.speedup(name), "baseline": name == self.baseline}
            out.append(row)
        return out

    def table(self) -> str:
        return markdown_table(self.rows())


def compare(
    cases: dict[str, Callable[[], Any]],
    *,
    baseline: str,
    warmup: int = 3,
    repeats: int = 20,
    device: torch.device | str | None = None,
    number: int | None = None,
    graph: bool | str = False,
) -> Comparison:
    """Time every case of ``cases`` side by side: warm each up, then ``repeats`` rounds that time each case once,
    starting at a different case every round. ``number`` and ``graph`` as in :func:`measure`, chosen per case (each
    row reports per-call times, its ``calls`` per sample and its ``timer``)."""
    if not cases:
        raise ValueError("cases is empty: give at least the baseline")
    if baseline not in cases:
        raise ValueError(f"baseline={baseline!r} is not one of the cases {sorted(cases)}")
    _check_counts(warmup, repeats, number)
    _check_graph(graph)
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    _sync(device)
    samplers = {n: _Sampler(cases[n], device, number, graph) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            times[name].append(samplers[name].sample())
    return Comparison(baseline=baseline, timings={n: samplers[n].timing(n, times[n]) for n in names})


def cpu_medians(
    cases: dict[str, Callable[[], Any]], repeats: int, clock: Callable[[], float] = time.thread_time
) -> dict[str, float]:
    """Median CPU seconds per call of every case, the cases interleaved as :func:`compare` does (a different case
    first every round). With one torch thread (``torch.set_num_threads(1)``) every op runs on the calling thread, so
    ``time.thread_time`` (or ``time.process_time``) is the work done, which other processes on a shared machine
    stretch far less than the wall time."""
    _check_counts(0, repeats, None)
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            t0 = clock()
            cases[name]()
            times[name].append(clock() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def compare_distributed(
    cases: dict[str, Callable[[], Any]],
    *,
    group: Any = None,
    warmup: int = 3,
    repeats: int = 20,
    device: torch.device | str | None = None,
    number: int = 1,
) -> dict[str, Timing]:
    """Time several callables side by side on every rank of ``group`` (default: the whole job).

    Repeats are interleaved, the starting case rotated each round, so that noise hits every case alike; ranks meet at
    a barrier before each timed call, and each repeat's time is the max over ranks (all-gathered, so every rank gets
    the same Timings). A collective call: every rank of ``group`` must call it with the same cases.
    """
    import torch.distributed as dist

    from llmpar.distributed import all_gather_flat, barrier, group_size

    _check_counts(warmup, repeats, number)
    if not cases:
        raise ValueError("cases is empty: give at least one name -> callable")
    pg = group if group is not None else dist.group.WORLD
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    names = list(cases)
    local: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if _is_cuda(device):
                torch.cuda.synchronize(device)
            barrier(pg)
            local[name].append(_time_once(cases[name], device, number))
    comm_device = torch.device(device) if _is_cuda(device) else torch.device("cpu")
    world = group_size(pg)
    out = {}
    for name in names:
        mine = torch.tensor(local[name], dtype=torch.float64, device=comm_device)
        everyone = torch.empty(world * repeats, dtype=torch.float64, device=comm_device)
        all_gather_flat(everyone, mine, pg)
        out[name] = Timing(name=name, times_s=everyone.view(world, repeats).max(dim=0).values.tolist(), number=number)
    return out


def measure_distributed(
    fn: Callable[[], Any],
    *,
    group: Any = None,
    warmup: int = 3,
    repeats: int = 20,
    device: torch.device | str | None = None,
    number: int = 1,
    name: str = "",
) -> Timing:
    """Time ``fn`` on every rank of ``group``; each repeat is the max over ranks (see :func:`compare_distributed`)."""
    return compare_distributed({name: fn}, group=group, warmup=warmup, repeats=repeats, device=device, number=number)[
        name
    ]


# ---------------------------------------------------------------- provenance and output


def forced(backend: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``LLMPAR_BACKEND=backend`` (the op's backend picked for a timing); unset again after."""

    def call() -> Any:
        os.environ["LLMPAR_BACKEND"] = backend
        try:
            return fn()
        finally:
            os.environ.pop("LLMPAR_BACKEND", None)

    return call


def devices_for(choice: str, script: str) -> list[torch.device] | None:
    """The devices a ``--device cpu|cuda|all`` choice names on this machine; None (after saying so on stderr) when
    ``cuda`` was asked for and there is none."""
    devices = [torch.device("cpu")] if choice in ("cpu", "all") else []
    if choice in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    elif choice == "cuda":
        print(f"{script}: no CUDA device", file=sys.stderr)
        return None
    return devices


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """CPU model and cores, OS, Python, torch / triton / llmpar versions, GPUs, git commit."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "llmpar": _version("llmpar"),
        "git_commit": _git_commit(),
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def portable_arg(arg: str) -> str:
    """``arg`` without this machine's paths: a path in the repository relative to its root, one in the temp dir
    as ``$TMPDIR/...`` (also inside ``--opt=PATH``)."""
    if "=" in arg and arg.startswith("--"):
        key, _, value = arg.partition("=")
        return f"{key}={portable_arg(value)}"
    if not os.path.isabs(arg):
        return arg
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.gettempdir()
    for base, prefix in ((root, ""), (tmp, "$TMPDIR/")):
        if os.path.commonpath([os.path.abspath(arg), base]) == base:
            return prefix + os.path.relpath(arg, base)
    return arg


def command_line() -> str:
    """The command that is running, as a shell line (with the launcher's world size when under torchrun), with no
    absolute machine paths (``portable_arg``)."""
    args = " ".join(f'"{a}"' if a.startswith("$TMPDIR/") else shlex.quote(a) for a in map(portable_arg, sys.argv))
    if "WORLD_SIZE" in os.environ:  # torchrun runs the script itself: no "python" in front of it
        return f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', os.environ['WORLD_SIZE'])} {args}"
    return "python " + args


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A GitHub markdown table; columns are the union of the rows' keys, in first-seen order."""
    if not rows:
        return "(no rows)\n"
    cols: list[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def portable_text(text: str) -> str:
    """``text`` with this machine's paths taken out: the repository root dropped (paths become repo-relative), the
    temp dir written ``$TMPDIR``, the home dir ``~``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for base, repl in (
        (root + os.sep, ""),
        (root, "."),
        (tempfile.gettempdir(), "$TMPDIR"),
        (os.path.expanduser("~"), "~"),
    ):
        if len(base) > 1:  # never "/" itself
            text = re.sub(re.escape(base) + (r"(?![\w.-])" if not base.endswith(os.sep) else ""), repl, text)
    return text


def portable(value: Any) -> Any:
    """``value`` (str, or lists / dicts of them) through :func:`portable_text`; other values as they are."""
    if isinstance(value, str):
        return portable_text(value)
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


def write_results(
    name: str,
    rows: list[dict[str, Any]],
    meta: dict[str, Any] | None = None,
    *,
    out_dir: str | os.PathLike | None = None,
    curve: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``{out_dir}/{name}.json`` and ``{name}.md`` with the command, machine and date, and ``{name}.png`` when
    matplotlib is installed and the rows have something to plot (``bench/plot_results.py``): the ``curve`` when
    given, else ratio bars per case for rows with ratio / speedup columns (``speedup``, ``time_vs_*``, ...), measured
    vs formula column pairs, a scaling curve over a size column. Returns the paths written, by kind. No absolute
    machine paths are written (:func:`portable`).

    ``curve``: ``{"x": column, "y": [columns], "group": optional column splitting rows into lines,
    "logx": bool, "logy": bool, "title": str}``; kept in the JSON as ``plot`` so the figure can be redrawn.
    """
    if not name or any(c in name for c in "/\\ "):
        raise ValueError(f"name={name!r} must be a non-empty file stem without slashes or spaces")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError("rows must be a list of dicts")
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "name": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine_info(),
        "meta": {k: portable_arg(v) if isinstance(v, str) else v for k, v in (meta or {}).items()},
        "rows": rows,
    }
    if curve is not None:
        record["plot"] = curve
    record = portable(record)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    m = record["machine"]
    gpu = ", ".join(m["gpus"]) if m["gpus"] else "none"
    md = [
        f"# {name}",
        "",
        f"- command: `{record['command']}`",
        f"- date: {record['date']}",
        f"- machine: {m['cpu']} ({m['cores_usable']} of {m['cores']} cores), GPU: {gpu}",
        f"- versions: torch {m['torch']}, triton {m['triton']}, llmpar {m['llmpar']} (commit {m['git_commit']})",
    ]
    md += [f"- {k}: {v}" for k, v in record["meta"].items()]
    md += ["", markdown_table(record["rows"])]
    png = _plot(record, out / f"{name}.png")
    if png is not None:
        paths["png"] = png
        md.append(f"![{name}]({png.name})\n")
    paths["md"].write_text("\n".join(md))
    return paths


def _plot(record: dict[str, Any], path: Path) -> Path | None:
    """The record's plot (bench/plot_results.py), or None without matplotlib or anything to plot."""
    try:
        from plot_results import plot_record
    except ImportError:  # the harness imported from elsewhere than bench/ on sys.path
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from plot_results import plot_record
    return plot_record(record, path)
