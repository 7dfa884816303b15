"""Benchmark: one training step (forward + backward + optimizer step) of a small GPT at dp=2 on CPU/gloo, llmpar ZeRO
vs torch DDP + fused AdamW (the same bucket size) vs DeepSpeed ZeRO (same stage, same config) vs torch DDP +
ZeroRedundancyOptimizer, side by side in one run; then the peak memory of each case, each in its own fresh ranks.

    python bench/bench_zero.py                          # launches torchrun itself: timing run, then memory runs
    python bench/bench_zero.py --d-model 512 --n-layer 6 --repeats 10

Timing: per repeat, every case once (order rotated), ranks lined up by a barrier, the slowest rank's time kept;
median over repeats. Memory: max RSS of each rank minus its RSS just before the model was built (model, grads,
optimizer state, buffers, peaks), after ``--mem-steps`` steps. The contenders are built in ``baselines.py``.
Results: bench/results/zero_step.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import (  # noqa: E402
    add_step_args,
    batch,
    comm_only_step,
    ddp_step,
    ddp_zero_redundancy_step,
    deepspeed_step,
    gpt,
    llmpar_step,
    no_comm_master_step,
    no_comm_step,
    time_cases,
    torchrun,
    zero_config,
)

CASES = (
    "llmpar_s1",
    "llmpar_s2",
    "llmpar_s1_overlap",
    "llmpar_s2_overlap",
    "llmpar_s1_fresh",
    "llmpar_s2_fresh",
    "ddp",
    "deepspeed_s1",
    "deepspeed_s2",
    "ddp_zero_redundancy",
    "no_comm",
    "no_comm_master",
    "comm_only_s2",
    "comm_only_ddp",
)
LLMPAR_CASE = re.compile(r"llmpar_s(?P<stage>[0-3])(?P<overlap>_overlap)?(?P<fresh>_fresh)?")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def build(case: str, args):
    """Returns step() running one training step of ``case``."""
    inp, tgt = batch(args)
    model = gpt(args)
    named = LLMPAR_CASE.fullmatch(case)
    if named:  # llmpar_s{stage}[_overlap]: overlap_param_gather; _fresh: the reduction without its scratch pool
        return llmpar_step(
            model,
            zero_config(args, int(named["stage"]), bool(named["overlap"])),
            inp,
            tgt,
            fresh_buffers=bool(named["fresh"]),
        )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if case == "no_comm":  # the floors: compute alone (DDP's: plain fused AdamW), ZeRO's per-param bf16 step
        return no_comm_step(model, args, inp, tgt)
    if case == "no_comm_master":
        if not args.bf16:
            raise ValueError("no_comm_master is the bf16 floor (fp32 masters of a bf16 model): run it with --bf16")
        return no_comm_master_step(model, inp, tgt)
    if case.startswith("comm_only"):  # the bytes alone: ZeRO-1/2 all-gather + reduce-scatter, DDP all-reduce
        return comm_only_step(model, 1, dtype, all_reduce=case.endswith("ddp"))
    if case.startswith("deepspeed"):
        return deepspeed_step(model, zero_config(args, int(case[-1])), inp, tgt)
    if case == "ddp":
        return ddp_step(model, args, inp, tgt)
    return ddp_zero_redundancy_step(model, args, inp, tgt)


def timing_run(args) -> None:
    from harness import write_results

    def report(timings, world, n_params):
        rows = []
        for name in (c for c in args.cases if c in timings):
            t = timings[name]
            base = "deepspeed_s1" if name.startswith(("llmpar_s1", "deepspeed_s1")) else "deepspeed_s2"
            ratio = t.median_s / timings[base].median_s if base in timings else float("nan")
            vs_ddp = t.median_s / timings["ddp"].median_s if "ddp" in timings else float("nan")
            rows.append({"case": name, **t.row(), "time_vs_deepspeed_same_stage": ratio, "time_vs_ddp": vs_ddp})
        mem = json.loads(os.environ.get("ZERO_BENCH_MEM", "{}"))
        for row in rows:
            row.update(mem.get(row["case"], {}))
        meta = {
            "model": f"GPT d_model={args.d_model} n_layer={args.n_layer} seq={args.seq} ({n_params / 1e6:.1f}M params)",
            "batch": f"micro {args.micro} x seq {args.seq} per rank, dp={world}",
            "bf16": args.bf16,
            "bucket": args.bucket,
            "goal": "llmpar_s1, llmpar_s2 <= 1.0 x ddp (DDP + fused AdamW) step time",
            "fresh": "llmpar_s*_fresh: the reduction taking a fresh CPU buffer for every staging bucket, received "
            "chunk and landing shard (before llmpar.zero.scratch)",
            "threads_per_rank": torch.get_num_threads(),
        }
        print(json.dumps(rows, indent=1))
        if not args.no_write:
            write_results(args.name, rows, meta)

    time_cases(args, build, report)


def memory_run(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    before = _rss_mb()
    step = build(args.cases[0], args)
    for _ in range(args.mem_steps):
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = torch.tensor([peak - before, peak], dtype=torch.float64)
    everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, out)
    if dist.get_rank() == 0:
        print(
            "MEM "
            + json.dumps(
                {
                    "peak_rss_over_start_mb": [round(float(e[0]), 1) for e in everyone],
                    "peak_rss_mb": [round(float(e[1]), 1) for e in everyone],
                }
            )
        )
    del step
    gc.collect()
    dist.destroy_process_group()


def _torchrun(argv: list[str], nproc: int) -> str:
    return torchrun(__file__, argv, nproc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=6)
    add_step_args(p)
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--mode", choices=("all", "time", "memory"), default="all")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--name", default="zero_step", help="results file name (bench/results/NAME.md)")
    args = p.parse_args()
    if not args.bf16 and "--cases" not in sys.argv:  # fp32: DDP's compute is ZeRO's, no master floor
        args.cases = [c for c in args.cases if c != "no_comm_master"]
    if "RANK" in os.environ:
        (timing_run if args.mode == "time" else memory_run)(args)
        return
    passthrough = [a for a in sys.argv[1:] if a not in ("--mode", "all", "time", "memory")]
    if "--nproc" in passthrough:  # torchrun's own option (it would read it as an abbreviation of --nproc-per-node)
        i = passthrough.index("--nproc")
        del passthrough[i : i + 2]
    mem: dict[str, dict] = {}
    if args.mode in ("all", "memory"):
        for case in args.cases:
            base = [a for a in passthrough if a not in CASES and a != "--cases"]
            out = _torchrun([*base, "--mode", "memory", "--cases", case], args.nproc)
            line = [ln for ln in out.splitlines() if ln.startswith("MEM ")][-1]
            mem[case] = json.loads(line[4:])
            print(case, mem[case], flush=True)
    if args.mode in ("all", "time"):
        os.environ["ZERO_BENCH_MEM"] = json.dumps(mem)
        print(_torchrun([*passthrough, "--mode", "time"], args.nproc))


if __name__ == "__main__":
    main()
