"""Benchmark: one optimizer step of llmpar FusedAdamW (every precision mode) vs torch.optim.AdamW (fused, foreach),
side by side in one run, on GPT-shaped parameter lists (a few big matrices, many small vectors).

    python bench/bench_optim.py                                   # CPU: 10M, 30M, 100M params
    python bench/bench_optim.py --device cuda --sizes 10M 100M 1B --out bench/results
    (bench/gpu_check.sh runs it with --device cuda --sizes 100M 1B --no-deepspeed --out <dir>)

Groups (a group's cases share params and grads; each case has its own optimizer state):
    fp32       torch fused (baseline) | torch foreach | llmpar "fp32"
    fp32+clip  torch clip_grad_norm_ + fused (baseline) | llmpar "fp32" with max_grad_norm (clip inside the step);
               max norm 1e6, so the coefficient is 1: the grads are reused across repeats and a real clip would
               shrink them geometrically into denormals (slow on CPU); the work done is the same
    bf16       torch fused on bf16 params (baseline; bf16 m, v, round to nearest) | llmpar "fp32_master" | "bf16_sr" |
               "bf16_kahan" | DeepSpeed FusedAdam (fp32_master-like, CUDA, when importable)
GB/s = the bytes a step must move at least (per param: fp32 28 B, fp32_master 28 B, bf16_sr 14 B, bf16_kahan 18 B,
torch bf16 14 B; +4 B / +2 B of grad reads for the clip norm) / median time, next to the device copy bandwidth
(``dst.copy_(src)`` of 1 GiB, read + write). Results: bench/results/optim_<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llmpar.optim import FusedAdamW  # noqa: E402

from harness import compare, measure, write_results  # noqa: E402

# name -> (d_model, n_layer, vocab): GPT-2-style blocks (12 d^2 + 13 d per layer), tied embeddings, 1024 positions
PRESETS = {
    "10M": (384, 4, 8192),
    "30M": (512, 8, 16384),
    "100M": (768, 12, 16384),
    "300M": (1024, 20, 32768),
    "1B": (2048, 18, 50304),
}
CLIP = 1e6
BYTES = {"fp32": 28, "fp32_master": 28, "bf16_sr": 14, "bf16_kahan": 18, "torch_bf16": 14, "deepspeed": 28}


def gpt_shapes(d: int, layers: int, vocab: int, ctx: int = 1024) -> list[tuple[int, ...]]:
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]


def make_params(shapes, dtype, device) -> list[torch.Tensor]:
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.float32).mul_(0.02).to(dtype))
        p.grad = torch.randn(s, device=device, dtype=torch.float32).mul_(1e-3).to(dtype)
        params.append(p)
    return params


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB device copy (bytes read + written)."""
    n = (1 << 30) // 4 if device.type == "cuda" else (1 << 28) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=3, repeats=10, device=device)
    return 2 * n * 4 / t.median_s / 1e9


def deepspeed_case(params) -> Callable[[], None] | None:
    try:
        from deepspeed.ops.adam import FusedAdam  # JIT-builds its kernel on first use

        opt = FusedAdam(params, lr=1e-4, weight_decay=0.1, adam_w_mode=True)
        opt.step()
        return opt.step
    except Exception as exc:  # noqa: BLE001 - an optional baseline
        print(f"  (DeepSpeed FusedAdam skipped: {type(exc).__name__}: {str(exc)[:120]})")
        return None


