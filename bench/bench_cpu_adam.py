"""Benchmark: the CPU AdamW step of ZeRO-Offload (llmpar's C++ kernel, llmpar.ops.cpu_adamw_step) vs torch's fused
CPU AdamW and the other CPU AdamWs, side by side in one interleaved run, at 10M, 30M and 100M float32 params.

    python bench/bench_cpu_adam.py                              # 10M 30M 100M, both groups, both layouts
    python bench/bench_cpu_adam.py --sizes 10M --layouts flat --repeats 5

Groups (the cases of a group share the params and grads; each optimizer keeps its own moments, llmpar's cases one set):
    step     the AdamW step alone:
             torch fused (baseline: torch.optim.AdamW(fused=True).step()) | torch foreach | deepspeed cpu adam
             (DeepSpeedCPUAdam(adamw_mode=True), its C++ AVX kernel, when importable) | llmpar torch path (what the
             offload step ran before: adamw_step(precision="fp32"), i.e. torch._fused_adamw_) | llmpar kernel |
             streams floor (no math): a C++ loop moving the same 28 bytes per param with one add, the memory floor
    offload  what ZeRO-Offload does each step: AdamW with the clip coefficient folded in (gscale = 1 here: the grads are
             reused across repeats, a real clip would shrink them into denormals), then the params' bf16 copy:
             llmpar before (baseline: adamw_step with gscale, whose fused kernel writes the unscaled grads back,
             then a bf16 copy pass) | torch fused (the bare step above, for reference) | deepspeed cpu adam + copy |
             llmpar kernel+bf16 (gscale and the bf16 copy in the same pass)
Layouts: "flat" = what the offload step sees: one flat float32 buffer cut into one slice per ZeRO unit (two GPT layers
a unit); "gpt" = GPT-shaped parameter lists (bench_optim.py's: a few big matrices, many small vectors).
GB/s = the bytes a step must move (per param: AdamW 28 B: p, g, m, v read, p, m, v written; +2 B for a bf16 copy in
the same pass; +4 B for writing unscaled grads back; +6 B for a separate bf16 copy pass) / median time, next to the
machine's copy bandwidth (``dst.copy_(src)`` of 256 MiB, read + written bytes). Results: bench/results/cpu_adam.*
DeepSpeed runs with its CPU accelerator (``DS_ACCELERATOR=cpu``, set here when unset).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optim import PRESETS, copy_bandwidth, gpt_shapes  # noqa: E402

from llmpar.ops import _cpu_ext  # noqa: E402
from llmpar.ops.adamw import adamw_step  # noqa: E402
from llmpar.ops.cpu_adam import ISAS, cpu_adamw_step, isa_code  # noqa: E402

from harness import compare, write_results  # noqa: E402

HYPER = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
BYTES = {"adamw": 28, "adamw+bf16": 30, "adamw+copy": 34, "adamw+grads+copy": 38}
BASELINES = {"step": "torch fused", "offload": "llmpar before"}


def make_params(shapes: list[tuple[int, ...]], layout: str) -> list[torch.nn.Parameter]:
    """float32 params with grads; "flat": slices of one buffer, one per unit of two GPT layers (as ZeRO lays out)."""
    numels = [torch.Size(s).numel() for s in shapes]
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(sum(numels), generator=g).mul_(0.02)
    grad = torch.randn(sum(numels), generator=g).mul_(1e-3)
    if layout == "flat":  # embeddings, then 2 layers (24 tensors) per unit, the final norm with the last unit
        cuts, start = [0, numels[0] + numels[1]], 2
        while start < len(numels):
            start = min(start + 24, len(numels))
            cuts.append(sum(numels[:start]))
        numels = [b - a for a, b in zip(cuts, cuts[1:])]
    params, offset = [], 0
    for n in numels:
        p = torch.nn.Parameter(flat[offset : offset + n])
        p.grad = grad[offset : offset + n]
        params.append(p)
        offset += n
    return params


def deepspeed_step(params) -> Callable[[], object] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # builds its C++ op on first use (TORCH_EXTENSIONS_DIR)

        opt = DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)
        opt.step()
        return opt.step
    except Exception as exc:  # noqa: BLE001 - an optional baseline
        print(f"  (DeepSpeedCPUAdam skipped: {type(exc).__name__}: {str(exc)[:160]})")
        return None


_STREAMS_SRC = """
#include <torch/extension.h>
// The bytes of an AdamW step with no math: per element read p, g, m, v and write p, m, v (one add each).
void streams(std::vector<torch::Tensor> ps, std::vector<torch::Tensor> gs, std::vector<torch::Tensor> ms,
             std::vector<torch::Tensor> vs) {
  for (size_t t = 0; t < ps.size(); ++t) {
    float* __restrict p = ps[t].data_ptr<float>();
    const float* __restrict g = gs[t].data_ptr<float>();
    float* __restrict m = ms[t].data_ptr<float>();
    float* __restrict v = vs[t].data_ptr<float>();
    const int64_t n = ps[t].numel();
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i];
      p[i] += x;
      m[i] += x;
      v[i] += x;
    }
  }
}
"""


def streams_floor() -> Callable[..., None] | None:
    """The memory floor of the step: a C++ loop (``-O3 -march=native``, vectorised by the compiler) moving the same
    28 bytes per param as AdamW with one add instead of the math; None when it does not build."""
    import tempfile

    from torch.utils.cpp_extension import load_inline

    try:
        build = tempfile.mkdtemp(prefix="llmpar_bench_streams_")
        mod = load_inline(
            "llmpar_bench_streams",
            cpp_sources=_STREAMS_SRC,
            functions=["streams"],
            extra_cflags=["-O3", "-march=native"],
            build_directory=build,
            verbose=False,
        )
        return mod.streams
    except Exception as exc:  # noqa: BLE001 - an optional floor
        print(f"  (streams floor skipped: {type(exc).__name__}: {str(exc)[:160]})")
        return None


def cases_for(
    group: str, params, deepspeed: bool, floor: Callable[..., None] | None = None
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """{name: step()} and {name: key of BYTES} of one group."""
    cases: dict[str, Callable[[], object]] = {}
    kinds: dict[str, str] = {}

    def add(name: str, fn: Callable[[], object] | None, kind: str) -> None:
        if fn is not None:
            cases[name], kinds[name] = fn, kind

    ps = [p.detach() for p in params]
    gs = [p.grad for p in params]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    steps = [torch.zeros((), dtype=torch.float32) for _ in ps]
    outs = [torch.empty(p.shape, dtype=torch.bfloat16) for p in ps]
    kw = dict(
        lr=HYPER["lr"],
        beta1=HYPER["betas"][0],
        beta2=HYPER["betas"][1],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    one = torch.ones((), dtype=torch.float32)
    ds = deepspeed_step(params) if deepspeed else None
    if group == "step":
        add("torch fused", torch.optim.AdamW(params, fused=True, **HYPER).step, "adamw")
        add("torch foreach", torch.optim.AdamW(params, foreach=True, **HYPER).step, "adamw")
        add("deepspeed cpu adam", ds, "adamw")
        add("llmpar torch path", lambda: adamw_step(ps, gs, ms, vs, steps, precision="fp32", **kw), "adamw")
        add("llmpar kernel", lambda: cpu_adamw_step(ps, gs, ms, vs, steps, **kw), "adamw")
        if floor is not None:  # the same streams with no math: what any AdamW step over them costs at least
            fm, fv = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
            fp = [p.clone() for p in ps]
            add("streams floor (no math)", lambda: floor(fp, gs, fm, fv), "adamw")
        return cases, kinds

    def before() -> None:  # llmpar.zero.offload.host_step_buffer until now
        adamw_step(ps, gs, ms, vs, steps, precision="fp32", gscale=one, **kw)
        torch._foreach_copy_(outs, ps)

    def ds_copy() -> None:
        ds()
        torch._foreach_copy_(outs, ps)

    add("llmpar before", before, "adamw+grads+copy")
    add("torch fused", torch.optim.AdamW(params, fused=True, **HYPER).step, "adamw")
    add("deepspeed cpu adam + copy", ds_copy if ds is not None else None, "adamw+copy")
    add("llmpar kernel+bf16", lambda: cpu_adamw_step(ps, gs, ms, vs, steps, gscale=one, outs=outs, **kw), "adamw+bf16")
    return cases, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["10M", "30M", "100M"], choices=list(PRESETS))
    ap.add_argument("--layouts", nargs="+", default=["flat", "gpt"], choices=["flat", "gpt"])
    ap.add_argument("--groups", nargs="+", default=["step", "offload"], choices=list(BASELINES))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--name", default="cpu_adam", help="results file stem")
    ap.add_argument(
        "--deepspeed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time DeepSpeedCPUAdam too where importable",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_avg = os.getloadavg()[0]  # other work on the machine: an oversubscribed one distorts multi-thread ratios
    status = _cpu_ext.load()
    if not status.available:
        sys.exit(f"the CPU extension is unavailable ({status.reason}): nothing to compare")
    copy_gbs = copy_bandwidth(torch.device("cpu"))
    floor = streams_floor()
    isa = f"{ISAS[isa_code()]} cap, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    print(f"copy bandwidth {copy_gbs:.1f} GB/s; torch threads {torch.get_num_threads()}; kernel ISA: {isa}")
    rows: list[dict] = []
    for size in args.sizes:
        shapes = gpt_shapes(*PRESETS[size])
        n = sum(torch.Size(s).numel() for s in shapes)
        for layout in args.layouts:
            for group in args.groups:
                params = make_params(shapes, layout)
                cases, kinds = cases_for(group, params, args.deepspeed, floor)
                print(f"== {size} ({n / 1e6:.1f}M params), {group}, layout {layout}: {len(params)} tensors")
                cmp = compare(cases, baseline=BASELINES[group], warmup=args.warmup, repeats=args.repeats)
                print(cmp.table())
                fused = cmp.timings["torch fused"].median_s
                for row in cmp.rows(
                    size=size, params_M=round(n / 1e6, 1), group=group, layout=layout, tensors=len(params)
                ):
                    gbs = BYTES[kinds[row["name"]]] * n / (row["median_ms"] / 1e3) / 1e9
                    row["vs torch fused"] = fused / (row["median_ms"] / 1e3)
                    row["GB/s"], row["% copy BW"] = gbs, 100 * gbs / copy_gbs
                    rows.append(row)
                del cases, params
                gc.collect()
    meta = {
        "copy_bandwidth_GBps": round(copy_gbs, 1),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": round(load_avg, 2),
        "kernel_isa": isa,
        "cpu_ext": status.reason.split(" in ")[0],
        "bytes_per_param": BYTES,
        "hyper": "lr=1e-4, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8",
        "speedup": "baseline median / case median, per group (step: torch fused; offload: llmpar before, i.e. "
        "torch._fused_adamw_ with grad_scale + a bf16 copy pass); vs torch fused: torch fused's median "
        "(the bare step) / case median",
    }
    paths = write_results(args.name, rows, meta, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
