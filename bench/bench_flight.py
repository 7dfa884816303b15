"""Benchmark: what the flight recorder (``llmpar.distributed.flight``) costs per collective and per training step.

    torchrun --nproc_per_node 2 bench/bench_flight.py            # CPU / gloo
    torchrun --nproc_per_node 2 bench/bench_flight.py --repeats 40 --batch-size 8

Measured, max over ranks:
* the recorder's bookkeeping alone: ``RECORDER.start`` + ``end`` of one all-reduce, as ``collectives.all_reduce``
  calls it (from one frame inside ``llmpar/distributed``, so the call-site walk takes one step), per call;
* an all-reduce of 1024 float32 with the recorder on (256 entries) vs off, interleaved;
* the demo step of ``llmpar train`` (GPT 2 layers x d_model 128, seq 128, micro batch 16 per rank, ZeRO-2, dp=2):
  collectives per step, step time with the recorder on vs off, and the bookkeeping's share of a step
  (collectives per step x cost per collective / step time).
Results: bench/results/flight_recorder.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llmpar  # noqa: E402
from llmpar.distributed import all_reduce, flight  # noqa: E402
from llmpar.models import GPT, GPTConfig  # noqa: E402

from harness import compare_distributed, markdown_table, write_results  # noqa: E402


def _bookkeeping_ns(pg: dist.ProcessGroup, calls: int) -> float:
    """ns per start + end, called through a function compiled as if it lived in llmpar/distributed (one frame to
    walk, as from ``collectives.all_reduce``); best of 5 rounds."""
    t = torch.ones(1024)
    scope: dict = {"RECORDER": flight.RECORDER, "end": flight.end, "pg": pg, "t": t}
    code = compile(
        "def inside(n):\n    for _ in range(n):\n        end(RECORDER.start(pg, 'all_reduce', t, 'x'))\n",
        flight.__file__.replace("flight.py", "collectives.py"),
        "exec",
    )
    exec(code, scope)  # noqa: S102 - a loop whose frames the recorder sees as llmpar/distributed's
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        scope["inside"](calls)
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e9


def _demo_step(batch: int, seq: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=128, seq_len=seq), seed=0)
    engine, *_ = llmpar.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": batch,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        },
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, 256, (batch, seq), generator=g)
    y = torch.randint(0, 256, (batch, seq), generator=g)

    def step() -> None:
        engine.backward(model.loss(engine(x), y))
        engine.step()

    return step


def _measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    pg = dist.group.WORLD
    rows: list[dict] = []
    flight.RECORDER.configure(256)
    mine = torch.tensor([_bookkeeping_ns(pg, args.calls)], dtype=torch.float64)
    all_reduce(mine, pg, op="max")
    ns = float(mine)
    rows.append({"what": "recorder bookkeeping (start + end), per collective", "median_us": ns / 1e3})

    t = torch.randn(1024)

    def switched(size: int, fn):
        def run() -> None:
            flight.RECORDER.configure(size)
            fn()

        return run

    cases = compare_distributed(
        {"on (256)": switched(256, lambda: all_reduce(t, pg)), "off": switched(0, lambda: all_reduce(t, pg))},
        group=pg,
        repeats=args.repeats,
        number=50,
    )
    for name, timing in cases.items():
        rows.append(
            {
                "what": f"all-reduce of 1024 float32, recorder {name}",
                "median_us": timing.median_s * 1e6,
                "ratio": timing.median_s / cases["off"].median_s,
            }
        )

    step = _demo_step(args.batch_size, args.seq_len)
    flight.RECORDER.configure(256)
    step()
    before = len(flight.RECORDER.entries)
    step()
    per_step = len(flight.RECORDER.entries) - before
    cases = compare_distributed(
        {"on (256)": switched(256, step), "off": switched(0, step)}, group=pg, repeats=args.repeats
    )
    base = cases["off"].median_s
    for name, timing in cases.items():
        rows.append(
            {
                "what": f"demo step (GPT 2x128, seq {args.seq_len}, micro batch {args.batch_size}, ZeRO-2), "
                f"recorder {name}",
                "median_us": timing.median_s * 1e6,
                "ratio": timing.median_s / base,
            }
        )
    share = per_step * ns * 1e-9 / base
    rows.append(
        {
            "what": f"bookkeeping share of the step ({per_step} collectives x {ns:.0f} ns)",
            "median_us": per_step * ns / 1e3,
            "ratio": share,
        }
    )
    return rows, {"collectives_per_step": per_step, "ns_per_collective": ns, "share_of_step": share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows, summary = _measure(args)
    if dist.get_rank() == 0:
        print(markdown_table(rows))
        print(summary)
        write_results(
            "flight_recorder", rows, {"dp": dist.get_world_size(), "backend": "gloo", **summary}, out_dir=args.out
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
