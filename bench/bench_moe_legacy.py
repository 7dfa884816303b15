"""Benchmark: DeepSpeed's legacy MoE layer, llmpar's ``llmpar.moe.layer.MoE`` against DeepSpeed's
``deepspeed.moe.layer.MoE``, forward + backward side by side on the same weights and tokens (CPU, one process).

    python bench/bench_moe_legacy.py                      # the committed figures (one thread)
    python bench/bench_moe_legacy.py --experts 8 --k 1 2 --tokens 4096 --hidden 512 --inner 1024

Timed: ``out, l_aux, _ = moe(x); (out * g).sum() + l_aux`` backward, for ``x: [tokens, H]`` (input gradient
included), both layers holding the same gate and expert weights (the expert a two-layer GELU MLP, as DeepSpeed's
examples use), gates without random draws (``use_rts=False``, ``top2_2nd_expert_sampling=False``) so both route the
same tokens; before timing the outputs are checked to agree (1e-5). ``ratio`` = median time / DeepSpeed's median
(< 1: faster; the goal is <= 0.7); ``cpu_ratio`` the same for the median process CPU time per call (one torch
thread: the work done, which a busy shared machine stretches far less than the wall time). DeepSpeed pads every
expert to its capacity (``capacity_factor * tokens * k / experts`` rows, or the busiest expert's count with
``drop_tokens=False``) and runs the experts on the padding too; llmpar runs them on the kept rows only.
Results: bench/results/moe_legacy_cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.moe.layer import MoE  # noqa: E402

from harness import compare, cpu_medians, write_results  # noqa: E402


def _layers(experts: int, k: int, hidden: int, inner: int, drop: bool, cf: float) -> dict[str, nn.Module]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))
    kw = dict(
        num_experts=experts,
        k=k,
        capacity_factor=cf,
        drop_tokens=drop,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    theirs = DeepSpeedMoE(hidden, expert, **kw)
    with torch.no_grad():  # distinct experts
        for p in theirs.deepspeed_moe.experts.parameters():
            p.normal_(0.0, 0.05)
    ours = MoE(hidden, expert, **kw)
    ours.load_state_dict(theirs.state_dict())
    return {"deepspeed": theirs, "llmpar": ours}


def _step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    def run() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out, l_aux, _ = layer(x)
        ((out * g).sum() + l_aux).backward()

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inner", type=int, default=512)
    p.add_argument(
        "--capacity-factors",
        type=float,
        nargs="+",
        default=[1.0, 2.0],
        help="capacity factors timed with drop_tokens=True (DeepSpeed pads every expert to its capacity)",
    )
    p.add_argument("--no-nodrop", action="store_true", help="skip drop_tokens=False (padding to the busiest expert)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    settings = [(True, cf) for cf in args.capacity_factors] + ([] if args.no_nodrop else [(False, 1.0)])
    for drop, cf in settings:
        for experts in args.experts:
            for k in args.k:
                layers = _layers(experts, k, args.hidden, args.inner, drop, cf)
                gen = torch.Generator().manual_seed(1)
                x = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
                g = torch.randn(args.tokens, args.hidden, generator=gen)
                with torch.no_grad():
                    ref = layers["deepspeed"](x)[0]
                    torch.testing.assert_close(layers["llmpar"](x)[0], ref, rtol=1e-5, atol=1e-5)
                cases = {name: _step(layer, x, g) for name, layer in layers.items()}
                cmp = compare(cases, baseline="deepspeed", warmup=args.warmup, repeats=args.repeats)
                cpu = {n: 1e3 * v for n, v in cpu_medians(cases, args.repeats, clock=time.process_time).items()}
                print(f"\n{experts} experts, k={k}, drop_tokens={drop}, cf {cf}, tokens {args.tokens}, H {args.hidden}")
                print(cmp.table())
                print("process CPU time per call (ms):", {n: round(v, 2) for n, v in cpu.items()})
                for row in cmp.rows(experts=experts, k=k, drop_tokens=drop, capacity_factor=cf, tokens=args.tokens):
                    row["ratio"] = cmp.ratio(row["name"])
                    row["ratio_of_mins"] = cmp.timings[row["name"]].min_s / cmp.timings["deepspeed"].min_s
                    row["cpu_ms"] = cpu[row["name"]]
                    row["cpu_ratio"] = cpu[row["name"]] / cpu["deepspeed"]
                    rows.append(row)
    if not args.no_write:
        import deepspeed

        meta = {
            "deepspeed": deepspeed.__version__,
            "what": "legacy MoE layer forward + backward (input gradient included), expert = Linear-GELU-Linear",
            "hidden": args.hidden,
            "inner": args.inner,
            "threads": torch.get_num_threads(),
            "goal": "llmpar <= 0.7x DeepSpeed's MoE",
        }
        paths = write_results("moe_legacy_cpu", rows, meta=meta)
        print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
