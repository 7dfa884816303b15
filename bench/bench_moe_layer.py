"""Benchmark: the MoE block forward + backward, llmpar's ``MoEBlock`` against transformers' Qwen3-MoE block
(its eager experts and its ``grouped_mm`` experts backend), side by side on the same weights and tokens.

    python bench/bench_moe_layer.py                      # CPU (one thread), 8 and 16 experts: the committed figures
    python bench/bench_moe_layer.py --experts 8 16 32 --tokens 2048 --hidden 1024 --intermediate 384

Timed: ``out = block(x); out.backward(g)`` for ``x: [B, S, H]`` (input gradient included), the blocks holding the
same router and expert weights (llmpar's packed experts are transformers' tensors as they are). Before timing,
the outputs are checked to agree (1e-5). ``ratio`` = median time / transformers-eager median time (< 1: faster),
``ratio_of_mins`` the same for the fastest repeats. Results:
bench/results/moe_layer_cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmpar.moe import MoEBlock, RouterConfig  # noqa: E402

from harness import compare, write_results  # noqa: E402


def _blocks(experts: int, top_k: int, hidden: int, inter: int, backends: list[str]) -> dict[str, torch.nn.Module]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    ours = MoEBlock(hidden, inter, experts, top_k, router=RouterConfig(route_norm=True), init_std=0.05)
    blocks: dict[str, torch.nn.Module] = {}
    for backend in backends:
        cfg = Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
        )
        cfg._experts_implementation = backend
        hf = Qwen3MoeSparseMoeBlock(cfg)
        with torch.no_grad():  # the same tensors, copied as they are
            hf.gate.weight.copy_(ours.router.weight)
            hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
            hf.experts.down_proj.copy_(ours.experts.down_proj)
        blocks[f"transformers_{backend}"] = hf
    blocks["llmpar"] = ours
    return blocks


def _step(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
    def run() -> None:
        x.grad = None
        block(x).backward(g)

    return run


def measure(blocks: dict[str, torch.nn.Module], experts: int, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Check every block gives llmpar's output on one random batch, then time their forward + backward side by side
    against transformers' eager experts and print the table: ``(rows, cases)``, each row with its ``ratio`` and
    ``ratio_of_mins`` (on a shared machine the fastest repeats are the least disturbed)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).requires_grad_()
    g = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
    with torch.no_grad():
        ref = blocks["llmpar"](x)
        for name, block in blocks.items():
            torch.testing.assert_close(block(x), ref, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    cases = {name: _step(block, x, g) for name, block in blocks.items()}
    cmp = compare(cases, baseline="transformers_eager", warmup=args.warmup, repeats=args.repeats)
    print(
        f"\n{experts} experts, top-{args.top_k}, tokens {args.batch * args.seq}, H {args.hidden}, I {args.intermediate}"
    )
    print(cmp.table())
    rows = cmp.rows(experts=experts, top_k=args.top_k, tokens=args.batch * args.seq)
    for row in rows:
        row["ratio"] = cmp.ratio(row["name"])
        row["ratio_of_mins"] = cmp.timings[row["name"]].min_s / cmp.timings["transformers_eager"].min_s
    return rows, cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16])
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=192)
    p.add_argument("--backends", nargs="+", default=["eager", "grouped_mm"], help="transformers experts backends")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 by default: on a shared 2-core machine two threads' repeats spread wider "
        "than their median (0: torch's default)",
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for experts in args.experts:
        blocks = _blocks(experts, args.top_k, args.hidden, args.intermediate, args.backends)
        rows += measure(blocks, experts, args)[0]
    if not args.no_write:
        import transformers

        meta = {
            "transformers": transformers.__version__,
            "what": "MoE block forward + backward (input gradient included), Qwen3-MoE block shapes",
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "threads": torch.get_num_threads(),
            "goal": "llmpar <= 0.5x transformers eager; faster than transformers grouped_mm at 8+ experts",
        }
        paths = write_results("moe_layer_cpu", rows, meta=meta)
        print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
