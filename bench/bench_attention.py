"""Benchmark: llmpar's attention (llmpar.ops.flash_attention) vs torch's scaled_dot_product_attention, side by side.

    python bench/bench_attention.py                               # CPU (torch path vs SDPA, small shapes), CUDA too
    python bench/bench_attention.py --device cuda --out bench/results

Cases per shape (B, Hq, Hkv, S, D, causal), forward alone and forward + backward (autograd, gradients of q, k, v):
    torch SDPA        F.scaled_dot_product_attention(..., is_causal, enable_gqa): on CUDA its flash / efficient
                      kernels, on CPU its flash-attention CPU kernel (the baseline)
    llmpar[torch]     flash_attention with LLMPAR_BACKEND=torch: the query-chunked fp32 torch path
    llmpar[triton]    flash_attention with LLMPAR_BACKEND=triton: the Triton kernels (CUDA only)
Both take the same arguments: llmpar's also accepts global positions and key padding (not used here: SDPA's
causal mask is by local index). TFLOP/s counts the two matrix products of the forward, 4 B Hq S^2 D (halved when
causal), and 2.5 times that for the backward (5 products). On CUDA the inputs are bf16 and ``peak_MiB`` is the
allocator's peak during one call above what the inputs hold; on CPU fp32.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.ops import flash_attention  # noqa: E402
from llmpar.ops._dispatch import triton_unavailable_reason  # noqa: E402

from harness import compare, devices_for, forced, markdown_table, write_results  # noqa: E402

# (B, Hq, Hkv, S, D, causal)
CUDA_SHAPES = [
    (4, 32, 32, 2048, 128, True),
    (2, 32, 8, 4096, 128, True),
    (8, 16, 16, 1024, 64, False),
    (1, 32, 8, 16384, 128, True),
]
CPU_SHAPES = [(1, 8, 8, 512, 64, True), (1, 8, 2, 1024, 64, True), (2, 4, 4, 256, 64, False)]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        except TypeError:  # torch < 2.5: no enable_gqa
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _peak_mib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def run(device: torch.device, shapes, dtype: torch.dtype, repeats: int) -> list[dict]:
    rows = []
    backends = ["torch"] + (["triton"] if device.type == "cuda" and triton_unavailable_reason(device) is None else [])
    for b, hq, hkv, s, d, causal in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, hq, s, d, generator=g, device=device, dtype=dtype, requires_grad=True)
        k, v = (
            torch.randn(b, hkv, s, d, generator=g, device=device, dtype=dtype, requires_grad=True) for _ in range(2)
        )
        dout = torch.randn_like(q)
        fwd_flops = 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)

        def ours(backend: str, backward: bool):
            def call():
                out = flash_attention(q, k, v, causal=causal)
                if backward:
                    out.backward(dout)
                    q.grad = k.grad = v.grad = None

            return forced(backend, call)

        def theirs(backward: bool):
            def call():
                out = sdpa(q, k, v, causal)
                if backward:
                    out.backward(dout)
                    q.grad = k.grad = v.grad = None

            return call

        for phase, backward, flops in (("fwd", False, fwd_flops), ("fwd+bwd", True, 3.5 * fwd_flops)):
            cases = {"torch SDPA": theirs(backward), **{f"llmpar[{be}]": ours(be, backward) for be in backends}}
            ctx = torch.enable_grad() if backward else torch.no_grad()
            with ctx:
                cmp = compare(cases, baseline="torch SDPA", warmup=2, repeats=repeats, device=device)
                peaks = {name: _peak_mib(fn, device) for name, fn in cases.items()}
            for row in cmp.rows(phase=phase, B=b, Hq=hq, Hkv=hkv, S=s, D=d, causal=causal, dtype=str(dtype)[6:]):
                row["TFLOP/s"] = flops / (row["median_ms"] / 1e3) / 1e12
                if peaks[row["name"]] is not None:
                    row["peak_MiB"] = peaks[row["name"]]
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    devices = devices_for(args.device, "bench_attention")
    if devices is None:
        return 1
    for device in devices:
        cuda = device.type == "cuda"
        rows = run(
            device,
            CUDA_SHAPES if cuda else CPU_SHAPES,
            torch.bfloat16 if cuda else torch.float32,
            args.repeats or (20 if cuda else 5),
        )
        print(markdown_table(rows))
        paths = write_results(
            f"attention_{device.type}",
            rows,
            out_dir=args.out,
            meta={"shapes": f"(B, Hq, Hkv, S, D, causal): {CUDA_SHAPES if cuda else CPU_SHAPES}"},
        )
        print(f"wrote {paths['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
