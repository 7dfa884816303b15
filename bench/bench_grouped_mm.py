"""Benchmark: the grouped GEMM of the MoE experts (llmpar.ops.grouped_mm / grouped_swiglu).

    python bench/bench_grouped_mm.py                        # CPU: the MoE block, before / after, vs transformers
    python bench/bench_grouped_mm.py --device cuda          # GPU: TFLOP/s at DeepSeek-V3 / Qwen3-30B-A3B shapes
    (bench/gpu_check.sh: --device cuda --routing uniform, LLMPAR_AUTOTUNE_CONFIGS=1)

CPU (``--device cpu``): forward + backward of the MoE block (input gradient included, Qwen3-MoE block shapes, one
thread: bench/bench_moe_layer.py's setup) with llmpar's experts through ``grouped_mm`` and the unpermute op
("llmpar"), with the per-expert ``F.linear`` loop and the autograd composition of the unpermute they ran before
("llmpar_before"), and transformers' block with its eager experts (the baseline) and its ``grouped_mm`` experts
backend; outputs checked to agree (1e-5) first. Wall-clock medians (bench/harness.py) and, as the steadier figure on a
shared machine, the thread's CPU time per call (``thread_ms``, ``thread_ratio`` vs transformers eager). Goals (issue
44): llmpar <= 0.5x transformers eager, faster than transformers grouped_mm at 8+ experts. Results:
bench/results/moe_grouped_mm_cpu.*.

GPU (``--device cuda``): the experts alone, SwiGLU experts over tokens sorted by expert (``grouped_swiglu``: the
gate/up GEMM with SwiGLU, then the down GEMM), bf16, at
    deepseek_v3     H=7168, I=2048, 32 local experts (256 / ep 8), 32768 rows (4096 tokens x top-8 per rank)
    qwen3_30b_a3b   H=2048, I=768, 128 experts, 65536 rows (8192 tokens x top-8)
with the rows spread over the experts uniformly (a multinomial draw) or by Zipf (p_e ~ 1 / (e + 1)). Cases, side by
side: ``triton`` (LLMPAR_BACKEND=triton: one launch per GEMM, SwiGLU fused, the backward recomputing [g, u]),
``torch._grouped_mm`` (LLMPAR_BACKEND=cuda; sm_90 + bf16 only, else the row says why not) and ``cublas_loop`` (the
per-expert ``F.linear`` loop under autograd: the baseline). TFLOP/s count the useful work: 6 M H I per forward,
18 M H I per forward + backward (the recomputation is not counted). Results: bench/results/grouped_mm_cuda.* (or
``--out``), written after each shape so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.ops import grouped_swiglu  # noqa: E402
from llmpar.ops.grouped_gemm_backends import torch_gmm_unfit  # noqa: E402

from harness import compare, cpu_medians, devices_for, forced, write_results  # noqa: E402

SHAPES = {
    "deepseek_v3": dict(hidden=7168, inter=2048, experts=32, rows=32768),
    "qwen3_30b_a3b": dict(hidden=2048, inter=768, experts=128, rows=65536),
}


def per_expert_loop(x: torch.Tensor, counts, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The experts as llmpar ran them before the grouped GEMM: F.linear per expert under autograd, then a cat."""
    outs = []
    for xe, w1, w2 in zip(torch.split(x, list(counts), dim=0), gate_up.unbind(0), down.unbind(0)):
        gate, up = F.linear(xe, w1).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w2))
    return torch.cat(outs, dim=0)


def combine_before(y: torch.Tensor, meta) -> torch.Tensor:
    """The experts' rows back in token order, weighed, as llmpar ran it before the unpermute op: a scatter into slot
    order, then the k weighted slots summed left to right in fp32, under autograd (its backward zero-fills a
    [T, k, H] buffer per slot and adds them)."""
    T, k, h = meta.num_tokens, meta.top_k, y.shape[-1]
    full = meta.order.numel() == T * k
    base = y.new_empty(T * k, h) if full else y.new_zeros(T * k, h)
    y3 = base.index_copy(0, meta.order, y).view(T, k, h).to(torch.promote_types(y.dtype, torch.float32))
    w = meta.weights.to(y3.dtype)
    out = y3[:, 0] * w[:, 0:1]
    for j in range(1, k):
        out = out + y3[:, j] * w[:, j : j + 1]
    return out.to(meta.dtype)


# ---------------------------------------------------------------------------------------------------------- CPU


