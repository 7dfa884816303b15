"""Benchmark: the ZeRO-Offload host step with 8- and 4-bit AdamW states (llmpar's CPU kernel, csrc/cpu/adam_lowbit*)
vs torch's fused CPU AdamW (fp32 states), llmpar's fp32 CPU kernel and torchao's AdamW8bit / AdamW4bit on the CPU,
side by side in one interleaved run, at 10M, 30M and 100M params.

    python bench/bench_lowbit_adam.py                       # 10M 30M 100M
    python bench/bench_lowbit_adam.py --sizes 10M --repeats 5
    python bench/bench_lowbit_adam.py --device cuda        # GPU: torch fused vs llmpar CUDA / Triton int8, int4
    python bench/bench_lowbit_adam.py --sizes 10M --isas scalar avx2 avx512 --name lowbit_adam_cpu_isas
                                                           # + the low-bit kernel capped at each CPU build

Cases (all share one flat float32 param buffer and its grad, as the offload step sees a ZeRO flat shard; each keeps
its own state):
    torch fused            torch.optim.AdamW(fused=True).step(): fp32 m, v (the baseline)
    torch fused + bf16     the same, then the bf16 copy of the params the offload step hands back (out.copy_(p)):
                           what torch does for the whole host step; the low-bit cases write that copy in their pass
    llmpar fp32+bf16       llmpar.ops.cpu_adamw_step with the bf16 copy of the params in the same pass
    llmpar int8+bf16       llmpar.ops.lowbit_kernels.cpu_step, 8-bit m, v, float32 master, bf16 params in the pass
    llmpar int4+bf16       the same with 4-bit m, v
    torchao AdamW8bit/4bit torchao.optim on the CPU (fp32 params; its step is torch.compile'd), when it imports
Bytes per param a step must move (read + written), the floor each case is held to: torch fused 28 (p, g, m, v read;
p, m, v written), + bf16 34 (p read again, 2 written); llmpar fp32+bf16 30; int8+bf16 18 + scales (master 8, grad 4,
codes 2 + 2, bf16 2); int4+bf16 16 + scales; torchao int8 / int4 (fp32 params, no copy): 14 / 13 + scales. On the GPU
(--device cuda, results lowbit_adam_gpu.*): torch fused (fp32 params, m, v), then llmpar's CUDA and Triton kernels
with bf16 params + float32 masters (the bytes of int8+bf16 / int4+bf16). GB/s = those bytes / median time, next to the
machine's copy bandwidth (dst.copy_(src) of 256 MiB, bytes read + written). Results: bench/results/lowbit_adam_cpu.*
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optim import copy_bandwidth  # noqa: E402

from llmpar.ops import _cpu_ext, lowbit  # noqa: E402
from llmpar.ops.cpu_adam import ISA_ENV, ISAS, cpu_adamw_step, isa_code  # noqa: E402
from llmpar.ops.lowbit_kernels import cpu_step, cuda_step, triton_step  # noqa: E402

from harness import compare, write_results  # noqa: E402

# multiples of 256: torchao quantizes a param's state only when its numel is a multiple of the block size (else it
# keeps float32 m, v silently); the bench checks that its states are quantized
SIZES = {"10M": 10_000_128, "30M": 30_000_128, "100M": 100_000_000}
HYPER = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
BASELINE = "torch fused"


def state_bytes_per_param(bits: int) -> float:
    """codes read + written and scales read + written, per param, for m and v together."""
    return 2 * 2 * (bits / 8 + 4 / lowbit.BLOCK[bits])


BYTES = {
    "torch fused": 28.0,
    "torch fused + bf16": 34.0,
    "llmpar cuda int8+bf16": 14.0 + state_bytes_per_param(8),
    "llmpar cuda int4+bf16": 14.0 + state_bytes_per_param(4),
    "llmpar triton int8+bf16": 14.0 + state_bytes_per_param(8),
    "llmpar triton int4+bf16": 14.0 + state_bytes_per_param(4),
    "llmpar fp32+bf16": 30.0,
    "llmpar int8+bf16": 14.0 + state_bytes_per_param(8),
    "llmpar int4+bf16": 14.0 + state_bytes_per_param(4),
    "torchao AdamW8bit": 12.0 + state_bytes_per_param(8),
    "torchao AdamW4bit": 12.0 + state_bytes_per_param(4),
}


def torchao_step(params: list[torch.nn.Parameter], bits: int) -> tuple[Callable[[], object] | None, str]:
    """torchao's AdamW8bit / AdamW4bit on the CPU, warmed up (its first step compiles); (None, why) if it fails."""
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        cls = AdamW8bit if bits == 8 else AdamW4bit
        opt = cls(params, **HYPER)
        start = time.perf_counter()
        opt.step()
        kind = type(opt.state[params[0]]["exp_avg"]).__name__
        if kind == "Tensor":
            return None, f"its state stayed float32 ({kind}): not a low-bit step"
        return opt.step, f"first step (compile) {time.perf_counter() - start:.1f} s, state {kind}"
    except Exception as exc:  # noqa: BLE001 - an optional baseline
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def with_isa(fn: Callable[[], object], isa: str) -> Callable[[], object]:
    """fn run under LLMPAR_CPU_ISA=isa (the kernel reads it per call)."""

    def run() -> object:
        old = os.environ.get(ISA_ENV)
        os.environ[ISA_ENV] = isa
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(ISA_ENV, None)
            else:
                os.environ[ISA_ENV] = old

    return run


