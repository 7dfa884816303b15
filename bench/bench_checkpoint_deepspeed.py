"""Benchmark: a DeepSpeed checkpoint read by llmpar, side by side with DeepSpeed's own tools, on one CPU machine.

    python bench/bench_checkpoint_deepspeed.py                 # torchrun (2 ranks) writes the checkpoints itself
    python bench/bench_checkpoint_deepspeed.py --d-model 512 --n-layer 8

DeepSpeed (CPU accelerator, ``torch_adam``, dp=2) trains a GPT one step at ZeRO-2 and at ZeRO-3 and saves. Then, per
checkpoint, each in a fresh process (wall time and peak RSS of that process, ``os.wait4``):

* ``llmpar checkpoint convert CKPT OUT --to hf`` (full fp32 weights as safetensors, every tensor read back and
  compared with the source);
* DeepSpeed's ``zero_to_fp32.py CKPT OUT --safe_serialization`` (the script DeepSpeed copies beside the checkpoint;
  the same output, not verified);
* ``engine.load_checkpoint`` of the checkpoint into an llmpar engine at dp=2 (the slowest rank's time).

The two tools run ``--repeats`` times each, interleaved with the order alternating; the medians are reported.

Results: bench/results/checkpoint_deepspeed.{md,json} (sizes of the checkpoints and outputs, time, peak RSS).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
        "steps_per_print": 10**9,
    }


def _model(args):
    from llmpar.models import GPT, GPTConfig

    return GPT(
        GPTConfig(vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, seq_len=16),
        seed=0,
    )


def _step(engine, args) -> None:
    import torch

    x = torch.randint(0, args.vocab, (1, 17), generator=torch.Generator().manual_seed(1))
    loss = engine.module.loss(engine(x[:, :-1]), x[:, 1:])
    engine.backward(loss)
    engine.step()


def write_checkpoints(args) -> None:
    """Under torchrun: DeepSpeed saves ZeRO-2 and ZeRO-3 checkpoints into args.dir; then llmpar loads each at dp=2
    (times to args.dir/load_times.txt)."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    import llmpar

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if args.mode == "save":
        for stage in (2, 3):
            engine, *_ = deepspeed.initialize(model=_model(args), model_parameters=None, config=_config(stage))
            _step(engine, args)
            engine.save_checkpoint(os.path.join(args.dir, f"zero{stage}"))
            del engine
        return
    lines = []
    for stage in (2, 3):
        engine, *_ = llmpar.initialize(model=_model(args), config=_config(stage))
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(os.path.join(args.dir, f"zero{stage}"))
        took = [None] * dist.get_world_size()
        dist.all_gather_object(took, time.perf_counter() - t0)
        lines.append(f"zero{stage} {max(took)}")
        del engine
    if dist.get_rank() == 0:
        Path(args.dir, "load_times.txt").write_text("\n".join(lines))


def _measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of ``cmd`` in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-3000:]}")
    return took, usage.ru_maxrss / 1024


def _size(path: str) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dir", default=None)
    p.add_argument("--repeats", type=int, default=3, help="runs of each tool per checkpoint (median kept)")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if "RANK" in os.environ:
        write_checkpoints(args)
        return
    tmp = args.dir or tempfile.mkdtemp(prefix="llmpar-bench-dsck-")
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(tmp, "ext")),
    )
    try:
        for mode in ("save", "load"):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                __file__,
                *sys.argv[1:],
                "--dir",
                tmp,
                "--mode",
                mode,
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
        loads = dict(line.split() for line in Path(tmp, "load_times.txt").read_text().splitlines())
        rows = []
        for stage in (2, 3):
            ck = os.path.join(tmp, f"zero{stage}")
            tag = Path(ck, "latest").read_text().strip()
            runs: dict[str, list[tuple[float, float]]] = {"ours": [], "theirs": []}
            for i in range(args.repeats):  # interleaved, the order alternating: drift hits both alike
                for who in ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours"):
                    cmd = (
                        [
                            sys.executable,
                            "-m",
                            "llmpar.cli",
                            "checkpoint",
                            "convert",
                            ck,
                            os.path.join(tmp, f"hf{stage}"),
                            "--overwrite",
                        ]
                        if who == "ours"
                        else [
                            sys.executable,
                            os.path.join(ck, "zero_to_fp32.py"),
                            ck,
                            os.path.join(tmp, f"ds{stage}"),
                            "--tag",
                            tag,
                            "--safe_serialization",
                        ]
                    )
                    runs[who].append(_measured(cmd, env))
            ours, theirs = (tuple(statistics.median(x) for x in zip(*runs[w])) for w in ("ours", "theirs"))
            rows.append(
                {
                    "checkpoint": f"ZeRO-{stage} dp=2",
                    "ckpt_MiB": round(_size(os.path.join(ck, tag)), 1),
                    "fp32_out_MiB": round(_size(os.path.join(tmp, f"hf{stage}")), 1),
                    "convert_s": round(ours[0], 2),
                    "zero_to_fp32_s": round(theirs[0], 2),
                    "time_vs_zero_to_fp32": round(ours[0] / theirs[0], 3),
                    "convert_rss_MiB": round(ours[1]),
                    "zero_to_fp32_rss_MiB": round(theirs[1]),
                    "rss_vs_zero_to_fp32": round(ours[1] / theirs[1], 3),
                    "llmpar_load_dp2_s": round(float(loads[f"zero{stage}"]), 2),
                }
            )
    finally:
        if args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    from harness import markdown_table, write_results

    print(markdown_table(rows))
    write_results(
        "checkpoint_deepspeed",
        rows,
        {
            "model": f"GPT d_model={args.d_model} n_layer={args.n_layer} vocab={args.vocab}",
            "repeats": args.repeats,
            "load_average": os.getloadavg()[0],
            "note": "each tool in a fresh process (median of the repeats): wall time and peak RSS (ru_maxrss) of that "
            "process, python start and imports included; convert reads every tensor it wrote back and compares "
            "it, zero_to_fp32 does not; load: engine.load_checkpoint at dp=2 (ZeRO stage as saved), slowest rank",
        },
    )


if __name__ == "__main__":
    main()
