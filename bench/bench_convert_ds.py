"""Peak memory of ``llmpar checkpoint convert --to deepspeed | universal`` (streamed), each run in a fresh process.

    python bench/bench_convert_ds.py                  # --mb 512: a ~0.5 GB-per-state synthetic checkpoint
    python bench/bench_convert_ds.py --mb 256 --rounds 1

The source: a synthetic DeepSpeed *universal* checkpoint (``zero/<param>/fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt``, ``step.pt``, ``optimizer_state.pt``, ``mp_rank_00_model_states.pt``, written by hand as
``ds_to_universal`` writes them) of ``--mb`` MB of fp32 weights per state (three states: ~3x on disk), in a
Llama-like mix of one large embedding-sized tensor (3/8 of the weights), square matrices and small vectors. Each
conversion runs ``convert.convert`` in a fresh Python process: wall time, peak RSS (``ru_maxrss``) and the
peak above the RSS after imports ("rise"), against the largest tensor and against the bound "2 x the largest tensor
+ the largest output file" (a ZeRO 1-2 output's ``mp_rank_00_model_states.pt`` holds every param whole, as
DeepSpeed's does: it is that output file). For scale: the writer before streaming held every param's master and two
moments whole (3 x the weights, shown as "held whole"), plus a copy of each output file's bytes.

Results: bench/results/checkpoint_convert_ds.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

CHILD = r"""
import json, os, resource, sys, time
from llmpar.checkpoint import convert
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
base = rss()
src, dst, to, stage, dp = sys.argv[1:6]
t0 = time.perf_counter()
written = convert.convert(src, dst, to=to, stage=int(stage) or None, dp=int(dp) or None)
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
big = max(os.path.getsize(p) for p in written)
print(json.dumps({"wall_s": wall, "import_rss": base, "peak_rss": peak, "largest_output": big,
                  "files": len(written)}))
"""


def _shapes(mb: int) -> dict[str, tuple[int, ...]]:
    """A Llama-like set of fp32 tensors of about ``mb`` MB: the embedding 3/8 of it, matrices, norms."""
    n = mb * (1 << 20) // 4
    hidden = 2048
    vocab = (3 * n // 8) // hidden
    out = {"embed.weight": (vocab, hidden)}
    left, i = n - vocab * hidden, 0
    while left > hidden * hidden:
        out[f"layers.{i}.w"] = (hidden, hidden)
        out[f"layers.{i}.norm"] = (hidden,)
        left -= hidden * hidden + hidden
        i += 1
    out["norm.weight"] = (hidden,)
    return out


def make_universal(path: Path, mb: int) -> dict[str, tuple[int, ...]]:
    """Write the synthetic universal checkpoint ``path/global_step5`` + ``path/latest_universal``."""
    shapes = _shapes(mb)
    d = path / "global_step5"
    zero = d / "zero"
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        (zero / name).mkdir(parents=True)
        for f in ("fp32", "exp_avg", "exp_avg_sq"):
            t = torch.randn(shape, generator=g)
            torch.save({"param": t.abs() if f == "exp_avg_sq" else t, "cat_dim": 0}, zero / name / f"{f}.pt")
        torch.save(torch.tensor(5.0), zero / name / "step.pt")
    hyper = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": [0]}
    torch.save(
        {"param_groups": [hyper], "partition_count": [2], "dynamic_loss_scale": False, "overflow": False},
        zero / "optimizer_state.pt",
    )
    torch.save(
        {
            "module": {},
            "buffer_names": [],
            "param_shapes": [{n: torch.Size(s) for n, s in shapes.items()}],
            "frozen_param_shapes": {},
            "shared_params": {},
            "lr_scheduler": None,
            "global_steps": 5,
            "global_samples": 40,
            "skipped_steps": 0,
            "dp_world_size": 2,
            "mp_world_size": 1,
            "ds_config": {},
            "ds_version": "0.19.8",
        },
        d / "mp_rank_00_model_states.pt",
    )
    (path / "latest_universal").write_text("global_step5")
    return shapes


def _child(src: Path, dst: Path, to: str, stage: int, dp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(dst), to, str(stage), str(dp)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="MB of fp32 weights per state")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    load_before = os.getloadavg()  # the machine is shared: its load is recorded beside the figures
    work = Path(tempfile.mkdtemp(prefix="bench_convert_ds_"))
    try:
        shapes = make_universal(work / "src", args.mb)
        largest = max(math.prod(s) for s in shapes.values()) * 4
        weights = sum(math.prod(s) for s in shapes.values()) * 4
        rows = []
        for label, to, stage, dp in (
            ("--to deepspeed --stage 2 --dp 2", "deepspeed", 2, 2),
            ("--to deepspeed --stage 3 --dp 4", "deepspeed", 3, 4),
            ("--to universal", "universal", 0, 0),
        ):
            runs = []
            for _ in range(args.rounds):
                dst = work / "out"
                runs.append(_child(work / "src", dst, to, stage, dp))
                shutil.rmtree(dst)
            best = min(runs, key=lambda r: r["peak_rss"])
            rise = best["peak_rss"] - best["import_rss"]
            bound = 2 * largest + best["largest_output"]
            rows.append(
                {
                    "conversion": label,
                    "wall_s": min(r["wall_s"] for r in runs),
                    "peak_rss": best["peak_rss"],
                    "rise": rise,
                    "largest_output": best["largest_output"],
                    "rise_over_largest": rise / largest,
                    "rise_over_bound": rise / bound,
                    "held_whole": 3 * weights,
                }
            )
            print(json.dumps(rows[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {
        "command": "python bench/bench_convert_ds.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.platform()}, torch {torch.__version__}",
        "weights_mb_per_state": weights / 2**20,
        "largest_tensor_mb": largest / 2**20,
        "rounds": args.rounds,
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint_convert_ds.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    mb = 2**20
    lines = [
        "# llmpar checkpoint convert --to deepspeed | universal: peak memory (streamed)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine']}  ",
        "Load average (1, 5, 15 min) before / after: "
        + " / ".join(", ".join(f"{x:.1f}" for x in meta["loadavg_1_5_15"][k]) for k in ("before", "after"))
        + "  ",
        f"Source: synthetic universal checkpoint, {weights / mb:.0f} MB of fp32 weights per state (x3 states), "
        f"largest tensor {largest / mb:.0f} MB; best of {args.rounds} fresh processes.",
        "",
        "| conversion | wall s | peak RSS MB | rise over imports MB | largest output file MB | rise / largest "
        "tensor | rise / (2 x largest + output file) | held whole before (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['conversion']}` | {r['wall_s']:.1f} | {r['peak_rss'] / mb:.0f} | {r['rise'] / mb:.0f} | "
            f"{r['largest_output'] / mb:.0f} | {r['rise_over_largest']:.2f} | {r['rise_over_bound']:.2f} | "
            f"{r['held_whole'] / mb:.0f} |"
        )
    (RESULTS / "checkpoint_convert_ds.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
