"""``llmpar plan`` (layout planner) and ``llmpar chinchilla`` (compute-optimal sizing, time to train).

llmpar plan --model llama-7b --gpus 64 --gpu-mem 80GB [--nodes 8] [--seq 4096] [--micro-batch 1]
            [--global-batch 1024] [--gpu h100] [--precision fp32_master] [--mfu 0.5] [--top 10] [--json]
            [--zeropp] [--seq-len 131072 --context-parallel auto|on|off] [--ep 8]
llmpar chinchilla --compute 5.76e23 [--params 70B | --tokens 1.4T] [--model llama-7b] [--gpus 1024 --gpu h100
                  --mfu 0.4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from .chinchilla import chinchilla, flops_per_token, time_to_train
from .memory import PRECISION_BYTES
from .planner import PlanRequest, plan
from .presets import GPU_PRESETS, MODEL_PRESETS, Hardware, load_gpu, load_model
from .report import chinchilla_table, plan_json, plan_table
from .units import parse_bytes, parse_count


def register(subparsers: Any) -> None:
    """Add the ``plan`` and ``chinchilla`` subcommands to an argparse subparsers object."""
    p = subparsers.add_parser(
        "plan", help="rank the parallel layouts that fit a model on a cluster", description=run_plan.__doc__
    )
    p.add_argument("--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}) or a JSON config path")
    p.add_argument("--gpus", required=True, type=int, help="number of GPUs")
    p.add_argument("--gpu", default="h100", help=f"GPU type for speeds ({', '.join(GPU_PRESETS)}); default h100")
    p.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 80GB or 80GiB (default: the GPU type's)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: 8 GPUs per node)")
    p.add_argument(
        "--seq", "--seq-len", dest="seq", type=int, default=None, help="sequence length (default: the model's)"
    )
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per step (default: a multiple of gpus x micro-batch holding >= 4M tokens)",
    )
    p.add_argument("--precision", default="fp32_master", choices=list(PRECISION_BYTES))
    p.add_argument("--mfu", type=float, default=0.5, help="fraction of peak FLOP/s the matmuls reach (default 0.5)")
    p.add_argument("--reserve", default="2GB", help="GPU memory kept free for the CUDA context etc. (default 2GB)")
    p.add_argument("--cpu-mem", default=None, help="host memory per node for offload (default 1TB)")
    p.add_argument("--no-offload", action="store_true", help="do not consider CPU offload")
    p.add_argument("--no-sequence-parallel", action="store_true", help="tp without sequence parallelism")
    p.add_argument(
        "--zeropp",
        action="store_true",
        help="also try ZeRO++ (qwZ int8 + hpZ over a node + qgZ int4) for ZeRO-2/3 over several nodes",
    )
    p.add_argument(
        "--context-parallel",
        choices=("auto", "on", "off"),
        default="auto",
        help="context parallelism (Ulysses / ring / hybrid over cp ranks) with the tiled loss and MLP: "
        "auto (default) tries it when no other layout fits, on always, off never",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel ranks of a mixture-of-experts model (dividing its experts and dp x cp); default: per "
        "layout the smallest within a node whose memory fits",
    )
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_plan)

    c = subparsers.add_parser(
        "chinchilla",
        help="compute-optimal model size / tokens, FLOPs and time to train",
        description=run_chinchilla.__doc__,
    )
    c.add_argument("--compute", default=None, help="training FLOPs C, e.g. 5.76e23")
    c.add_argument("--params", default=None, help="parameters N, e.g. 7e9 or 7B")
    c.add_argument("--tokens", default=None, help="training tokens D, e.g. 1.4e12 or 1.4T")
    c.add_argument("--tokens-per-param", type=float, default=20.0, help="compute-optimal D / N (default 20)")
    c.add_argument("--model", default=None, help="preset or JSON config: gives N and the shape for FLOPs/token")
    c.add_argument("--seq", type=int, default=None, help="sequence length for FLOPs/token (default: the model's)")
    c.add_argument("--gpus", type=int, default=None, help="GPUs, for time to train")
    c.add_argument("--gpu", default="h100", help="GPU type for the peak FLOP/s (default h100)")
    c.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per GPU (overrides --gpu)")
    c.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.set_defaults(func=run_chinchilla)


def _fail(command: str, exc: Exception) -> int:
    print(f"llmpar {command}: error: {exc}", file=sys.stderr)
    return 2


def build_request(args: argparse.Namespace) -> PlanRequest:
    """A PlanRequest from parsed ``plan`` arguments (ValueError on bad values)."""
    if args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be a positive integer")
    spec = load_model(args.model)
    if args.seq is not None:
        if args.seq < 1:
            raise ValueError(f"--seq {args.seq} must be a positive integer")
        spec = replace(spec, seq_len=args.seq)
    hw: Hardware = load_gpu(args.gpu)
    if args.gpu_mem is not None:
        hw = replace(hw, mem_bytes=parse_bytes(args.gpu_mem, name="--gpu-mem"))
    if args.cpu_mem is not None:
        hw = replace(hw, cpu_mem_per_node=parse_bytes(args.cpu_mem, name="--cpu-mem"))
    if args.nodes is not None:
        if args.nodes < 1 or args.gpus % args.nodes:
            raise ValueError(f"--nodes {args.nodes} must be a positive divisor of --gpus {args.gpus}")
        hw = replace(hw, gpus_per_node=args.gpus // args.nodes)
    if args.top < 1:
        raise ValueError(f"--top {args.top} must be a positive integer")
    return PlanRequest(
        model=spec,
        gpus=args.gpus,
        hardware=hw,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        precision=args.precision,
        mfu=args.mfu,
        reserve_bytes=parse_bytes(args.reserve, name="--reserve") if args.reserve != "0" else 0.0,
        allow_offload=not args.no_offload,
        sequence_parallel=not args.no_sequence_parallel,
        zeropp=args.zeropp,
        context_parallel=args.context_parallel,
        ep=args.ep,
    )


def run_plan(args: argparse.Namespace) -> int:
    """Rank the layouts (tp, pp, dp, ZeRO stage, offload, recompute) that fit, fastest first. Exit status 1 when
    nothing fits (the message names the smallest cluster that would)."""
    try:
        result = plan(build_request(args))
    except ValueError as exc:
        return _fail("plan", exc)
    print(plan_json(result, top=args.top) if args.json else plan_table(result, top=args.top))
    return 0 if result.ranked else 1


def chinchilla_report(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The ChinchillaResult and extras (FLOPs per token, time to train) for parsed ``chinchilla`` arguments."""
    compute = parse_count(args.compute, name="--compute") if args.compute is not None else None
    params = parse_count(args.params, name="--params") if args.params is not None else None
    tokens = parse_count(args.tokens, name="--tokens") if args.tokens is not None else None
    spec = load_model(args.model) if args.model is not None else None
    if spec is not None and args.seq is not None:
        spec = replace(spec, seq_len=args.seq)
    if spec is not None and params is None and (compute is None or tokens is None):
        params = float(spec.num_params())
    res = chinchilla(compute=compute, params=params, tokens=tokens, tokens_per_param=args.tokens_per_param)
    extra: dict[str, Any] = {}
    total = res.compute
    if spec is not None:
        fpt = flops_per_token(
            params=spec.matmul_params(), n_layers=spec.n_layers, hidden=spec.hidden, seq_len=spec.seq_len
        )
        total = fpt * res.tokens
        extra.update(
            flops_per_token=fpt,
            compute_with_attention=total,
            flops_model=f"{spec.name}, L={spec.n_layers} h={spec.hidden} s={spec.seq_len}",
        )
    if args.gpus is not None:
        peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else load_gpu(args.gpu).peak_flops
        seconds = time_to_train(compute=total, gpus=args.gpus, peak_flops=peak, mfu=args.mfu)
        extra.update(
            seconds=seconds, gpus=args.gpus, peak_flops=peak, mfu=args.mfu, gpu_hours=seconds * args.gpus / 3600
        )
    return res, extra


def run_chinchilla(args: argparse.Namespace) -> int:
    """Given one of compute C, params N, tokens D: the compute-optimal other two (D = 20 N, C = 6 N D, so
    N = sqrt(C / 120)); given two: the third. With --model, FLOPs per token with attention; with --gpus, time to
    train."""
    try:
        res, extra = chinchilla_report(args)
    except ValueError as exc:
        return _fail("chinchilla", exc)
    if args.json:
        print(json.dumps({**res.to_dict(), **extra}, indent=2))
    else:
        print(chinchilla_table(res, extra))
    return 0
