"""Benchmark: tensor-parallel MLP and attention blocks, llmpar vs torch's DTensor tensor parallelism, side by side,
and the exposed-communication fractions of llmpar's overlap for k = 1, 2, 4 chunks.

    torchrun --nproc_per_node 2 bench/bench_tp.py                 # CPU / gloo, the default sizes
    torchrun --nproc_per_node 2 bench/bench_tp.py --tokens 512 --d-model 512 --repeats 30

Blocks (x: [B, T, d]):  MLP  = fc (column, d -> 4d) -> GELU -> proj (row, 4d -> d)
                        attn = qkv (column, d -> 3d, head-major) -> causal SDPA over local heads -> proj (row)
llmpar: ``llmpar.tensor_parallel.parallelize``; torch: ``parallelize_module`` + ``ColwiseParallel`` /
``RowwiseParallel`` on the same module. Timed: forward + backward of ``(block(x) * w).sum()``.

Exposed communication = (t(block with comm) - t(compute alone)) / t(comm alone), where compute alone runs the same
per-rank matmuls with no collective, and comm alone issues the same collectives (same sizes, same chunking) with
no compute. Results: bench/results/tp_blocks.{md,json} and bench/results/tp_overlap.{md,json}.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Comparison, compare_distributed, markdown_table, write_results  # noqa: E402

from llmpar.distributed import all_gather_flat, all_reduce, reduce_scatter_flat  # noqa: E402
from llmpar.tensor_parallel import parallelize  # noqa: E402


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


def step_fn(block: nn.Module, x: torch.Tensor, w: torch.Tensor):
    def step():
        xx = x.detach().requires_grad_()  # the input gradient is computed, as inside a model
        (block(xx) * w).sum().backward()
        for p in block.parameters():
            p.grad = None
    return step


def comm_only_fn(x_shape: tuple[int, ...], chunks: int, sp: bool, group):
    """The collectives a llmpar block issues per step, with the same sizes and chunking, and no compute."""
    tp = dist.get_world_size(group)
    full = torch.randn(x_shape).reshape(-1, x_shape[-1]).contiguous()
    n = full.shape[0]
    shard = torch.empty(n // tp, full.shape[1]) if sp else None

    def step():
        handles = []
        if sp:  # forward: all-gather (col), reduce-scatter (row); backward: all-gather (row dy), reduce-scatter (col dx)
            for _ in range(2):
                for piece in torch.tensor_split(torch.arange(n // tp), chunks):
                    a, b = int(piece[0]), int(piece[-1]) + 1
                    out = torch.empty(tp * (b - a), full.shape[1])
                    handles.append(all_gather_flat(out.view(-1), shard[a:b].contiguous().view(-1), group,
                                                   async_op=True))
                handles.append(reduce_scatter_flat(shard.view(-1), full.view(-1), group, async_op=True))
        else:  # forward: all-reduce of the row output in k pieces; backward: all-reduce of the column input grad
            for piece in torch.tensor_split(torch.arange(n), chunks):
                handles.append(all_reduce(full[int(piece[0]) : int(piece[-1]) + 1], group, async_op=True))
            handles.append(all_reduce(full, group, async_op=True))
        for h in handles:
            h.wait()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    group, tp, rank = mesh.get_group(), dist.get_world_size(), dist.get_rank()
    B, T, d = args.batch, args.tokens, args.d_model
    torch.manual_seed(1)
    x, w = torch.randn(B, T, d), torch.randn(B, T, d)
    blocks_rows, overlap_rows = [], []
    for kind in ("mlp", "attn"):
        base = make_block(kind, d, args.head_dim)
        plan = dict(zip(PLANS[kind], ("column", "row")))
        cases = {
            "torch_dtensor": step_fn(torch_tp(copy.deepcopy(base), kind, mesh), x, w),
            "llmpar": step_fn(parallelize(copy.deepcopy(base), group, plan), x, w),
            "llmpar_k2": step_fn(parallelize(copy.deepcopy(base), group, plan, comm_chunks=2), x, w),
        }
        res = compare_distributed(cases, group=group, warmup=args.warmup, repeats=args.repeats)
        cmp = Comparison(baseline="torch_dtensor", timings=res)
        for row in cmp.rows(block=kind, B=B, T=T, d=d, tp=tp):
            row["time_vs_torch"] = 1.0 / row["speedup"]
            blocks_rows.append(row)

        # exposed communication, plain and sequence-parallel layouts
        for sp in (False, True):
            xs = x[: B // tp] if sp else x  # sequence parallel: each rank holds dim-0 shard (batch-first: batch)
            ws = w[: B // tp] if sp else w
            ocases = {"compute_alone": step_fn(local_compute_only(base, kind, tp), x, w)}
            if kind == "attn" and sp:
                continue  # the attention block's SP gather lives in parallelize's module hook, not in the layers
            for k in (1, 2, 4):
                ocases[f"comm_alone_k{k}"] = comm_only_fn(tuple(x.shape), k, sp, group)
                ocases[f"overlap_k{k}"] = step_fn(
                    _sp_layers(base, kind, group, k, True) if sp else
                    parallelize(copy.deepcopy(base), group, plan, comm_chunks=k), xs, ws)
            ocases["no_overlap"] = step_fn(
                _sp_layers(base, kind, group, 1, False) if sp else
                parallelize(copy.deepcopy(base), group, plan, overlap_grad_comm=False), xs, ws)
            ot = compare_distributed(ocases, group=group, warmup=args.warmup, repeats=args.repeats)
            tc, tc_min = ot["compute_alone"].median_s, ot["compute_alone"].min_s
            for k in (1, 2, 4):
                for label, name in ((f"overlap k={k}", f"overlap_k{k}"),) + (
                        (("no overlap (k=1, sync grad comm)", "no_overlap"),) if k == 1 else ()):
                    tm, tm_min = ot[f"comm_alone_k{k}"].median_s, ot[f"comm_alone_k{k}"].min_s
                    t, t_min = ot[name].median_s, ot[name].min_s
                    overlap_rows.append({
                        "block": kind, "sequence_parallel": sp, "case": label, "chunks": k,
                        "t_step_ms": t * 1e3, "t_compute_ms": tc * 1e3, "t_comm_ms": tm * 1e3,
                        "exposed_comm_frac": (t - tc) / tm,
                        "exposed_comm_frac_from_min": (t_min - tc_min) / tm_min,
                    })
    if rank == 0:
        print(markdown_table(blocks_rows))
        print(markdown_table(overlap_rows))
        meta = {"world_size": tp, "backend": "gloo", "threads_per_rank": args.threads,
                "timed": "forward+backward of (block(x) * w).sum(), median over repeats of the max over ranks",
                "goal": "llmpar <= 0.7x torch_dtensor time",
                "load_average_at_start": os.getloadavg()[0], "cores": os.cpu_count()}
        write_results("tp_blocks", blocks_rows, meta, out_dir=args.out)
        meta2 = {"world_size": tp, "backend": "gloo", "threads_per_rank": args.threads,
                 "exposed_comm_frac": "(t_step - t_compute) / t_comm (medians; _from_min: from the minima); goal < 0.30",
                 "load_average_at_start": os.getloadavg()[0], "cores": os.cpu_count()}
        write_results("tp_overlap", overlap_rows, meta2, out_dir=args.out)
    dist.destroy_process_group()


def _sp_layers(base: nn.Module, kind: str, group, chunks: int, overlap: bool) -> nn.Module:
    """The MLP block with sequence-parallel layers (column all-gathers in chunks, row reduce-scatters in chunks)."""
    from llmpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out = copy.deepcopy(base)
    out.fc = ColumnParallelLinear.from_linear(base.fc, group=group, sequence_parallel=True, comm_chunks=chunks,
                                              overlap_grad_comm=overlap)
    out.proj = RowParallelLinear.from_linear(base.proj, group=group, sequence_parallel=True, comm_chunks=chunks)
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
