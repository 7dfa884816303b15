"""Benchmark: what the tensor-parallel agreement checks cost.

    torchrun --nproc_per_node 2 bench/bench_tp_checks.py            # CPU / gloo
    torchrun --nproc_per_node 2 bench/bench_tp_checks.py --tokens 4096 --d-model 512 --vocab 32001

Timed, side by side, max over ranks:
* the input-shape check of a linear layer (``_agree.ShapeGuard.check``): a shape new to the layer (one all-gather of
  9 int64 per rank) vs a shape it already agreed on (a set lookup), and a ColumnParallelLinear forward with its
  guard vs with the guard stubbed out;
* a VocabParallelEmbedding forward + backward, which agrees on the id-range flag and the ids' shape in one
  fixed-size exchange before its reduction (an all-gather of 10 int64 per rank, every call), vs the same lookup with
  a plain all-reduce and no check (the layer before the checks).
Results: bench/results/tp_checks.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, reduce_from_tensor_region  # noqa: E402
from llmpar.tensor_parallel._agree import ShapeGuard  # noqa: E402

from harness import compare_distributed, markdown_table, write_results  # noqa: E402


class _NoGuard:
    def check(self, shape, group) -> None:
        return None


def _unchecked_embedding(emb: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """The lookup without the checks: local rows, zeros elsewhere, summed by a plain all-reduce."""
    outside = (ids < emb.vocab_start) | (ids >= emb.vocab_end)
    local = (ids - emb.vocab_start).masked_fill(outside, 0)
    out = F.embedding(local, emb.weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tensor_region(out, emb.group)


def _measure(args: argparse.Namespace) -> list[dict]:
    g = dist.group.WORLD
    torch.manual_seed(0)
    B, T, d = 8, args.tokens // 8, args.d_model
    rows = []

    shape = (B, T, d)
    warm = ShapeGuard("bench")
    warm.check(shape, g)
    t = compare_distributed(
        {
            "new shape (all-gather)": lambda: ShapeGuard("bench").check(shape, g),
            "agreed shape (cached)": lambda: warm.check(shape, g),
        },
        group=g,
        repeats=args.repeats,
        number=20,
    )
    for name, timing in t.items():
        rows.append(
            {"what": f"ShapeGuard.check, {name}", "median_us": timing.median_s * 1e6, "min_us": timing.min_s * 1e6}
        )

    col = ColumnParallelLinear(d, 4 * d, group=g)
    unguarded = ColumnParallelLinear(d, 4 * d, group=g)
    unguarded._shapes = _NoGuard()
    x = torch.randn(B, T, d)
    t = compare_distributed(
        {"guarded": lambda: col(x), "guard stubbed": lambda: unguarded(x)}, group=g, repeats=args.repeats
    )
    base = t["guard stubbed"].median_s
    for name, timing in t.items():
        rows.append(
            {
                "what": f"ColumnParallelLinear {d}->{4 * d} forward, {name}",
                "median_us": timing.median_s * 1e6,
                "min_us": timing.min_s * 1e6,
                "ratio": timing.median_s / base,
            }
        )

    emb = VocabParallelEmbedding(args.vocab, d, group=g)
    ids = torch.randint(0, args.vocab, (B, T))
    grad = torch.randn(B, T, d)

    def step(fn):
        def run():
            emb.weight.grad = None
            (fn(ids) * grad).sum().backward()

        return run

    t = compare_distributed(
        {
            "checked (fixed-size exchange first)": step(emb),
            "unchecked (plain all-reduce)": step(lambda i: _unchecked_embedding(emb, i)),
        },
        group=g,
        repeats=args.repeats,
    )
    base = t["unchecked (plain all-reduce)"].median_s
    for name, timing in t.items():
        rows.append(
            {
                "what": f"VocabParallelEmbedding {args.vocab}x{d} fwd+bwd, {name}",
                "median_us": timing.median_s * 1e6,
                "min_us": timing.min_s * 1e6,
                "ratio": timing.median_s / base,
            }
        )

    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32001)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = _measure(args)  # returns holding no process group, so that it can be destroyed cleanly
    if dist.get_rank() == 0:
        print(markdown_table(rows))
        meta = {
            "tp": dist.get_world_size(),
            "tokens": args.tokens // 8 * 8,
            "d_model": args.d_model,
            "vocab": args.vocab,
            "backend": "gloo",
        }
        write_results("tp_checks", rows, meta, out_dir=args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
