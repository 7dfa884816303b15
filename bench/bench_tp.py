"""Benchmark: tensor-parallel MLP and attention blocks, llmpar vs torch's DTensor tensor parallelism, side by side,
with the exposed-communication fraction of every llmpar configuration and where the block time goes.

    torchrun --nproc_per_node 2 bench/bench_tp.py                 # CPU / gloo, the default sizes
    torchrun --nproc_per_node 2 bench/bench_tp.py --rounds 3 --repeats 41   # the committed figures

Blocks (x: [B, T, d]):  MLP  = fc (column, d -> 4d) -> GELU -> proj (row, 4d -> d)
                        attn = qkv (column, d -> 3d, head-major) -> causal SDPA over local heads -> proj (row)
llmpar: ``llmpar.tensor_parallel.parallelize``; torch: ``parallelize_module`` + ``ColwiseParallel`` /
``RowwiseParallel`` on the same module. Timed: forward + backward of ``(block(x) * w).sum()`` (input grad included).

Definitions (every time is the max over ranks of one step, medians over the interleaved repeats of a round):
* ``t_nocomm``: the same llmpar block, same path, with every collective the tensor-parallel code issues replaced
  by a local stand-in of the same shapes (an all-reduce leaves its tensor as it is, a reduce-scatter copies this
  rank's chunk, an all-gather copies the input into every slot): compute + copies + Python, no communication.
* ``exposed_comm_frac = (t_block - t_nocomm) / t_block``: the share of the block's time that communication adds,
  i.e. what is not hidden behind compute (the collectives' own cost, the waits for the other rank, the wake-ups).
* ``wait_frac``: the time each rank's thread is blocked inside the collectives' ``wait()`` over its step time (mean
  over ranks, from untimed steps run with the waits clocked).
* ``exposed_sync_only_frac = (t_sync_only - t_nocomm) / t_block``: the part of it that is the ranks meeting at all,
  from the same block with each collective replaced by its stand-in plus a 1-element all-reduce (no bytes).
* ``compute_alone``: one rank's matmuls with ``nn.Linear`` layers of this rank's shapes, no tensor parallelism.
* ``t_comm_alone``: the collectives of one step (same sizes, same chunking) issued back to back with no compute.
Results: bench/results/tp_blocks.{md,json} (vs torch), tp_overlap.{md,json} (chunks, layouts) and
tp_profile.{md,json} (where the block time goes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llmpar.tensor_parallel._overlap as tp_overlap  # noqa: E402
import llmpar.tensor_parallel.comm as tp_comm  # noqa: E402
from llmpar.distributed import all_gather_flat, all_reduce, group_rank, reduce_scatter_flat  # noqa: E402
from llmpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, parallelize  # noqa: E402

from harness import compare_distributed, markdown_table, write_results  # noqa: E402

# ----------------------------------------------------------------------------- the collectives, swapped or clocked
# every collective the tensor-parallel code issues is looked up in these two modules under these names
_TAPPED, _NAMES = (tp_overlap, tp_comm), ("all_reduce", "all_gather_flat", "reduce_scatter_flat")


class _Clocked:
    def __init__(self, handle, clock: "WaitClock") -> None:
        self.handle, self.clock = handle, clock

    def wait(self) -> None:  # a finished no-op without a handle (the local stand-ins)
        if self.handle is not None:
            t0 = time.perf_counter()
            self.handle.wait()
            self.clock.waited_s += time.perf_counter() - t0


def _local_stand_in(name: str, original, *, sync: bool = False):
    """A collective's local stand-in with the same shapes: no bytes leave the rank (``sync``: the ranks still meet
    at the same points, through a 1-element all-reduce in its place)."""

    def call(*args, async_op: bool = False, **kwargs):
        if name == "all_gather_flat":  # (output [tp * n], input [n]): the input in every slot
            out, inp = args[0], args[1]
            out.view(-1, inp.numel()).copy_(inp.view(1, -1).expand(out.numel() // inp.numel(), -1))
        elif name == "reduce_scatter_flat":  # (output [n], input [tp * n]): this rank's chunk
            out, inp, group = args[0], args[1], args[2]
            out.copy_(inp.view(-1, out.numel())[group_rank(group)])
        if sync:
            return all_reduce(torch.zeros(1), args[2] if name != "all_reduce" else args[1], async_op=async_op)
        return _Clocked(None, None) if async_op else None  # all-reduce: the tensor stays as it is

    return call


class WaitClock:
    """Adds the seconds this rank's thread spends blocked in the collectives' ``wait()`` to ``waited_s``."""

    def __init__(self) -> None:
        self.waited_s = 0.0

    def wrap(self, name: str, original):
        def call(*args, async_op: bool = False, **kwargs):
            handle = _Clocked(original(*args, async_op=True, **kwargs), self)
            if async_op:
                return handle
            handle.wait()

        return call


@contextlib.contextmanager
def swapped_collectives(make):
    """Inside the block, each tapped collective ``f`` named ``n`` is ``make(n, f)``."""
    saved = [(mod, n, getattr(mod, n)) for mod in _TAPPED for n in _NAMES]
    try:
        for mod, n, original in saved:
            setattr(mod, n, make(n, original))
        yield
    finally:
        for mod, n, original in saved:
            setattr(mod, n, original)


def no_comm(step, *, sync: bool = False):
    """``step`` with every tensor-parallel collective replaced by its local stand-in (``sync``: plus a 1-element
    all-reduce at the same point, so the ranks still wait for each other)."""
    make = functools.partial(_local_stand_in, sync=sync)

    def run():
        with swapped_collectives(make):
            step()

    return run


def clocked(step, group, steps: int) -> dict[str, float]:
    """Per step, means over ``steps`` untimed steps and over the ranks: ``wall_ms``; ``main_cpu_ms`` (CPU time of
    the calling thread: compute, copies, Python); ``other_threads_cpu_ms`` (the rest of the process's CPU time: gloo's
    threads moving and summing the bytes); ``wait_ms`` (blocked inside the collectives' ``wait()``) and
    ``wait_frac = wait_ms / wall_ms``."""
    clock = WaitClock()
    wall = main = proc = 0.0
    with swapped_collectives(clock.wrap):
        for _ in range(steps):
            dist.barrier(group)
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            step()
            wall += time.perf_counter() - t0
            main += time.thread_time() - c0
            proc += time.process_time() - p0
    sums = torch.tensor([wall, main, proc - main, clock.waited_s], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    wall, main, other, waited = (sums / (steps * dist.get_world_size(group))).tolist()
    return {
        "wall_ms": wall * 1e3,
        "main_cpu_ms": main * 1e3,
        "other_threads_cpu_ms": other * 1e3,
        "wait_ms": waited * 1e3,
        "wait_frac": waited / wall,
    }


def comm_only_fn(x_shape: tuple[int, ...], chunks: int, sp: bool, group):
    """The collectives a llmpar block issues per step, with the same sizes and chunking, and no compute."""
    tp = dist.get_world_size(group)
    full = torch.randn(x_shape).reshape(-1, x_shape[-1]).contiguous()
    n = full.shape[0]
    shard = torch.empty(n // tp, full.shape[1]) if sp else None

    def step():
        handles = []
        if sp:  # fwd: all-gather (col), reduce-scatter (row); bwd: all-gather (row dy), reduce-scatter (col dx)
            for _ in range(2):
                for piece in torch.tensor_split(torch.arange(n // tp), chunks):
                    a, b = int(piece[0]), int(piece[-1]) + 1
                    out = torch.empty(tp * (b - a), full.shape[1])
                    handles.append(
                        all_gather_flat(out.view(-1), shard[a:b].contiguous().view(-1), group, async_op=True)
                    )
                handles.append(reduce_scatter_flat(shard.view(-1), full.view(-1), group, async_op=True))
        else:  # forward: all-reduce of the row output in k pieces; backward: all-reduce of the column input grad
            for piece in torch.tensor_split(torch.arange(n), chunks):
                handles.append(all_reduce(full[int(piece[0]) : int(piece[-1]) + 1], group, async_op=True))
            handles.append(all_reduce(full, group, async_op=True))
        for h in handles:
            h.wait()

    return step


# ----------------------------------------------------------------------------- the blocks


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class AttnBlock(nn.Module):
    """Heads are read from the qkv output width, so a column-split qkv gives the local heads."""

    def __init__(self, d: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x)
        h = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(B, T, h, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, h * self.head_dim))


PLANS = {"mlp": ("fc", "proj"), "attn": ("qkv", "proj")}


def make_block(kind: str, d: int, head_dim: int) -> nn.Module:
    torch.manual_seed(0)
    return MLPBlock(d) if kind == "mlp" else AttnBlock(d, head_dim)


def torch_tp(block: nn.Module, kind: str, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    col, row = PLANS[kind]
    return parallelize_module(block, mesh, {col: ColwiseParallel(), row: RowwiseParallel()})


def local_compute_only(block: nn.Module, kind: str, tp: int) -> nn.Module:
    """The same module with this rank's weight shapes and no collectives: what one rank multiplies."""
    col, row = PLANS[kind]
    out = copy.deepcopy(block)
    c, r = getattr(out, col), getattr(out, row)
    setattr(out, col, nn.Linear(c.in_features, c.out_features // tp))
    setattr(out, row, nn.Linear(r.in_features // tp, r.out_features))
    return out


def llmpar_tp(
    base: nn.Module, kind: str, group, *, chunks: int = 1, overlap: bool = True, sp_layers: bool = False
) -> nn.Module:
    """``parallelize`` (``sp_layers``: the MLP with sequence-parallel layers: the column layer all-gathers its
    input in ``chunks`` pieces pipelined with its matmul, the row layer reduce-scatters in ``chunks`` pieces)."""
    if not sp_layers:
        return parallelize(
            copy.deepcopy(base),
            group,
            dict(zip(PLANS[kind], ("column", "row"))),
            comm_chunks=chunks,
            overlap_grad_comm=overlap,
        )
    out = copy.deepcopy(base)
    out.fc = ColumnParallelLinear.from_linear(
        base.fc, group=group, sequence_parallel=True, comm_chunks=chunks, overlap_grad_comm=overlap
    )
    out.proj = RowParallelLinear.from_linear(base.proj, group=group, sequence_parallel=True, comm_chunks=chunks)
    return out


def step_fn(block: nn.Module, x: torch.Tensor, w: torch.Tensor):
    def step():
        xx = x.detach().requires_grad_()  # the input gradient is computed, as inside a model
        (block(xx) * w).sum().backward()
        for p in block.parameters():
            p.grad = None

    return step


def timed_rounds(cases: dict, group, args) -> list[dict]:
    """``args.rounds`` interleaved comparisons of ``cases`` (each the harness's compare_distributed)."""
    return [
        compare_distributed(cases, group=group, warmup=args.warmup, repeats=args.repeats) for _ in range(args.rounds)
    ]


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"


def _exposed(rounds: list[dict], name: str, nocomm: str, stat: str = "median_s") -> list[float]:
    return [(getattr(r[name], stat) - getattr(r[nocomm], stat)) / getattr(r[name], stat) for r in rounds]


def blocks_section(kind: str, base, x, w, group, mesh, args) -> tuple[list[dict], list[dict]]:
    """llmpar (k = 1, 2), their no-communication twins and the compute floor against torch's DTensor tp; and the
    profile of each case (clocked steps: CPU time of the calling thread and of the other threads, waits)."""
    tp = dist.get_world_size(group)
    cases = {"torch_dtensor": step_fn(torch_tp(copy.deepcopy(base), kind, mesh), x, w)}
    for name, k in (("llmpar", 1), ("llmpar_k2", 2)):
        cases[name] = step_fn(llmpar_tp(base, kind, group, chunks=k), x, w)
        cases[name + "_nocomm"] = no_comm(cases[name])  # the same block object, collectives swapped
    cases["llmpar_sync_only"] = no_comm(cases["llmpar"], sync=True)
    cases["compute_alone"] = step_fn(local_compute_only(base, kind, tp), x, w)
    rounds = timed_rounds(cases, group, args)
    cases["comm_alone"] = comm_only_fn(tuple(x.shape), 1, False, group)
    clocks = {name: clocked(step, group, args.wait_steps) for name, step in cases.items()}
    rows, profile = [], []
    for name in cases:
        if name == "comm_alone":
            continue
        ratio = [r[name].median_s / r["torch_dtensor"].median_s for r in rounds]
        row = {
            "block": kind,
            "B": x.shape[0],
            "T": x.shape[1],
            "d": x.shape[2],
            "tp": tp,
            "name": name,
            "median_ms": statistics.median([r[name].median_s for r in rounds]) * 1e3,
            "min_ms": min(r[name].min_s for r in rounds) * 1e3,
            "time_vs_torch": statistics.median(ratio),
            "time_vs_torch_over_rounds": _spread(ratio),
        }
        if name + "_nocomm" in cases:
            exposed = _exposed(rounds, name, name + "_nocomm")
            row.update(
                exposed_comm_frac=statistics.median(exposed),
                exposed_over_rounds=_spread(exposed, 2),
                exposed_comm_frac_from_min=statistics.median(_exposed(rounds, name, name + "_nocomm", "min_s")),
                wait_frac=clocks[name]["wait_frac"],
            )
        if name == "llmpar":  # the part of the exposed share that is only the ranks meeting (no bytes)
            row["exposed_sync_only_frac"] = statistics.median(
                [(r["llmpar_sync_only"].median_s - r["llmpar_nocomm"].median_s) / r["llmpar"].median_s for r in rounds]
            )
        rows.append(row)
    for name, clock in clocks.items():
        off_cpu = clock["wall_ms"] - clock["main_cpu_ms"]
        profile.append(
            {
                "block": kind,
                "case": name,
                **clock,
                "main_thread_off_cpu_ms": off_cpu,
                "preempted_or_other_ms": off_cpu - clock["wait_ms"],
            }
        )
    return rows, profile


def overlap_section(kind: str, base, x, w, group, args) -> list[dict]:
    """Exposed communication for k = 1, 2, 4 chunks and with the input-gradient collective made synchronous, in
    the plain layout and (MLP) with sequence-parallel layers."""
    B, tp = x.shape[0], dist.get_world_size(group)
    rows = []
    for sp in (False, True) if kind == "mlp" else (False,):
        xs, ws = (x[: B // tp], w[: B // tp]) if sp else (x, w)  # sequence parallel: this rank's dim-0 shard
        configs = {f"overlap k={k}": dict(chunks=k) for k in (1, 2, 4)}
        configs["no overlap (k=1, sync grad comm)"] = dict(chunks=1, overlap=False)
        cases = {}
        for label, cfg in configs.items():
            step = step_fn(llmpar_tp(base, kind, group, sp_layers=sp, **cfg), xs, ws)
            cases[label], cases[label + " nocomm"] = step, no_comm(step)
        for k in (1, 2, 4):
            cases[f"comm_alone k={k}"] = comm_only_fn(tuple(x.shape), k, sp, group)
        rounds = timed_rounds(cases, group, args)
        for label, cfg in configs.items():
            exposed = _exposed(rounds, label, label + " nocomm")
            k, clock = cfg["chunks"], clocked(cases[label], group, args.wait_steps)
            rows.append(
                {
                    "block": kind,
                    "sequence_parallel": sp,
                    "case": label,
                    "chunks": k,
                    "t_step_ms": statistics.median([r[label].median_s for r in rounds]) * 1e3,
                    "t_nocomm_ms": statistics.median([r[label + " nocomm"].median_s for r in rounds]) * 1e3,
                    "t_comm_alone_ms": statistics.median([r[f"comm_alone k={k}"].median_s for r in rounds]) * 1e3,
                    "exposed_comm_frac": statistics.median(exposed),
                    "exposed_over_rounds": _spread(exposed, 2),
                    "exposed_comm_frac_from_min": statistics.median(
                        _exposed(rounds, label, label + " nocomm", "min_s")
                    ),
                    "wait_frac": clock["wait_frac"],
                    "main_cpu_ms": clock["main_cpu_ms"],
                    "other_threads_cpu_ms": clock["other_threads_cpu_ms"],
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved comparisons repeated (spread reported)")
    ap.add_argument("--wait-steps", type=int, default=20, help="untimed steps with the collective waits clocked")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--blocks", nargs="+", default=["mlp", "attn"], choices=sorted(PLANS))
    ap.add_argument("--skip-overlap", action="store_true", help="only the blocks vs torch (and the profile)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    group, tp, rank = mesh.get_group(), dist.get_world_size(), dist.get_rank()
    B, T, d = args.batch, args.tokens, args.d_model
    torch.manual_seed(1)
    x, w = torch.randn(B, T, d), torch.randn(B, T, d)
    blocks_rows, profile_rows, overlap_rows = [], [], []
    for kind in args.blocks:
        base = make_block(kind, d, args.head_dim)
        rows, prof = blocks_section(kind, base, x, w, group, mesh, args)
        blocks_rows += rows
        profile_rows += prof
        if not args.skip_overlap:
            overlap_rows += overlap_section(kind, base, x, w, group, args)
    if rank == 0:
        common = {
            "world_size": tp,
            "backend": "gloo",
            "threads_per_rank": args.threads,
            "rounds": args.rounds,
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg()[0],
            "cores": os.cpu_count(),
        }
        defs = {
            "exposed_comm_frac": "(t_block - t_nocomm) / t_block, t_nocomm = the same llmpar block with its "
            "collectives replaced by local stand-ins of the same shapes; median over rounds (goal <= 0.30)",
            "wait_frac": "time blocked in the collectives' wait() / step time, mean over ranks",
        }
        for title, rows in (("blocks vs torch", blocks_rows), ("profile", profile_rows), ("overlap", overlap_rows)):
            if rows:
                print(f"## {title}\n{markdown_table(rows)}")
        write_results(
            "tp_blocks",
            blocks_rows,
            {
                **common,
                "timed": "forward+backward of (block(x) * w).sum(), median over repeats of the max over "
                "ranks; time_vs_torch: median over rounds of the per-round ratio (its range over rounds beside it)",
                "goal": "llmpar <= 0.7x torch_dtensor time, exposed_comm_frac <= 0.30",
                **defs,
            },
            out_dir=args.out,
        )
        write_results(
            "tp_profile",
            profile_rows,
            {
                **common,
                "clocked": f"{args.wait_steps} untimed steps per case after the timed rounds, each after a "
                "barrier; means per step over the steps and the ranks",
                "columns": "wall_ms = main_cpu_ms (the calling thread on a core: compute, copies, Python) + "
                "main_thread_off_cpu_ms; off-CPU = wait_ms (blocked in llmpar's collective waits; torch's DTensor "
                "waits are not clocked, they land in preempted_or_other_ms) + preempted_or_other_ms (runnable but "
                "another thread or process on the core); other_threads_cpu_ms: CPU time of the process's other threads "
                "(gloo's workers: the collectives' own CPU cost)",
            },
            out_dir=args.out,
        )
        if overlap_rows:
            write_results(
                "tp_overlap",
                overlap_rows,
                {
                    **common,
                    **defs,
                    "cpu": "main_cpu_ms / other_threads_cpu_ms: CPU time per step of the calling "
                    "thread (compute, copies, Python) and of the process's other threads (gloo), clocked steps",
                },
                out_dir=args.out,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
