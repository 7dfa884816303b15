"""Benchmark: a TP=2 MLP block, forward + backward, compiled as one graph vs eager, side by side in one run.

    torchrun --nproc_per_node 2 bench/bench_compile_tp.py                       # CPU / gloo, inductor
    torchrun --nproc_per_node 2 bench/bench_compile_tp.py --repeats 41 --shapes 4x256x256 2x64x64
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/bench_compile_tp.py \
        --repeats 61                                                           # the committed figures

Block (x: [B, T, d]): fc (ColumnParallelLinear, d -> 4d) -> GELU -> proj (RowParallelLinear, 4d -> d); timed:
``(block(x) * w).sum().backward()`` (input gradient included), plain and sequence parallel (x: this rank's
``[B * T / tp]`` rows of the sequence-first layout). Cases, interleaved repeats, each the max over ranks:

* ``eager``: the layers as they run without torch.compile (chunked overlap off: ``comm_chunks=1``, the default);
* ``eager_funcol``: the same math through the traceable path (``llmpar.tensor_parallel._traceable``: functional
  collectives) run eagerly, which says what that path would cost if eager used it too;
* ``compiled``: ``torch.compile(step_loss, backend=..., fullgraph=True)``: the forward and the AOT backward graphs
  with the functional collectives inside (0 graph breaks is asserted before timing).

* ``compiled_reorder``: the same with inductor's ``reorder_for_compute_comm_overlap`` on (inductor only).

``ratio`` = median time / eager's (the goal: compiled <= 0.9x eager); ``ratio_min``: the same of the fastest repeats
(less sensitive to other processes on a shared machine); ``ratio_cpu``: the same of the median CPU time of a step
(``time.process_time``, this rank's threads, gloo's included, max over ranks: the work done, which other processes on
the machine barely change, while waits do not count). ``compile_s``: the first compiled call (trace + compile,
max over ranks). Results: bench/results/compile_tp.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, _traceable  # noqa: E402

from harness import compare_distributed, cpu_medians, markdown_table, write_results  # noqa: E402


def _block(d: int, sp: bool, group):
    torch.manual_seed(0)
    fc = ColumnParallelLinear(d, 4 * d, group=group, sequence_parallel=sp)
    proj = RowParallelLinear(4 * d, d, group=group, sequence_parallel=sp)
    return fc, proj


def _cases(args, batch: int, seq: int, d: int, sp: bool) -> tuple[dict, float]:
    group = dist.group.WORLD
    tp = dist.get_world_size()
    fc, proj = _block(d, sp, group)
    torch.manual_seed(1 + dist.get_rank() if sp else 1)
    shape = (batch * seq // tp, d) if sp else (batch, seq, d)
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape)

    def loss_eager(x):
        return (proj(F.gelu(fc(x))) * w).sum()

    def loss_funcol(x):
        h = _traceable.column_linear(x, fc.weight, fc.bias, fc.group, sequence_parallel=sp, reduce_input_grad=True)
        return (_traceable.row_linear(F.gelu(h), proj.weight, proj.bias, proj.group, sequence_parallel=sp) * w).sum()

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss_eager, backend=args.backend, fullgraph=True)
    t0 = time.perf_counter()
    compiled(x).backward()
    compile_s = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(compile_s, op=dist.ReduceOp.MAX)
    reordered = None
    if args.backend == "inductor":  # inductor's own compute / communication reordering (off by default)
        import torch._inductor.config as inductor_config

        def loss_reordered(x):  # another function object: its own graph, compiled with the option on
            return loss_eager(x)

        reordered = torch.compile(loss_reordered, backend="inductor", fullgraph=True)
        with inductor_config.patch(reorder_for_compute_comm_overlap=True):
            reordered(x).backward()
    breaks = sum(counters["graph_break"].values())
    if breaks:
        raise RuntimeError(f"the compiled block has {breaks} graph breaks: {dict(counters['graph_break'])}")

    def step(fn):
        def run():
            x.grad = None
            for p in (*fc.parameters(), *proj.parameters()):
                p.grad = None
            fn(x).backward()

        return run

    # the three agree before anything is timed (inductor fuses and reorders fp32 sums: ~1e-5 on sums of 1k terms;
    # tests/test_compile_tp.py checks the traced graph to 1e-6 with aot_eager)
    outs = []
    for fn in (loss_eager, loss_funcol, compiled, *([reordered] if reordered else [])):
        step(fn)()
        outs.append((x.grad.clone(), fc.weight.grad.clone(), proj.weight.grad.clone()))
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    cases = {"eager": step(loss_eager), "eager_funcol": step(loss_funcol), "compiled": step(compiled)}
    if reordered is not None:
        cases["compiled_reorder"] = step(reordered)
    return cases, float(compile_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4x256x256", "2x64x64"], help="BxTxd of x, one block each")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks on a 2-core machine: 1)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    for (batch, seq, d), sp in ((shape, sp) for shape in shapes for sp in (False, True)):
        cases, compile_s = _cases(args, batch, seq, d, sp)
        timings = compare_distributed(cases, warmup=args.warmup, repeats=args.repeats)
        cpu = cpu_medians(cases, args.repeats, clock=time.process_time)  # this process's threads, gloo's included
        cpu_t = torch.tensor([cpu[n] for n in cases], dtype=torch.float64)
        dist.all_reduce(cpu_t, op=dist.ReduceOp.MAX)
        cpu = dict(zip(cases, cpu_t.tolist()))
        base = timings["eager"].median_s
        for name, t in timings.items():
            rows.append(
                {
                    "block": f"MLP x=[{batch}, {seq}, {d}]" + (" sp" if sp else ""),
                    "case": name,
                    "median_ms": t.median_s * 1e3,
                    "iqr_ms": t.iqr_s * 1e3,
                    "min_ms": t.min_s * 1e3,
                    "ratio": t.median_s / base,
                    "ratio_min": t.min_s / timings["eager"].min_s,
                    "cpu_ms": cpu[name] * 1e3,
                    "ratio_cpu": cpu[name] / cpu["eager"],
                    "compile_s": compile_s if name == "compiled" else None,
                }
            )
    if dist.get_rank() == 0:
        print(markdown_table(rows))
        meta = {
            "tp": dist.get_world_size(),
            "backend": args.backend,
            "block": "fc d -> 4d (column), GELU, proj 4d -> d (row); sp: x is this rank's [B * T / tp, d] rows",
            "threads_per_rank": args.threads,
            "dtype": "float32",
            "goal": "compiled <= 0.9x eager",
            "process_group": "gloo",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "inductor_caches": "off" if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1" else "on",
        }
        write_results("compile_tp", rows, meta=meta)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
