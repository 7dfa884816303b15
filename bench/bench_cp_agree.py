"""Benchmark: what the context-parallel batch agreement (``llmpar.context_parallel.batch_check``) costs per step.

    torchrun --nproc_per_node 2 bench/bench_cp_agree.py                 # CPU / gloo, cp=2 (Ulysses)
    torchrun --nproc_per_node 2 bench/bench_cp_agree.py --seq-lens 1024 4096 --repeats 20

Under context parallelism the engine agrees on every forward's batch over the cp group before sharding it (each
tensor's shape and a digest of its values, one fixed-size all-gather). Measured side by side, max over ranks:
* the agreement alone (digests of ids + labels, the all-gather, the comparison), per call;
* a training step of the demo GPT (2 layers x d_model 128, micro batch 1, ZeRO-2, cp=2) with the agreement, and the
  same step with it replaced by a no-op, interleaved; the ratio is the agreement's share of a step.
Results: bench/results/cp_agree.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llmpar  # noqa: E402
import llmpar.runtime.engine as engine_module  # noqa: E402
from llmpar.context_parallel.batch_check import agree_batch  # noqa: E402
from llmpar.models import GPT, GPTConfig  # noqa: E402

from harness import compare_distributed, markdown_table, write_results  # noqa: E402


def _engine(seq: int):
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=128, seq_len=seq), seed=0)
    engine, *_ = llmpar.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "context_parallel": {"size": 2, "mode": "ulysses"},
        },
    )
    g = torch.Generator().manual_seed(7)  # the same batch on both cp ranks
    x = torch.randint(0, 256, (1, seq + 1), generator=g)
    return engine, model, x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _switched(on: bool, fn):
    def run() -> None:
        engine_module.agree_batch = agree_batch if on else (lambda *a, **k: None)
        fn()

    return run


def _measure(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for seq in args.seq_lens:
        engine, _, x, y = _engine(seq)

        def step() -> None:
            engine.backward(engine(x, y))  # under cp the engine computes the full-sequence loss
            engine.step()

        alone = compare_distributed(
            {"agreement": lambda: agree_batch(engine.context_parallel, (x, y), {}, dp_size=1, dp_rank=0)},
            repeats=args.repeats,
            number=20,
        )["agreement"]
        cases = compare_distributed(
            {"with agreement": _switched(True, step), "no-op": _switched(False, step)}, repeats=args.repeats
        )
        engine_module.agree_batch = agree_batch
        base = cases["no-op"].median_s
        rows.append(
            {
                "seq": seq,
                "what": "agreement alone (ids + labels)",
                "median_ms": alone.median_s * 1e3,
                "ratio": alone.median_s / base,
            }
        )
        for name, timing in cases.items():
            rows.append(
                {
                    "seq": seq,
                    "what": f"cp=2 step, {name}",
                    "median_ms": timing.median_s * 1e3,
                    "ratio": timing.median_s / base,
                }
            )
        engine.destroy()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = _measure(args)
    if dist.get_rank() == 0:
        print(markdown_table(rows))
        write_results(
            "cp_agree", rows, {"cp": dist.get_world_size(), "backend": "gloo", "mode": "ulysses"}, out_dir=args.out
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
