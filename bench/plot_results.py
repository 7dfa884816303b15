"""PNG plots of benchmark results: one ``<name>.png`` beside each ``bench/results/<name>.json`` the harness writes.

    python bench/plot_results.py                       # every bench/results/*.json that has no .png beside it
    python bench/plot_results.py --force               # redraw them all
    python bench/plot_results.py bench/results/zero_step.json --out-dir /some/where

``write_results`` (bench/harness.py) calls :func:`plot_record` itself, so new results come with their plot; this
script draws the ones written before, and adds the image link to their ``.md`` when it is missing.
What is drawn, from the record's rows (a dict per row, as the harness writes them):
- the record's own ``plot`` spec (``write_results(curve={"x", "y", "group", "logx", "logy"})``): y against x, a line
  per group;
- otherwise one panel per kind of column present:
  ratio bars per case: numeric columns named ``speedup``, ``ratio``, ``*_ratio``, ``*_vs_*``, ``time_vs_*``,
  ``*_frac``; one horizontal bar per row (and column), a dashed line at 1; llmpar's rows blue, the baseline grey;
  measured vs formula: column pairs ``<x>_formula`` / ``<x>_measured...`` (pipeline bubble, memory estimates);
  a scaling curve: a numeric size column (``size``, ``numel``, ``params``, ``tokens``, ``dp``, ``world_size``) with
  3+ values against the first time column (``median_ms``, ``step_ms``, ...), a line per case.
Rows are labelled by the columns that tell them apart (text columns, and integer ones as ``key=value``).
Small files: 7 inches wide, 90 dpi (well under 100 KB).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DPI = 90
WIDTH_IN = 7.0
RATIO = re.compile(r"(^|_)(speedup|ratio)($|_)|(^|_)vs(_|$)|_frac$")
SIZE_COLS = ("size", "numel", "params", "tokens", "dp", "world_size")
TIME_COLS = ("median_ms", "step_ms", "median_us", "median_s", "t_step_ms", "time_ms")
NOT_LABELS = {"repeats", "baseline", "rounds"}
MAX_LABEL = 56
NUMBERS = re.compile(r"^[\d.,\s+-]*\d[\d.,\s+-]*$")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols]
    return cols


def ratio_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Columns holding ratios (speedup, time vs a baseline, fractions): numeric in every row that has them."""
    return [
        c
        for c in _columns(rows)
        if RATIO.search(c) and all(_number(r[c]) for r in rows if c in r) and any(c in r for r in rows)
    ]


