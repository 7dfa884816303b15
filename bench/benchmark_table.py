"""A saved pytest-benchmark run (``pytest bench/ --benchmark-only --benchmark-save=NAME``) as a markdown table: the
median time of every case, and its ratio to the torch case of its group (llmpar / torch: < 1 is faster than torch),
with the command, machine and versions it ran on; and the same ratios as a bar plot beside it.

    python bench/benchmark_table.py --latest                          # newest save in bench/results/pytest-benchmark
    python bench/benchmark_table.py bench/results/pytest-benchmark/Linux-CPython-3.11-64bit/0001_cpu.json \\
        --out bench/results/pytest-benchmark/ops_cpu.md                # writes ops_cpu.md and ops_cpu.png
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
STORAGE = BENCH / "results" / "pytest-benchmark"
BASELINE = "torch"


def load(path: str | Path) -> dict[str, Any]:
    import json

    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "benchmarks" not in data:
        raise ValueError(f"{path} is not a pytest-benchmark JSON (no 'benchmarks' list)")
    return data


def latest(storage: Path = STORAGE) -> Path:
    """The newest saved run under ``storage`` (pytest-benchmark names them NNNN_name.json, per machine folder)."""
    saves = sorted(storage.glob("*/*.json"), key=lambda p: (p.name.split("_", 1)[0], p.stat().st_mtime))
    if not saves:
        raise FileNotFoundError(f"no saved pytest-benchmark run under {storage.name}/ (run with --benchmark-save=NAME)")
    return saves[-1]


def _impl(bench: dict[str, Any]) -> str:
    impl = (bench.get("extra_info") or {}).get("impl")
    return impl or str(bench.get("param") or bench["name"]).rsplit("-", 1)[-1].rstrip("]")


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case, groups in first-seen order (the baseline first in each): group, impl, median_s, iqr_s,
    rounds, and ``time_vs_torch`` (median / the group's torch median; None without a torch case)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for b in data["benchmarks"]:
        s = b["stats"]
        groups[b.get("group") or b["name"]].append(
            {
                "group": b.get("group") or b["name"],
                "impl": _impl(b),
                "median_s": s["median"],
                "iqr_s": s.get("iqr", 0.0),
                "rounds": s.get("rounds"),
            }
        )
    out = []
    for _group, cases in groups.items():
        base = next((c["median_s"] for c in cases if c["impl"] == BASELINE), None)
        cases.sort(key=lambda c: (c["impl"] != BASELINE, c["impl"]))
        for c in cases:
            c["time_vs_torch"] = c["median_s"] / base if base else None
            out.append(c)
    return out


def summary(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op (the group's first word) and impl other than torch: the geometric mean, min and max of time_vs_torch."""
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in table:
        if r["impl"] != BASELINE and r["time_vs_torch"]:
            by[(r["group"].split()[0] + " " + r["group"].split()[-1], r["impl"])].append(r["time_vs_torch"])
    return [
        {
            "op": op,
            "impl": impl,
            "cases": len(v),
            "geomean": math.exp(sum(map(math.log, v)) / len(v)),
            "min": min(v),
            "max": max(v),
        }
        for (op, impl), v in by.items()
    ]


def fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def header(data: dict[str, Any], source: str) -> list[str]:
    m = data.get("machine_info", {})
    ours = data.get("llmpar") or m.get("llmpar", {})
    cpu = m.get("cpu", {})
    commit = data.get("commit_info", {})
    gpus = ", ".join(ours.get("gpus") or []) or "none"
    threads = ours.get("torch_threads")
    return [
        f"- source: `{source}`",
        f"- command: `{data.get('command', 'pytest bench/ --benchmark-only')}`",
        f"- date: {data.get('datetime', '?')}",
        f"- machine: {cpu.get('brand_raw') or ours.get('cpu', '?')} ({cpu.get('count', ours.get('cores', '?'))} cores"
        + (f", torch threads: {threads}" if threads else "")
        + f"), GPU: {gpus}, {m.get('system', '')} "
        f"{m.get('machine', '')}",
        f"- versions: python {m.get('python_version', '?')}, torch {ours.get('torch', '?')}, triton "
        f"{ours.get('triton', '?')}, llmpar {ours.get('llmpar', '?')}, pytest-benchmark {data.get('version', '?')} "
        f"(commit {str(commit.get('id', '?'))[:7]}{', with local changes' if commit.get('dirty') else ''})",
        "- time vs torch: the case's median / the torch case's median in the same group (< 1: faster than torch); "
        "cases ran one after another, not interleaved (the bench/*.py scripts interleave)",
    ]


def render(data: dict[str, Any], *, source: str = "", title: str = "llmpar op micro-benchmarks") -> str:
    table = rows(data)
    lines = [f"# {title}", "", *header(data, source), ""]
    summ = summary(table)
    if summ:
        lines += [
            "## Summary per op and device (time vs torch)",
            "",
            "| op | impl | cases | geomean | min | max |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {s['op']} | {s['impl']} | {s['cases']} | {s['geomean']:.2f} | {s['min']:.2f} | {s['max']:.2f} |"
            for s in summ
        ]
        lines.append("")
    lines += ["## Cases", "", "| group | impl | median | IQR | rounds | time vs torch |", "|---|---|---|---|---|---|"]
    previous = None
    for r in table:
        ratio = "" if r["time_vs_torch"] is None else f"{r['time_vs_torch']:.2f}"
        cell = r["group"] if r["group"] != previous else ""
        previous = r["group"]
        lines.append(
            f"| {cell} | {r['impl']} | {fmt_time(r['median_s'])} | {fmt_time(r['iqr_s'])} | {r['rounds']} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path, *, title: str) -> Path | None:
    """Bars of time_vs_torch per case (the torch rows are 1 by definition, left out); None without matplotlib."""
    sys.path.insert(0, str(BENCH))
    from plot_results import plot_record

    bars = [
        {"case": r["group"], "impl": r["impl"], "time_vs_torch": r["time_vs_torch"]}
        for r in rows(data)
        if r["impl"] != BASELINE and r["time_vs_torch"] is not None
    ]
    return plot_record({"name": title, "rows": bars}, path)


def _source(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(BENCH.parent))
    except ValueError:
        return path.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", type=Path, help="a saved pytest-benchmark JSON")
    parser.add_argument("--latest", action="store_true", help="the newest save in bench/results/pytest-benchmark")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (and its .png beside it)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--title", default="llmpar op micro-benchmarks")
    args = parser.parse_args(argv)
    if (args.json is None) == (not args.latest):
        parser.error("give a JSON file or --latest (one of the two)")
    path = latest() if args.latest else args.json
    data = load(path)
    text = render(data, source=_source(path), title=args.title)
    if args.out is None:
        print(text, end="")
        return 0
    png = None if args.no_plot else plot(data, args.out.with_suffix(".png"), title=args.out.stem)
    if png is not None:
        text += f"\n![{args.out.stem}]({png.name})\n"
    args.out.write_text(text)
    print(f"wrote {args.out}" + (f" and {png.name}" if png is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
