"""Benchmark: pack/unpack of a gradient bucket (llmpar.ops) vs plain torch baselines, side by side in one run.

    python bench/bench_bucket.py                                  # CPU, and CUDA when present
    python bench/bench_bucket.py --device cuda --out bench/results
    python bench/bench_bucket.py --table                          # host cost of the Triton launch table (CPU)

Baselines: ``torch._utils._flatten_dense_tensors`` (what DDP/ZeRO use) or ``torch.cat`` of the flattened tensors
plus cast and scale; for unpack ``_unflatten_dense_tensors`` + per-tensor ``copy_`` (+ ``mul_``). llmpar runs on
every backend that can run here (LLMPAR_BACKEND forced per call). Timing and result files: bench/harness.py.

``--table``: what building the Triton kernel's launch table (llmpar.kernels.bucket) costs the host per call, for a
bucket of ``--tensors`` tensors / ``--numel`` elements (default 96 / 1e8, a GPU-sized bucket; the tensors are views of
one untouched buffer, so no memory is written): the Python loop over every block that it used to run (``loop_table``,
kept here as the baseline), the new build (``table_rows``: numpy on the CPU; on a GPU the same rows come from a few
tensor ops there), and a call that finds the layout in the cache (what every call after the first costs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.ops import pack_bucket, unpack_bucket  # noqa: E402
from llmpar.ops._dispatch import cuda_unavailable_reason, triton_unavailable_reason  # noqa: E402

from harness import compare, devices_for, forced, markdown_table, write_results  # noqa: E402

CASES = (
    (torch.float32, torch.float32, 1.0),
    (torch.bfloat16, torch.float32, 1.0 / 8),
    (torch.float32, torch.bfloat16, 1.0 / 8),
)


def make_bucket(numel: int, n: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """n tensors of uneven, odd sizes summing to about numel (like a model's gradients: a few big, many small)."""
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(n, generator=g) ** 3 + 1e-3
    sizes = (weights / weights.sum() * numel).long().clamp(min=1) | 1
    return [torch.randn(int(s), dtype=dtype, device=device) for s in sizes]


def loop_table(tensors: list[torch.Tensor], block: int) -> torch.Tensor:
    """The launch table as llmpar.kernels.bucket built it before (a Python loop over every block of every tensor):
    the baseline of ``--table``, and the reference tests/test_ops_bucket.py checks ``table_rows`` against."""
    numels = [t.numel() for t in tensors]
    offsets, acc = [], 0
    for k in numels:
        offsets.append(acc)
        acc += k
    owner, starts = [], []
    for i, k in enumerate(numels):
        for s in range(0, k, block):
            owner.append(i)
            starts.append(s)
    return torch.tensor([t.data_ptr() for t in tensors] + numels + offsets + owner + starts, dtype=torch.int64)


def run_table(numel: int, n: int, repeats: int) -> list[dict]:
    """Host time per call of each way to get the launch table (CPU tensors; on a GPU the new build adds 4n numbers'
    copy and a few small kernels, the old one a copy of the whole table)."""
    from llmpar.kernels import bucket

    sizes = [t.numel() for t in make_bucket(numel, n, torch.float32, torch.device("meta"))]
    tensors = list(torch.empty(sum(sizes), dtype=torch.bfloat16).split(sizes))  # untouched pages: no memory written
    flat = torch.empty(0)
    ptrs, numels, cpu = tuple(t.data_ptr() for t in tensors), tuple(sizes), torch.device("cpu")
    bucket._cached_table.cache_clear()
    cases = {
        "python loop (before)": lambda: loop_table(tensors, bucket.BLOCK),
        "table_rows (CPU: numpy)": lambda: bucket.table_rows(ptrs, numels, cpu),
        "cached (_table: same layout again)": lambda: bucket._table(flat, tensors),
    }
    cmp = compare(cases, baseline="python loop (before)", warmup=2, repeats=repeats, device=cpu)
    programs = sum(-(-k // bucket.BLOCK) for k in sizes)
    return cmp.rows(tensors=n, numel=sum(sizes), programs=programs)


def backends(device: torch.device) -> list[str]:
    return [
        b
        for b, why in (
            ("cuda", cuda_unavailable_reason(device, op="pack_bucket")),
            ("triton", triton_unavailable_reason(device)),
            ("torch", None),
        )
        if why is None
    ]


def run(device: torch.device, numel: int, n: int, repeats: int) -> list[dict]:
    rows = []
    for dtype_in, dtype_out, scale in CASES:
        tensors = make_bucket(numel, n, dtype_in, device)
        total = sum(t.numel() for t in tensors)
        gbytes = total * (dtype_in.itemsize + dtype_out.itemsize) / 1e9
        case = f"{str(dtype_in)[6:]}->{str(dtype_out)[6:]} x{scale:g}"
        flat = torch.empty(total, dtype=dtype_out, device=device)
        outs = [torch.empty_like(t) for t in tensors]
        if dtype_in == dtype_out and scale == 1.0:
            pack_base = {"_flatten_dense_tensors": lambda: _flatten_dense_tensors(tensors)}
        else:
            pack_base = {"cat+to+mul_": lambda: torch.cat([t.reshape(-1) for t in tensors]).to(dtype_out).mul_(scale)}

        def unpack_base() -> None:
            for o, v in zip(outs, _unflatten_dense_tensors(flat, outs)):
                o.copy_(v).mul_(1.0 / scale) if scale != 1.0 else o.copy_(v)

        for op, base, ours in (
            ("pack", pack_base, lambda: pack_bucket(tensors, flat, scale=scale)),
            ("unpack", {"unflatten+copy_": unpack_base}, lambda: unpack_bucket(flat, outs, scale=1.0 / scale)),
        ):
            cases = {**base, **{f"llmpar[{b}]": forced(b, ours) for b in backends(device)}}
            cmp = compare(cases, baseline=next(iter(base)), warmup=3, repeats=repeats, device=device)
            for row in cmp.rows(op=op, case=case, device=device.type, tensors=n, numel=total):
                row["GB/s"] = gbytes / (row["median_ms"] / 1e3)
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--numel", type=float, default=None, help="elements per bucket (default 2e6 CPU, 1e8 CUDA)")
    parser.add_argument("--tensors", type=int, default=None, help="tensors per bucket (default 200; 96 with --table)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    parser.add_argument("--table", action="store_true", help="time the Triton launch table's host cost instead (CPU)")
    args = parser.parse_args(argv)
    if args.table:
        numel, n = int(args.numel or 1e8), args.tensors or 96
        rows = run_table(numel, n, args.repeats or 15)
        print(markdown_table(rows))
        paths = write_results("bucket_table_cpu", rows, meta={"tensors": n, "numel": numel}, out_dir=args.out)
        print(f"wrote {paths['md']}")
        return 0
    devices = devices_for(args.device, "bench_bucket")
    if devices is None:
        return 1
    for device in devices:
        numel = int(args.numel or (1e8 if device.type == "cuda" else 2e6))
        rows = run(device, numel, args.tensors or 200, args.repeats or (30 if device.type == "cuda" else 7))
        print(markdown_table(rows))
        paths = write_results(
            f"bucket_{device.type}", rows, meta={"tensors": args.tensors or 200, "numel": numel}, out_dir=args.out
        )
        print(f"wrote {paths['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
