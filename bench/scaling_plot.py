"""The figures of bench_scaling.py: per model size (a column of panels), against dp, a line per contender with one
colour per family (DDP black, llmpar blues, FSDP2 orange, DeepSpeed greens) and one marker per ZeRO stage:

    "time":  step time (ms, log scale)
    "state": per-rank state (MB) measured, and the planner's estimate for llmpar (dotted, x markers)
    "ratio": measured state / planner estimate (1 = the estimate), llmpar's offload and stage-0 runs included

The harness's single-curve plot cannot tell 16 lines apart; these replace it (``bench_scaling.write``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STYLE = {
    "ddp": ("black", "o", "-"),
    "llmpar_s0": ("#08306b", "D", "-"),
    "llmpar_s1": ("#2171b5", "o", "-"),
    "llmpar_s2": ("#4292c6", "s", "-"),
    "llmpar_s3": ("#6baed6", "^", "-"),
    "llmpar_s1_offload": ("#9e9ac8", "o", "-."),
    "llmpar_s2_offload": ("#807dba", "s", "-."),
    "llmpar_s3_offload": ("#54278f", "^", "-."),
    "fsdp2": ("#fd8d3c", "^", "--"),
    "deepspeed_s1": ("#74c476", "o", "--"),
    "deepspeed_s2": ("#41ab5d", "s", "--"),
    "deepspeed_s3": ("#006d2c", "^", "--"),
}
PANELS = {
    "time": ("median_ms", "step time (ms)"),
    "state": ("state_mb", "state per rank (MB)"),
    "ratio": ("state_vs_est", "measured / estimate"),
}
MAIN = ("ddp", "llmpar_s1", "llmpar_s2", "llmpar_s3", "fsdp2", "deepspeed_s1", "deepspeed_s2", "deepspeed_s3")


def _points(rows: list[dict[str, Any]], case: str, size: str, col: str) -> tuple[list[int], list[float]]:
    pts = sorted((r["dp"], r[col]) for r in rows if r["case"] == case and r["size"] == size and col in r)
    return [p[0] for p in pts], [p[1] for p in pts]


def draw(rows: list[dict[str, Any]], path: Path, panels: tuple[str, ...], title: str) -> Path | None:
    """Draw ``panels`` (keys of PANELS) for every size of ``rows`` into ``path``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(len(panels), len(sizes), figsize=(7.0, 2.6 * len(panels) + 0.8), squeeze=False)
    for i, panel in enumerate(panels):
        col, label = PANELS[panel]
        cases = [c for c in STYLE if c in MAIN or panel == "ratio"]
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            for case in cases:
                color, marker, line = STYLE[case]
                x, y = _points(rows, case, size, col)
                if x:
                    ax.plot(x, y, color=color, marker=marker, linestyle=line, markersize=4, linewidth=1.2, label=case)
                if panel == "state" and case.startswith("llmpar"):
                    x, y = _points(rows, case, size, "est_mb")
                    ax.plot(x, y, color=color, marker="x", linestyle=":", markersize=6, linewidth=1.0)
            ax.set_yscale("log" if panel != "ratio" else "linear")
            if panel == "ratio":
                ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
            ax.set_xticks(sorted({r["dp"] for r in rows}))
            ax.set_title(f"{size} params: {label}", fontsize=8)
            ax.set_xlabel("dp", fontsize=7)
            ax.tick_params(labelsize=7)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if "state" in panels:
        from matplotlib.lines import Line2D

        handles["planner estimate (llmpar)"] = Line2D([], [], color="grey", marker="x", linestyle=":")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=6.5, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * (len(handles) // 4), 1, 0.97))
    from plot_results import DPI, _save_small  # the harness's 128-colour PNG, as for every other result

    _save_small(fig, path, DPI)
    plt.close(fig)
    return path