def bytes_of(name: str) -> float:
    return BYTES[name.split(" [")[0]]  # "llmpar int8+bf16 [avx2]": the bytes of its kernel


def cases_for(
    n: int, torchao: bool, isas: list[str] | None = None
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(n, generator=g).mul_(0.02)
    grad = torch.randn(n, generator=g).mul_(1e-3)
    param = torch.nn.Parameter(flat)
    param.grad = grad
    cases: dict[str, Callable[[], object]] = {}
    notes: dict[str, str] = {}
    cases[BASELINE] = torch.optim.AdamW([param], fused=True, **HYPER).step
    twin = torch.nn.Parameter(param.detach().clone())
    twin.grad = grad
    twin_step, twin16 = torch.optim.AdamW([twin], fused=True, **HYPER).step, torch.empty(n, dtype=torch.bfloat16)
    cases["torch fused + bf16"] = lambda: (twin_step(), twin16.copy_(twin.detach()))
    kw = dict(
        lr=HYPER["lr"],
        beta1=HYPER["betas"][0],
        beta2=HYPER["betas"][1],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    p32 = [param.detach()]
    m32, v32 = [torch.zeros(n)], [torch.zeros(n)]
    s32 = [torch.zeros(())]
    out16 = [torch.empty(n, dtype=torch.bfloat16)]
    cases["llmpar fp32+bf16"] = lambda: cpu_adamw_step(p32, [grad], m32, v32, s32, outs=out16, **kw)
    for bits in (8, 4):
        master = [param.detach().clone()]
        bf16 = [master[0].to(torch.bfloat16)]
        st = lowbit.new_state(n, bits)
        steps = [torch.zeros(())]
        qm, qv = lowbit.qmap(bits, True), lowbit.qmap(bits, False)

        def step(bits=bits, master=master, bf16=bf16, st=st, steps=steps, qm=qm, qv=qv):
            cpu_step(
                bf16,
                [grad],
                [st["m_codes"]],
                [st["m_scale"]],
                [st["v_codes"]],
                [st["v_scale"]],
                steps,
                master,
                bits=bits,
                qmap_m=qm,
                qmap_v=qv,
                **kw,
            )

        cases[f"llmpar int{bits}+bf16"] = step
        for isa in isas or ():  # the same kernel capped at narrower builds, side by side
            cases[f"llmpar int{bits}+bf16 [{isa}]"] = with_isa(step, isa)
    if torchao:
        for bits in (8, 4):
            p = torch.nn.Parameter(param.detach().clone())
            p.grad = grad
            fn, note = torchao_step([p], bits)
            notes[f"torchao AdamW{bits}bit"] = note
            print(f"  torchao AdamW{bits}bit: {note}")
            if fn is not None:
                cases[f"torchao AdamW{bits}bit"] = fn
    return cases, notes


def gpu_cases(n: int) -> dict[str, Callable[[], object]]:
    """torch fused AdamW on the GPU, and llmpar's CUDA and Triton low-bit kernels (bf16 params, float32 masters)."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, device=device, generator=g).mul_(0.02))
    grad = torch.randn(n, device=device, generator=g).mul_(1e-3)
    param.grad = grad
    cases: dict[str, Callable[[], object]] = {BASELINE: torch.optim.AdamW([param], fused=True, **HYPER).step}
    kw = dict(
        lr=HYPER["lr"],
        beta1=HYPER["betas"][0],
        beta2=HYPER["betas"][1],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    for backend, fn in (("cuda", cuda_step), ("triton", triton_step)):
        for bits in (8, 4):
            master = [param.detach().clone()]
            bf16 = [master[0].to(torch.bfloat16)]
            st = lowbit.new_state(n, bits, device)
            steps = [torch.zeros((), device=device)]
            qm, qv = lowbit.qmap(bits, True, device), lowbit.qmap(bits, False, device)

            def step(fn=fn, bits=bits, master=master, bf16=bf16, st=st, steps=steps, qm=qm, qv=qv):
                fn(
                    bf16,
                    [grad],
                    [st["m_codes"]],
                    [st["m_scale"]],
                    [st["v_codes"]],
                    [st["v_scale"]],
                    steps,
                    master,
                    bits=bits,
                    qmap_m=qm,
                    qmap_v=qv,
                    **kw,
                )

            cases[f"llmpar {backend} int{bits}+bf16"] = step
    return cases


def main_gpu(args) -> None:
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s")
    rows: list[dict] = []
    for size in args.sizes:
        n = SIZES[size]
        cases = gpu_cases(n)
        cmp = compare(cases, baseline=BASELINE, warmup=args.warmup, repeats=args.repeats, device=device)
        print(f"== {size}\n{cmp.table()}")
        for row in cmp.rows(size=size, params_M=round(n / 1e6, 1)):
            gbs = bytes_of(row["name"]) * n / (row["median_ms"] / 1e3) / 1e9
            row["bytes/param"] = round(bytes_of(row["name"]), 2)
            row["GB/s"], row["% copy BW"] = gbs, 100 * gbs / copy_gbs
            rows.append(row)
        del cases
        torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_GBps": round(copy_gbs, 1),
        "hyper": str(HYPER),
        "speedup": "torch fused's median / case median (side by side, interleaved rounds)",
    }
    paths = write_results(args.name.replace("_cpu", "_gpu"), rows, meta, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--name", default="lowbit_adam_cpu", help="results file stem")
    ap.add_argument(
        "--torchao",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time torchao's AdamW8bit / AdamW4bit too where importable",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--isas",
        nargs="*",
        default=[],
        choices=list(ISAS),
        help="also time the low-bit kernel capped at these CPU builds (LLMPAR_CPU_ISA), e.g. avx2 avx512",
    )
    args = ap.parse_args()
    if args.device == "cuda":
        return main_gpu(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_avg = os.getloadavg()
    status = _cpu_ext.load()
    if not status.available:
        sys.exit(f"the CPU extension is unavailable ({status.reason}): nothing to compare")
    copy_gbs = copy_bandwidth(torch.device("cpu"))
    isa = f"{ISAS[isa_code()]} cap, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    print(
        f"copy bandwidth {copy_gbs:.1f} GB/s; torch threads {torch.get_num_threads()}; kernel ISA: {isa}; "
        f"load average {load_avg}"
    )
    rows: list[dict] = []
    notes: dict[str, str] = {}
    for size in args.sizes:
        n = SIZES[size]
        cases, size_notes = cases_for(n, args.torchao, args.isas)
        notes.update({f"{size} {k}": v for k, v in size_notes.items()})
        print(f"== {size}: {', '.join(cases)}")
        cmp = compare(cases, baseline=BASELINE, warmup=args.warmup, repeats=args.repeats)
        print(cmp.table())
        for row in cmp.rows(size=size, params_M=round(n / 1e6, 1)):
            gbs = bytes_of(row["name"]) * n / (row["median_ms"] / 1e3) / 1e9
            row["bytes/param"] = round(bytes_of(row["name"]), 2)
            row["GB/s"], row["% copy BW"] = gbs, 100 * gbs / copy_gbs
            row["floor_ms"] = bytes_of(row["name"]) * n / (copy_gbs * 1e9) * 1e3
            rows.append(row)
        del cases
        gc.collect()
    meta = {
        "copy_bandwidth_GBps": round(copy_gbs, 1),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start (1, 5, 15 min)": tuple(round(x, 2) for x in load_avg),
        "load_average_at_end (1, 5, 15 min)": tuple(round(x, 2) for x in os.getloadavg()),
        "kernel_isa": isa,
        "cpu_ext": status.reason.split(" in ")[0],
        "hyper": str(HYPER),
        "speedup": "torch fused's median / case median (side by side, interleaved rounds)",
        "floor_ms": "bytes/param * params / copy bandwidth: the step at the machine's copy speed",
        **notes,
    }
    paths = write_results(args.name, rows, meta, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
