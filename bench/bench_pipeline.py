"""Pipeline schedules on CPU ranks: throughput of GPipe vs 1F1B vs interleaved 1F1B, measured bubble vs the
formula, and peak activation memory per stage (GPipe vs 1F1B).

    python bench/bench_pipeline.py                     # re-launches itself on 4 ranks (torchrun, gloo, pp=4)
    torchrun --nproc_per_node 4 bench/bench_pipeline.py --micro-batches 4 16

Per (schedule, m): a step is forward + backward of the whole batch (no optimizer); its time is the max over ranks
(harness.measure_distributed). Measured bubble per stage = 1 - (compute seconds of that stage) / (step seconds), the
mean over repeats; it counts waiting on sends and receives as idle. Activation memory: bytes autograd saved for
backward, at their peak during a step (a separate, metered step). Writes bench/results/pipeline_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="ranks (= pp) when launching itself")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 16])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b"])
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--name", default="pipeline_cpu")
    return p.parse_args()


def main() -> int:
    args = _args()
    if "RANK" not in os.environ:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.ranks),
            os.path.abspath(__file__),
            *sys.argv[1:],
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.call(cmd, env=env)

    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import llmpar
    from llmpar.models import GPT, GPTConfig
    from llmpar.pipeline import build_pipeline

    from harness import measure_distributed, write_results

    env = llmpar.init_distributed(pp=int(os.environ["WORLD_SIZE"]))
    pp = env.world_size
    cfg = GPTConfig(vocab_size=256, n_layer=args.n_layer, n_head=4, d_model=args.d_model, seq_len=args.seq_len)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    rows = []
    for m in args.micro_batches:
        for schedule in args.schedules:
            model = GPT(cfg, seed=0)
            runner = build_pipeline(model, env.mesh, GPT.loss, micro_batches=m, schedule=schedule, verbose=False)
            if env.is_main and m == args.micro_batches[0]:
                print(runner.split.format(), flush=True)
            idle = torch.zeros(pp, dtype=torch.float64)
            count = [0]

            def step() -> None:
                for p in runner.parameters():
                    p.grad = None
                runner.step(x, y)
                if count[0] >= args.warmup:
                    idle.add_(torch.tensor([s.bubble for s in runner.gather_stats()], dtype=torch.float64))
                count[0] += 1

            t = measure_distributed(step, warmup=args.warmup, repeats=args.repeats, name=schedule)
            idle /= args.repeats
            row = dict(
                schedule=schedule,
                pp=pp,
                v=runner.split.virtual_stages,
                micro_batches=m,
                step_ms=1e3 * t.median_s,
                iqr_ms=1e3 * t.iqr_s,
                tokens_per_s=args.batch * args.seq_len / t.median_s,
                bubble_formula=runner.bubble_formula(),
                bubble_measured_mean=float(idle.mean()),
                bubble_measured_per_stage=" ".join(f"{v:.2f}" for v in idle.tolist()),
            )
            if schedule in ("gpipe", "1f1b"):  # activation memory, in a separate metered step
                metered = build_pipeline(
                    GPT(cfg, seed=0),
                    env.mesh,
                    GPT.loss,
                    micro_batches=m,
                    schedule=schedule,
                    verbose=False,
                    track_memory=True,
                )
                metered.step(x, y)
                stats = metered.gather_stats()
                row["in_flight_per_stage"] = " ".join(str(s.peak_in_flight) for s in stats)
                row["act_MiB_per_stage"] = " ".join(f"{s.peak_activation_bytes / 2**20:.1f}" for s in stats)
            rows.append(row)
            if env.is_main:
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    if env.is_main:
        for m in args.micro_batches:
            same_m = [r for r in rows if r["micro_batches"] == m]
            base = next((r for r in same_m if r["schedule"] == "gpipe"), same_m[0])
            for r in rows:
                if r["micro_batches"] == m:
                    r["speedup_vs_gpipe"] = base["step_ms"] / r["step_ms"]
        meta = dict(
            model=f"GPT n_layer={args.n_layer} d_model={args.d_model} seq_len={args.seq_len} fp32",
            batch=args.batch,
            ranks=pp,
            backend=env.backend,
            threads_per_rank=torch.get_num_threads(),
            cpus=os.cpu_count(),
        )
        paths = write_results(args.name, rows, meta)
        print("written:", ", ".join(str(p) for p in paths.values()))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