def formula_pairs(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(measured column, formula column) pairs: ``<x>_formula`` with the first numeric ``<x>_measured...``."""
    cols = _columns(rows)
    pairs = []
    for c in cols:
        if c.endswith("_formula"):
            stem = c[: -len("_formula")]
            measured = [
                m for m in cols if m.startswith(stem + "_measured") and all(_number(r[m]) for r in rows if m in r)
            ]
            if measured:
                pairs.append((measured[0], c))
    return pairs


def size_curve(rows: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(x, y) for a scaling curve: a numeric size column with 3+ values and a time column, or None."""
    cols = _columns(rows)
    y = next((c for c in TIME_COLS if c in cols), None)
    for x in SIZE_COLS:
        values = {r[x] for r in rows if x in r and _number(r[x])}
        if y is not None and len(values) >= 3:
            return x, y
    return None


def label_columns(rows: list[dict[str, Any]], skip: set[str]) -> list[str]:
    """Columns that tell rows apart: text (not numbers written as text), flags or small integers that vary across rows,
    each only once (``case`` and ``name`` holding the same values count once)."""
    out, seen = [], set()
    for c in _columns(rows):
        values = [r.get(c) for r in rows]
        if c in skip or c in NOT_LABELS:
            continue
        if not all(v is None or isinstance(v, (str, int)) for v in values):  # text, integers, flags
            continue
        if any(isinstance(v, str) and NUMBERS.match(v) for v in values):
            continue  # per-stage figures as text ("0.61 0.49"): data, not a name
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if ints and max(abs(v) for v in ints) >= 100_000:
            continue  # byte counts and the like: measurements, not names
        key = tuple(str(v) for v in values)
        if len(set(key)) > 1 and key not in seen:
            seen.add(key)
            out.append(c)
    return out


def row_label(row: dict[str, Any], cols: list[str]) -> str:
    """The row's values in ``cols``: text as it is, integers as ``key=value``, a flag as its name when true."""
    parts = []
    for c in cols:
        v = row.get(c)
        if v is None or v is False:
            continue
        parts.append(v if isinstance(v, str) else c if v is True else f"{c}={v}")
    text = " · ".join(parts) or "row"
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "…"


def _color(row: dict[str, Any], value: float) -> str:
    """Grey for the baseline, blue for llmpar's rows (any text value naming it), orange for the others."""
    if row.get("baseline") is True or ("baseline" not in row and value == 1.0):
        return "0.6"
    return "tab:blue" if any(isinstance(v, str) and "llmpar" in v.lower() for v in row.values()) else "tab:orange"


def _bars(ax, rows, cols, labels, *, title: str, reference: float | None = 1.0) -> None:
    """Horizontal bars, one per row (and column). Values spanning more than 20x: a log axis, the bars starting at the
    reference (1), so a case faster than the baseline points left and a slower one right."""
    import numpy as np

    y = np.arange(len(rows))
    k = len(cols)
    h = 0.8 / k
    finite = [float(r[c]) for r in rows for c in cols if _number(r.get(c)) and float(r[c]) > 0]
    log = bool(finite) and max(finite) / min(finite) > 20
    start = reference if log and reference is not None else 0.0
    for j, col in enumerate(cols):
        vals = [r.get(col, float("nan")) for r in rows]
        vals = [float("nan") if v is None else float(v) for v in vals]
        colors = [_color(r, v) for r, v in zip(rows, vals)] if k == 1 else None
        ax.barh(
            y - 0.4 + h * (j + 0.5),
            [v - start for v in vals],
            left=start,
            height=h,
            color=colors,
            label=col if k > 1 else None,
        )
        for yy, v in zip(y - 0.4 + h * (j + 0.5), vals):
            if v == v:  # not NaN
                left = v < start
                ax.text(
                    v, yy, f"{v:.3g} " if left else f" {v:.3g}", va="center", ha="right" if left else "left", fontsize=6
                )
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    if reference is not None:
        ax.axvline(reference, color="k", linestyle="--", linewidth=0.8)
    ax.set_xlabel(", ".join(cols) + (" (log scale)" if log else ""), fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.12)
    if k > 1:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _curve(ax, rows, x, ys, group, *, logx=False, logy=False, ylabel=None, title="") -> None:
    ys = [ys] if isinstance(ys, str) else list(ys)
    if group is None:
        groups: list[Any] = [None]
    elif isinstance(group, str):
        groups = sorted({r.get(group) for r in rows}, key=str)
    else:  # several columns: the label of each row
        groups = sorted({row_label(r, group) for r in rows})
    for g in groups:
        if g is None:
            sel = rows
        elif isinstance(group, str):
            sel = [r for r in rows if r.get(group) == g]
        else:
            sel = [r for r in rows if row_label(r, group) == g]
        for y in ys:
            pts = sorted((r[x], r[y]) for r in sel if _number(r.get(x)) and _number(r.get(y)))
            if pts:
                label = " ".join(str(s) for s in (g, y if len(ys) > 1 else None) if s is not None) or y
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    ax.set_xlabel(x, fontsize=8)
    ax.set_ylabel(ylabel or ", ".join(ys), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _panels(record: dict[str, Any]) -> list[tuple[str, Any, float]]:
    """(kind, spec, height in inches) of each panel to draw for ``record``."""
    rows = [r for r in record.get("rows", []) if isinstance(r, dict)]
    spec = record.get("plot")
    if isinstance(spec, dict) and "x" in spec and "y" in spec:
        return [("spec", spec, 4.0)]
    panels: list[tuple[str, Any, float]] = []
    ratios = ratio_columns(rows)
    pairs = formula_pairs(rows)
    bar_height = 0.9 + 0.19 * len(rows) * max(1, min(len(ratios), 3)) ** 0.5
    if ratios:
        panels.append(("ratios", ratios, bar_height))
    if pairs:
        panels.append(("pairs", pairs, 0.9 + 0.19 * len(rows) * len(pairs) ** 0.5))
    curve = size_curve(rows)
    if curve is not None:
        panels.append(("curve", curve, 3.2))
    return panels


def plot_record(record: dict[str, Any], path: str | Path, *, dpi: int = DPI) -> Path | None:
    """Draw ``record`` (a results JSON's content) into ``path``; None when nothing in it can be plotted or
    matplotlib is missing."""
    panels = _panels(record)
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in record.get("rows", []) if isinstance(r, dict)]
    name = str(record.get("name", Path(path).stem))
    heights = [h for _, _, h in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(WIDTH_IN, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False
    )
    for ax, (kind, spec, _) in zip(axes[:, 0], panels):
        if kind == "spec":
            _curve(
                ax,
                rows,
                spec["x"],
                spec["y"],
                spec.get("group"),
                logx=spec.get("logx", False),
                logy=spec.get("logy", False),
                ylabel=spec.get("ylabel"),
                title=spec.get("title", name),
            )
        elif kind == "ratios":
            labels = [row_label(r, label_columns(rows, set(spec))) for r in rows]
            _bars(ax, rows, spec[:3], labels, title=f"{name}: ratios per case")
        elif kind == "pairs":
            cols = [c for pair in spec for c in pair]
            labels = [row_label(r, label_columns(rows, set(cols))) for r in rows]
            _bars(ax, rows, cols, labels, title=f"{name}: measured vs formula", reference=None)
        else:
            x, y = spec
            group = label_columns(rows, {x, y}) or None
            _curve(ax, rows, x, y, group, logx=True, title=f"{name}: {y} vs {x}")
    fig.tight_layout()
    out = Path(path)
    _save_small(fig, out, dpi)
    plt.close(fig)
    return out


def _save_small(fig, path: Path, dpi: int) -> None:
    """PNG with a 128-colour palette (a third of the RGBA size, no visible change for bars, lines and text)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    try:
        from PIL import Image
    except ImportError:  # matplotlib needs pillow, but keep the plain file if it is not importable
        path.write_bytes(buf.getvalue())
        return
    buf.seek(0)
    with Image.open(buf) as img:
        img.convert("RGB").quantize(colors=128).save(path, optimize=True)


def link_markdown(md: Path, png: Path) -> bool:
    """Append ``![name](png)`` to ``md`` when it exists and does not show the image yet; True when appended."""
    if not md.exists():
        return False
    text = md.read_text()
    if f"]({png.name})" in text:
        return False
    md.write_text(text.rstrip("\n") + f"\n\n![{png.stem}]({png.name})\n")
    return True


def plot_json(path: Path, *, force: bool = False, out_dir: Path | None = None) -> Path | None:
    """Plot one results JSON into ``<out_dir or its folder>/<stem>.png``; skips an existing PNG unless ``force``."""
    png = (out_dir or path.parent) / f"{path.stem}.png"
    if png.exists() and not force:
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"plot_results: skipping {path.name}: {e}", file=sys.stderr)
        return None
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
        return None  # not a harness results file (a pytest-benchmark save, say)
    return plot_record(record, png)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="results JSON files (default: bench/results/*.json)")
    parser.add_argument("--force", action="store_true", help="redraw plots that exist already")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the PNGs go (default: beside each JSON)")
    parser.add_argument("--no-link", action="store_true", help="leave the .md files alone")
    args = parser.parse_args(argv)
    files = args.files or sorted(RESULTS_DIR.glob("*.json"))
    for path in files:
        png = plot_json(path, force=args.force, out_dir=args.out_dir)
        if png is None:
            continue
        linked = not args.no_link and args.out_dir is None and link_markdown(path.with_suffix(".md"), png)
        link = f", linked from {path.stem}.md" if linked else ""
        print(f"wrote {png.name} ({png.stat().st_size // 1024} KB){link}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