def run_cpu(args) -> None:
    from bench_moe_layer import _blocks, measure

    from llmpar.moe import MoEBlock, RouterConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for experts in args.experts:
        blocks = _blocks(experts, args.top_k, args.hidden, args.intermediate, ["eager", "grouped_mm"])
        torch.manual_seed(0)
        before = MoEBlock(args.hidden, args.intermediate, experts, args.top_k, router=RouterConfig(route_norm=True))
        before.load_state_dict(blocks["llmpar"].state_dict())
        ex = before.experts
        ex.forward = lambda x, counts, ex=ex: per_expert_loop(x, counts, ex.gate_up_proj, ex.down_proj)
        before.dispatcher.combine = combine_before
        blocks["llmpar_before"] = before
        found, cases = measure(blocks, experts, args)
        cpu = cpu_medians(cases, args.repeats)
        for row in found:
            name = row["name"]
            row["thread_ms"] = cpu[name] * 1e3
            row["thread_ratio"] = cpu[name] / cpu["transformers_eager"]
            print(f"  {name}: thread time {cpu[name] * 1e3:.2f} ms, {row['thread_ratio']:.3f}x transformers eager")
            rows.append(row)
    if not args.no_write:
        import transformers

        meta = {
            "transformers": transformers.__version__,
            "what": "MoE block forward + backward (input gradient included), Qwen3-MoE block shapes; llmpar's experts "
            "through llmpar.ops.grouped_mm and its unpermute op (torch paths on CPU) vs the per-expert F.linear loop "
            "and the autograd unpermute before them",
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "threads": torch.get_num_threads(),
            "goal": "llmpar <= 0.5x transformers eager; faster than transformers grouped_mm at 8+ experts",
        }
        paths = write_results("moe_grouped_mm_cpu", rows, meta=meta, out_dir=args.out)
        print("wrote", ", ".join(str(p) for p in paths.values()))


# ---------------------------------------------------------------------------------------------------------- GPU


def counts_for(rows: int, experts: int, routing: str, seed: int = 0) -> list[int]:
    """Rows per expert: a multinomial draw of ``rows`` over the experts, uniform or Zipf (p_e ~ 1 / (e + 1))."""
    p = torch.ones(experts, dtype=torch.float64)
    if routing == "zipf":
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    draw = torch.multinomial(p / p.sum(), rows, replacement=True, generator=g)
    return torch.bincount(draw, minlength=experts).tolist()


def _cases(x, counts, gate_up, down, dy, backward: bool) -> dict:
    def ours():
        if not backward:
            with torch.no_grad():
                return grouped_swiglu(x, counts, gate_up, down)
        grouped_swiglu(x, counts, gate_up, down).backward(dy)

    def loop():
        if not backward:
            with torch.no_grad():
                return per_expert_loop(x, counts, gate_up, down)
        per_expert_loop(x, counts, gate_up, down).backward(dy)

    cases = {"cublas_loop": loop, "triton": forced("triton", ours)}
    if torch_gmm_unfit((x, gate_up, down)) is None:
        cases["torch._grouped_mm"] = forced("cuda", ours)
    return cases


def run_cuda(args, device: torch.device | None = None) -> None:
    device, dtype = device or torch.device("cuda"), torch.bfloat16
    rows_out: list[dict] = []
    why_not = None
    for shape in args.shapes:
        s = SHAPES[shape]
        h, i, e, m = s["hidden"], s["inter"], s["experts"], s["rows"]
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, h, device=device, dtype=dtype, generator=g).requires_grad_()
        gate_up = (torch.randn(e, 2 * i, h, device=device, dtype=dtype, generator=g) * h**-0.5).requires_grad_()
        down = (torch.randn(e, h, i, device=device, dtype=dtype, generator=g) * i**-0.5).requires_grad_()
        dy = torch.randn(m, h, device=device, dtype=dtype, generator=g)
        why_not = torch_gmm_unfit((x, gate_up, down))
        for routing in args.routing:
            counts = counts_for(m, e, routing)
            for backward in (False, True):
                cases = _cases(x, counts, gate_up, down, dy, backward)
                cmp = compare(cases, baseline="cublas_loop", warmup=args.warmup, repeats=args.repeats, device=device)
                flops = (18 if backward else 6) * m * h * i
                what = "fwd+bwd" if backward else "fwd"
                print(f"\n{shape} {routing} {what}: M={m} H={h} I={i} E={e}, max/mean rows {max(counts) * e / m:.2f}")
                print(cmp.table())
                for row in cmp.rows(shape=shape, routing=routing, **{"pass": what}, rows=m, experts=e):
                    row["tflops"] = flops / cmp.timings[row["name"]].median_s / 1e12
                    rows_out.append(row)
                x.grad = gate_up.grad = down.grad = None
        if not args.no_write:
            meta = {
                "dtype": "bf16",
                "what": "grouped_swiglu (gate/up GEMM + SwiGLU, down GEMM); TFLOP/s of 6 M H I (fwd), 18 M H I "
                "(fwd+bwd)",
                "torch._grouped_mm": "fused here" if why_not is None else f"not run: {why_not}",
                "autotune_configs": os.environ.get("LLMPAR_AUTOTUNE_CONFIGS", "all"),
                "goal": "Triton within reach of torch._grouped_mm, above the per-expert cuBLAS loop",
            }
            paths = write_results("grouped_mm_cuda", rows_out, meta=meta, out_dir=args.out)
            print("wrote", paths["md"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda", "all"), default="cpu")
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32], help="CPU: experts of the MoE block")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=192)
    p.add_argument("--threads", type=int, default=1, help="CPU: torch.set_num_threads (0: torch's default)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="GPU shapes")
    p.add_argument("--routing", nargs="+", choices=("uniform", "zipf"), default=["uniform", "zipf"])
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    devices = devices_for(args.device, "bench_grouped_mm")
    if devices is None:
        sys.exit(1)
    for device in devices:
        cuda = device.type == "cuda"
        args.warmup = args.warmup if args.warmup is not None else 2
        args.repeats = args.repeats if args.repeats is not None else (10 if cuda else 21)
        run_cuda(args) if cuda else run_cpu(args)


if __name__ == "__main__":
    main()
