"""Benchmark: ``engine.compile()`` on the demo GPT at dp=2 on CPU/gloo, eager vs compiled (inductor) training step side
by side in one run, at ZeRO-2 (the whole model one graph, the reductions in eager hooks) and ZeRO-3 (each unit a
compiled region: ``llmpar.zero.compile.compile_stage3``). Goals (issue 45): compiled <= 0.75x eager at ZeRO-2, <= 0.85x
at ZeRO-3. ``*_cpp``: ``compile_kwargs={"options": {"cpp_wrapper": True}}`` (inductor's C++ wrapper around the
graph's kernels instead of Python: less overhead per kernel, a longer compile). The compile time is the first
compiled step's time less an eager step (both ranks compile; the slower rank's). Timing as in ``bench_zero.py``
(order rotated per repeat, barrier, slowest rank, median).

    python bench/bench_compile.py                          # launches torchrun itself
    python bench/bench_compile.py --d-model 256 --n-layer 4 --repeats 8 --backend inductor

Results: bench/results/compile_cpu.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import add_step_args, batch, gpt, time_cases, torchrun, zero_config  # noqa: E402

CASES = (
    "eager_s2",
    "compiled_s2",
    "compiled_s2_cpp",
    "eager_s3",
    "compiled_s3",
    "compiled_s3_cpp",
    "compiled_s2_autograd",
)
GOALS = {
    "compiled_s2": ("eager_s2", 0.75),
    "compiled_s2_cpp": ("eager_s2", 0.75),
    "compiled_s3": ("eager_s3", 0.85),
    "compiled_s3_cpp": ("eager_s3", 0.85),
}
COMPILE_S: dict[str, float] = {}  # case -> seconds of its first (compiling) step, the slowest rank's


def build(case: str, args):
    import torch.distributed as dist

    import llmpar

    inp, tgt = batch(args)
    stage = 3 if "_s3" in case else 2
    cfg = zero_config(args, stage)
    if stage == 3:
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size=args.bucket, stage3_param_persistence_threshold=0)
    engine, _, _, _ = llmpar.initialize(model=gpt(args), config=cfg)

    def step() -> None:
        loss = engine.module.loss(engine(inp), tgt)
        engine.backward(loss)
        engine.step()

    if case.startswith("compiled"):
        kwargs = {"options": {"cpp_wrapper": True}} if case.endswith("_cpp") else None  # C++ graph wrapper
        engine.compile(backend=args.backend, compile_kwargs=kwargs, compiled_autograd_enabled=case.endswith("autograd"))
        dist.barrier()
        t0 = time.perf_counter()
        step()  # compiles (forward, backward; every region at stage 3)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        COMPILE_S[case] = float(took)
    return step


def timing_run(args) -> None:
    from harness import write_results

    def report(timings, world, n_params):
        rows = []
        for name in (c for c in args.cases if c in timings):
            eager = "eager_s3" if "_s3" in name else "eager_s2"
            row = {"case": name, **timings[name].row()}
            if eager in timings and name != eager:
                row["time_vs_eager"] = timings[name].median_s / timings[eager].median_s
                row["compile_s"] = COMPILE_S[name] - timings[eager].median_s
            if name in GOALS:
                row["goal"] = f"<= {GOALS[name][1]} x {GOALS[name][0]}"
                row["meets_goal"] = "yes" if row.get("time_vs_eager", float("inf")) <= GOALS[name][1] else "no"
            rows.append(row)
        meta = {
            "model": f"GPT d_model={args.d_model} n_layer={args.n_layer} seq={args.seq} ({n_params / 1e6:.1f}M)",
            "batch": f"micro {args.micro} x seq {args.seq} per rank, dp={world}",
            "backend": args.backend,
            "bf16": args.bf16,
            "goals": "compiled_s2 <= 0.75 x eager_s2, compiled_s3 <= 0.85 x eager_s3 (issue 45)",
            "threads_per_rank": torch.get_num_threads(),
        }
        print(json.dumps(rows, indent=1))
        if not args.no_write:
            write_results(args.name, rows, meta)

    time_cases(args, build, report)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    add_step_args(p, n_head=4, bucket=2_000_000, repeats=8)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--name", default="compile_cpu", help="results file name under bench/results/")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if "RANK" in os.environ:
        timing_run(args)
        return
    print(torchrun(__file__, sys.argv[1:], args.nproc))


if __name__ == "__main__":
    main()