def run_group(
    group: str, n_params: int, shapes, device, warmup: int, repeats: int, copy_gbs: float, deepspeed: bool = True
) -> list[dict]:
    bf16 = group == "bf16"
    params = make_params(shapes, torch.bfloat16 if bf16 else torch.float32, device)
    hyper = dict(lr=1e-4, weight_decay=0.1)
    cases: dict[str, Callable[[], object]] = {}
    kinds: dict[str, str] = {}
    if group == "fp32":
        cases["torch fused"] = torch.optim.AdamW(params, fused=True, **hyper).step
        cases["torch foreach"] = torch.optim.AdamW(params, foreach=True, **hyper).step
        cases["llmpar fp32"] = FusedAdamW(params, precision="fp32", **hyper).step
        kinds = {"torch fused": "fp32", "torch foreach": "fp32", "llmpar fp32": "fp32"}
        baseline = "torch fused"
    elif group == "fp32+clip":
        tor = torch.optim.AdamW(params, fused=True, **hyper)

        def torch_clip_step() -> None:
            torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
            tor.step()

        cases["torch clip+fused"] = torch_clip_step
        cases["llmpar fp32 clip"] = FusedAdamW(params, precision="fp32", max_grad_norm=CLIP, **hyper).step
        kinds = {"torch clip+fused": "fp32", "llmpar fp32 clip": "fp32"}
        baseline = "torch clip+fused"
    else:
        cases["torch fused bf16"] = torch.optim.AdamW(params, fused=True, **hyper).step
        kinds["torch fused bf16"] = "torch_bf16"
        for mode in ("fp32_master", "bf16_sr", "bf16_kahan"):
            cases[f"llmpar {mode}"] = FusedAdamW(params, precision=mode, **hyper).step
            kinds[f"llmpar {mode}"] = mode
        if device.type == "cuda" and deepspeed:
            ds = deepspeed_case(make_params(shapes, torch.float32, device))
            if ds is not None:
                cases["deepspeed FusedAdam fp32"] = ds
                kinds["deepspeed FusedAdam fp32"] = "deepspeed"
        baseline = "torch fused bf16"
    cmp = compare(cases, baseline=baseline, warmup=warmup, repeats=repeats, device=device)
    rows = []
    for row in cmp.rows(size=f"{n_params / 1e6:.0f}M", tensors=len(shapes), group=group):
        extra = (4 if not bf16 else 2) if group == "fp32+clip" else 0
        gbs = (BYTES[kinds[row["name"]]] + extra) * n_params / (row["median_ms"] / 1e3) / 1e9
        row["GB/s"] = gbs
        row["% copy BW"] = 100 * gbs / copy_gbs
        rows.append(row)
    print(cmp.table())
    del cases
    params = None  # drop the params (not `del`: torch_clip_step above reads the name)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--sizes",
        nargs="+",
        default=None,
        choices=list(PRESETS),
        help="model sizes (default: 10M 30M 100M on CPU, 10M 100M 1B on CUDA)",
    )
    ap.add_argument("--groups", nargs="+", default=["fp32", "fp32+clip", "bf16"])
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument(
        "--deepspeed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time DeepSpeed's FusedAdam too where importable (--no-deepspeed: machines without it)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sizes = args.sizes or (["10M", "100M", "1B"] if cuda else ["10M", "30M", "100M"])
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    repeats = args.repeats if args.repeats is not None else (30 if cuda else 7)
    copy_gbs = copy_bandwidth(device)
    print(f"device {device}: copy bandwidth {copy_gbs:.1f} GB/s; torch threads {torch.get_num_threads()}")
    rows: list[dict] = []
    for size in sizes:
        shapes = gpt_shapes(*PRESETS[size])
        n_params = sum(torch.Size(s).numel() for s in shapes)
        for group in args.groups:
            print(f"== {size} ({n_params / 1e6:.1f}M params, {len(shapes)} tensors), {group}")
            rows += run_group(group, n_params, shapes, device, warmup, repeats, copy_gbs, args.deepspeed)
    meta = {
        "copy_bandwidth_GBps": round(copy_gbs, 1),
        "torch_threads": torch.get_num_threads(),
        "bytes_per_param_floor": BYTES,
        "hyper": "lr=1e-4, weight_decay=0.1, betas=(0.9, 0.999)",
        "speedup": "baseline median / case median, per group (fp32: torch fused; fp32+clip: torch clip_grad_norm_ "
        "+ fused; bf16: torch fused on bf16 params)",
    }
    paths = write_results(f"optim_{device.type}", rows, meta, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
