"""DeepSpeed vs llmpar on the same DeepSpeed script (tests/data/cifar_script.py, DeepSpeed's cifar10 example shape),
2 CPU ranks, ZeRO stages 0-3, run one after the other: start-up time (script start to the end of initialize, the
launcher's import of the library included in the wall time), step time, and how far apart the losses are.

    python bench/bench_ds_scripts.py            # --stages 0 1 2 3 --steps 30

Results: bench/results/ds_scripts.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    import test_deepspeed_scripts as scripts

    from harness import write_results

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    scripts.STEPS = args.steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            got = {}
            for which in ("deepspeed", "llmpar"):
                t0 = time.perf_counter()
                losses, _ = scripts.run_script(which, stage, Path(tmp))
                wall = time.perf_counter() - t0
                data = json.loads((Path(tmp) / f"{which}_s{stage}.json").read_text())
                got[which] = (losses, wall, data["init_s"], data["step_s"])
            (ds, ds_wall, ds_init, ds_step), (ll, ll_wall, ll_init, ll_step) = got["deepspeed"], got["llmpar"]
            rel = max(abs(a - b) / abs(b) for a, b in zip(ll, ds))
            rows.append(
                {
                    "stage": stage,
                    "deepspeed_wall_s": ds_wall,
                    "llmpar_wall_s": ll_wall,
                    "deepspeed_init_s": ds_init,
                    "llmpar_init_s": ll_init,
                    "deepspeed_step_ms": 1e3 * ds_step,
                    "llmpar_step_ms": 1e3 * ll_step,
                    "step_time_ratio": ll_step / ds_step,
                    "max_rel_loss_diff": rel,
                    "first_loss": ll[0],
                    "last_loss": ll[-1],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    meta = {
        "script": "tests/data/cifar_script.py (CNN 62k params, CIFAR-shaped random data), 2 ranks, gloo, fp32, "
        f"{args.steps} optimizer steps of micro 8 x accumulation 2 per rank",
        "launch": "torchrun --nproc_per_node 2 tests/data/pipe_launch.py deepspeed|llmpar (the script's one "
        "'import deepspeed' line swapped for llmpar)",
        "wall": "whole torchrun job, imports included",
        "init": "script start -> initialize returned",
    }
    if not args.no_write:
        write_results("ds_scripts", rows, meta)


if __name__ == "__main__":
    main()
