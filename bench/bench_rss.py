"""Long-run memory: per-rank resident memory (RSS) of a ZeRO-3 training run at steps 50, 150 and 300 (and every
``--every`` steps), to show that nothing grows step after step (held gradients, unfreed gathered units, leaked
handles). The demo GPT on random tokens, dp=2 on CPU/gloo, through ``llmpar.initialize``.

    python bench/bench_rss.py                          # launches torchrun itself; 300 steps
    python bench/bench_rss.py --stage 2 --steps 100

Results: bench/results/rss_zero{stage}.{md,json}: RSS per rank at each mark, and the growth from step 50 to the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import batch, gpt, torchrun, zero_config  # noqa: E402


def rss_mib() -> float:
    """This process's resident set size now (Linux /proc), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _live_tensors() -> int:
    """Tensors Python still references (a leak of held grads, gathered units or handles would grow it)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def run(args) -> None:
    import torch.distributed as dist

    import llmpar

    from harness import write_results

    dist.init_process_group("gloo")
    cfg = zero_config(args, args.stage)
    if args.stage == 3:
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size=args.bucket, stage3_param_persistence_threshold=0)
    model = gpt(args)
    engine, _, _, _ = llmpar.initialize(model=model, config=cfg)
    inp, tgt = batch(args)
    marks = sorted(
        {m for m in (50, 150, args.steps) if m <= args.steps} | set(range(args.every, args.steps + 1, args.every))
    )
    seen: dict[int, tuple[float, int, int]] = {}
    losses = []
    for step in range(1, args.steps + 1):
        loss = model.loss(engine(inp), tgt)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if step in marks:
            gc.collect()
            seen[step] = (rss_mib(), len(gc.get_objects()), _live_tensors())
    mine = torch.tensor([seen[m] for m in marks], dtype=torch.float64)  # [marks, (rss, python objects, tensors)]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        rows = [
            {
                "step": m,
                **{f"rank{r}_rss_mib": round(float(t[i, 0]), 1) for r, t in enumerate(every)},
                "rank0_python_objects": int(every[0][i, 1]),
                "rank0_live_tensors": int(every[0][i, 2]),
            }
            for i, m in enumerate(marks)
        ]
        start = marks.index(50) if 50 in marks else 0
        growth = {f"rank{r}_growth_mib": round(float(t[-1, 0] - t[start, 0]), 1) for r, t in enumerate(every)}
        meta = {
            "what": f"ZeRO-{args.stage}, dp={dist.get_world_size()}, {args.steps} steps of the demo GPT "
            f"(d_model={args.d_model}, n_layer={args.n_layer}, seq={args.seq}, micro {args.micro}), fp32",
            "growth from step 50 to the end": growth,
            "loss first -> last": f"{losses[0]:.4f} -> {losses[-1]:.4f}",
            "threads_per_rank": torch.get_num_threads(),
        }
        print(json.dumps({"rows": rows, **meta}, indent=1))
        if not args.no_write:
            write_results(
                f"rss_zero{args.stage}",
                rows,
                meta,
                curve={"x": "step", "y": [k for k in rows[0] if k.endswith("_mib")], "title": "RSS per rank (MiB)"},
            )
    del engine
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--bucket", type=int, default=200_000)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if "RANK" in os.environ:
        run(args)
        return
    print(torchrun(__file__, sys.argv[1:], args.nproc))


if __name__ == "__main__":
    main()
