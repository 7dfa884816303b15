"""bench/harness.py: stats of repeats, side-by-side ratios in the right direction, the multi-rank max, and
well-formed JSON / markdown results (asserting orderings, never absolute timings)."""
import json
import re
import os
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
    paths = write_results("unit_case", rows, meta={"dtype": "fp32"}, out_dir=tmp_path,
                          curve={"x": "size", "y": ["median_ms"]})
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
    monkeypatch.setattr(sys, "argv", [str(root / "bench" / "bench_zero.py"), "--dir", str(scratch),
                                      f"--out={root / 'bench' / 'results'}", "--repeats", "3", "/opt/data.bin"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = harness.command_line()
    assert line == 'python bench/bench_zero.py --dir "$TMPDIR/llmpar-bench-x" --out=bench/results --repeats 3 /opt/data.bin'
    assert str(root) not in line
