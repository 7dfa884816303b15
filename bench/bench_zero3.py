"""Benchmark: one training step of a small GPT at dp=2 on CPU/gloo with ZeRO stage 3, side by side in one run:
llmpar stage 3 (with / without offload_optimizer) vs DeepSpeed stage 3 (same configs) vs torch FSDP2 (``fully_shard``
per block + root). The config leaves ``stage3_max_reuse_distance`` at DeepSpeed's default (1e9): both keep this model
gathered from forward to backward (one all-gather of psi and one reduce-scatter a step, counted on both);
``llmpar_s3_lean`` sets it to 0: every unit gathered again for backward, the memory-lean form (~1.5 psi gathered
here, the prefetch window of 2M elements kept). Timing as in ``bench_zero.py`` (order rotated per repeat, barrier,
slowest rank, median).
Two floors beside them: ``no_comm`` (each rank trains alone: the compute every case pays) and ``comm_only_s3`` /
``comm_only_s2`` (the step's bytes alone, one flat gloo collective per psi); no_comm + comm_only is what a step
costs when nothing overlaps.

    python bench/bench_zero3.py                       # launches torchrun itself
    python bench/bench_zero3.py --d-model 256 --n-layer 4 --repeats 5

Results: bench/results/zero3_step.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import (  # noqa: E402
    add_step_args,
    batch,
    comm_only_step,
    deepspeed_step,
    fsdp2_step,
    gpt,
    llmpar_step,
    no_comm_step,
    time_cases,
    torchrun,
    zero_config,
)

CASES = (
    "llmpar_s3",
    "llmpar_s3_lean",
    "llmpar_s2",
    "deepspeed_s3",
    "fsdp2",
    "llmpar_s3_offload",
    "deepspeed_s3_offload",
    "no_comm",
    "comm_only_s3",
    "comm_only_s2",
)
GOALS = {"llmpar_s3": ("deepspeed_s3", 0.67), "llmpar_s3_offload": ("deepspeed_s3_offload", 0.67)}


def _cfg(args, offload: bool, lean: bool = False) -> dict:
    cfg = zero_config(args, 3)
    cfg["zero_optimization"].update(stage3_prefetch_bucket_size=args.bucket, stage3_param_persistence_threshold=0)
    if lean:  # every unit gathered again for backward (but those it starts with): 3 psi - the prefetch window
        cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def build(case: str, args):
    inp, tgt = batch(args)
    model = gpt(args)
    if case == "llmpar_s2":  # llmpar's own ZeRO-2 on the same model: what stage 3's extra all-gathers cost
        return llmpar_step(model, zero_config(args, 2), inp, tgt)
    if case.startswith("llmpar"):
        return llmpar_step(model, _cfg(args, case.endswith("offload"), case.endswith("lean")), inp, tgt)
    if case.startswith("deepspeed"):
        return deepspeed_step(model, _cfg(args, case.endswith("offload")), inp, tgt)
    if case == "no_comm":  # the floor: no collective at all
        return no_comm_step(model, args, inp, tgt)
    if case.startswith("comm_only"):  # the bytes alone: 3 psi (stage 3) / 2 psi (stage 2), one collective each
        return comm_only_step(model, 2 if case.endswith("s3") else 1)
    return fsdp2_step(model, args, inp, tgt)


def timing_run(args) -> None:
    from harness import write_results

    def report(timings, world, n_params):
        rows = []
        for name in (c for c in args.cases if c in timings):
            row = {"case": name, **timings[name].row()}
            for other in ("llmpar_s2", "deepspeed_s3", "deepspeed_s3_offload", "fsdp2", "no_comm"):
                if other in timings and other != name:
                    row[f"time_vs_{other}"] = timings[name].median_s / timings[other].median_s
            rows.append(row)
        meta = {
            "model": f"GPT d_model={args.d_model} n_layer={args.n_layer} seq={args.seq} ({n_params / 1e6:.1f}M)",
            "batch": f"micro {args.micro} x seq {args.seq} per rank, dp={world}",
            "bf16": args.bf16,
            "goals": "llmpar_s3 <= 1.15 x llmpar_s2, <= 0.6 x deepspeed_s3 and fsdp2; llmpar_s3_offload "
            "<= 0.67 x deepspeed_s3_offload",
            "threads_per_rank": torch.get_num_threads(),
        }
        print(json.dumps(rows, indent=1))
        if not args.no_write:
            write_results("zero3_step", rows, meta)

    time_cases(args, build, report)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    add_step_args(p, n_head=4, bucket=2_000_000, repeats=6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if "RANK" in os.environ:
        timing_run(args)
        return
    print(torchrun(__file__, sys.argv[1:], args.nproc))


if __name__ == "__main__":
    main()
