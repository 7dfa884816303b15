"""Benchmark: fused linear (llmpar.ops.linear_act) vs cuBLAS alone and vs cuBLAS + separate bias/activation.

    python bench/bench_gemm.py                                   # CPU (torch path, small shapes), and CUDA when present
    python bench/bench_gemm.py --device cuda --out bench/results
    (bench/gpu_check.sh: --device cuda --tp 1 8, with LLMPAR_AUTOTUNE_CONFIGS=2 to bound autotuning)

Shapes (CUDA): M=8192 tokens; the MLP of a 7B/8B model split by tp in {1, 2, 8}: up/gate projections
K=4096 -> N in {11008, 14336}/tp with gelu_tanh / silu, and the down projection K=11008/tp -> N=4096 with bias and a
residual add (no activation). Cases, side by side in one run (bench/harness.py interleaves them):
    torch.matmul        x @ W^T alone (cuBLAS): the bar for the plain GEMM (goal: llmpar plain >= 0.9x)
    torch unfused       act(F.linear(x, W, b)) (+ r): cuBLAS + separate elementwise kernels (goal: fused >= 1.1x)
    llmpar plain        linear_act(x, W) with no epilogue, Triton
    llmpar fused        linear_act(x, W, b, act=..., residual=r), Triton
    cublasLt epilogue   torch.ops.llmpar.linear_lt (csrc/gemm_lt.cpp), where built and the epilogue exists
    llmpar cuda         linear_act with LLMPAR_BACKEND=cuda: linear_lt, or linear_lt_aux (keeps z) for gelu_tanh
TFLOP/s counts 2*M*N*K per call. The first Triton call per shape autotunes (done in warmup). On CUDA each sample is a
CUDA graph of back-to-back calls (bench/harness.py: graph="auto"; a case that cannot be captured runs them eagerly,
its row says so), so a tp=8 row (~0.2 ms of GPU work) is not timed with its 50-150 us Python launch path.

Parallel-linear path (``--layers``, on by default on CUDA; a world-1 process group, so tp=1 layers holding the
shard a tp rank would hold): forward + backward of ColumnParallelLinear(activation=act) (up) and RowParallelLinear
(down), with LLMPAR_BACKEND=torch (the plain composition through autograd) vs triton vs cuda (cuBLASLt forward,
bias_act_backward + cuBLAS backward); TFLOP/s count 6*M*N*K per step. Baseline: torch. Samples hold back-to-back
steps (no graph: autograd's backward is timed as it runs in training).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.ops import linear_act  # noqa: E402
from llmpar.ops._dispatch import triton_unavailable_reason  # noqa: E402
from llmpar.ops.gemm import _act_torch  # noqa: E402

from harness import compare, devices_for, forced, markdown_table, write_results  # noqa: E402

HIDDEN, FFNS = 4096, (11008, 14336)
LT_ACTS = {"none": 0, "gelu_tanh": 1, "relu": 4}  # the activations cuBLASLt has epilogues for


def _has_ext_ops(*names: str) -> bool:
    from llmpar.ops import _ext
    from llmpar.ops._dispatch import has_ext_op

    return _ext.load().available and all(has_ext_op(n) for n in names)


def _has_linear_lt() -> bool:
    return _has_ext_ops("linear_lt")


def _cuda_path_ok(act: str, res: bool) -> bool:
    """Whether linear_act can take the CUDA-extension path for this case (see llmpar.ops.gemm._lt_unfit)."""
    ops = ("linear_lt", "bias_act_backward") + (("linear_lt_aux",) if act == "gelu_tanh" else ())
    return act in LT_ACTS and (not res or act == "none") and _has_ext_ops(*ops)


def shapes(device: torch.device, tps: list[int], tokens: int) -> list[tuple[str, int, int, int, str, bool]]:
    """(name, M, K, N, act, residual) per case."""
    if device.type != "cuda":
        return [("up", 256, 512, 1024, "gelu_tanh", False), ("down", 256, 1024, 512, "none", True)]
    out = []
    for tp in tps:
        for ffn, act in zip(FFNS, ("gelu_tanh", "silu")):
            out.append((f"up ffn={ffn} tp={tp}", tokens, HIDDEN, ffn // tp, act, False))
        out.append((f"down ffn={FFNS[0]} tp={tp}", tokens, FFNS[0] // tp, HIDDEN, "none", True))
    return out


def run(device: torch.device, tps: list[int], tokens: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    rows = []
    triton_ok = triton_unavailable_reason(device) is None
    for name, m, k, n, act, res in shapes(device, tps, tokens):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
        w = torch.randn(n, k, device=device, dtype=dtype, generator=g) * k**-0.5
        b = torch.randn(n, device=device, dtype=dtype, generator=g)
        r = torch.randn(m, n, device=device, dtype=dtype, generator=g) if res else None
        with torch.no_grad():
            cases = {
                "torch.matmul": lambda: torch.matmul(x, w.t()),
                "torch unfused": lambda: (
                    (_act_torch(F.linear(x, w, b), act) + r) if r is not None else _act_torch(F.linear(x, w, b), act)
                ),
            }
            if triton_ok:
                cases["llmpar plain"] = forced("triton", lambda: linear_act(x, w))
                cases["llmpar fused"] = forced("triton", lambda: linear_act(x, w, b, act=act, residual=r))
            else:
                cases["llmpar fused"] = lambda: linear_act(x, w, b, act=act, residual=r)
            if device.type == "cuda" and act in LT_ACTS and _has_linear_lt():
                cases["cublasLt epilogue"] = lambda: torch.ops.llmpar.linear_lt(x, w, b, LT_ACTS[act], r)
            if device.type == "cuda" and _cuda_path_ok(act, res):
                cases["llmpar cuda"] = forced("cuda", lambda: linear_act(x, w, b, act=act, residual=r))
            cmp = compare(cases, baseline="torch.matmul", warmup=5, repeats=repeats, device=device, graph="auto")
        flops = 2.0 * m * n * k
        got = {}
        for row in cmp.rows(shape=name, M=m, K=k, N=n, act=act, residual=res, dtype=str(dtype)[6:]):
            row["TFLOP/s"] = flops / (row["median_ms"] / 1e3) / 1e12
            got[row.get("case", row.get("name"))] = row
            rows.append(row)
        if "llmpar fused" in got and "torch unfused" in got:
            got["llmpar fused"]["x_vs_unfused"] = got["torch unfused"]["median_ms"] / got["llmpar fused"]["median_ms"]
    return rows


def _world1_group(device: torch.device):
    """A world-1 process group for the layers (nothing is reduced): NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def run_layers(device: torch.device, tps: list[int], tokens: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    """Forward + backward of the parallel linears (tp=1 layers with a tp rank's shard) per backend."""
    from llmpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    group, rows = _world1_group(device), []
    triton_ok = triton_unavailable_reason(device) is None
    for name, m, k, n, act, res in shapes(device, tps, tokens):
        if res:  # the down projection: a row-parallel layer, bias after the reduction, no activation
            layer = RowParallelLinear(k, n, group=group, device=device, dtype=dtype)
        else:
            layer = ColumnParallelLinear(k, n, group=group, activation=act, device=device, dtype=dtype)
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=dtype, generator=g).requires_grad_()
        dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)

        def step():
            layer(x).backward(dy)

        cases = {"torch": forced("torch", step)}
        if triton_ok:
            cases["triton"] = forced("triton", step)
        if device.type == "cuda" and _cuda_path_ok("none" if res else act, False):
            cases["cuda"] = forced("cuda", step)
        cmp = compare(cases, baseline="torch", warmup=3, repeats=repeats, device=device)
        for row in cmp.rows(shape=f"layer {name}", M=m, K=k, N=n, act="none" if res else act, dtype=str(dtype)[6:]):
            row["TFLOP/s"] = 6.0 * m * n * k / (row["median_ms"] / 1e3) / 1e12
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    parser.add_argument(
        "--layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the parallel-linear layers fwd+bwd per backend (default: on CUDA only)",
    )
    args = parser.parse_args(argv)
    devices = devices_for(args.device, "bench_gemm")
    if devices is None:
        return 1
    dtype = getattr(torch, args.dtype)

    def report(name: str, rows: list[dict]) -> None:
        print(markdown_table(rows))
        meta = {"tokens": args.tokens, "tp": args.tp, "dtype": args.dtype}
        print(f"wrote {write_results(name, rows, meta=meta, out_dir=args.out)['md']}")

    for device in devices:
        rows = run(
            device,
            args.tp,
            args.tokens,
            dtype if device.type == "cuda" else torch.float32,
            args.repeats or (20 if device.type == "cuda" else 3),
        )
        report(f"gemm_{device.type}", rows)
        if args.layers or (args.layers is None and device.type == "cuda"):
            report(
                f"gemm_layers_{device.type}",
                run_layers(
                    device,
                    args.tp,
                    args.tokens,
                    dtype if device.type == "cuda" else torch.float32,
                    args.repeats or (10 if device.type == "cuda" else 3),
                ),
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
