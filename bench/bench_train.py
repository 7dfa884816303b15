"""Training-step time of the small GPT (forward + backward + AdamW), per model width, on one device.

    python bench/bench_train.py                       # CPU, writes bench/results/train_step.{json,md}
    python bench/bench_train.py --device cuda --widths 256 512 1024 --dtype bfloat16

Cases, timed side by side in one run: the optimizer step as a per-tensor loop (``foreach=False``, the baseline)
and batched (``foreach=True``); later the fused llmpar optimizer joins here as a third case.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llmpar.models import GPT, GPTConfig  # noqa: E402

from harness import compare, write_results  # noqa: E402


def step_fn(width: int, *, layers: int, batch: int, seq: int, device: str, dtype: torch.dtype, foreach: bool):
    cfg = GPTConfig(vocab_size=256, n_layer=layers, n_head=max(1, width // 64), d_model=width, seq_len=seq)
    model = GPT(cfg, seed=0, device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, seq), generator=gen).to(device)
    y = torch.randint(0, 256, (batch, seq), generator=gen).to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model.loss(model(x), y).backward()
        opt.step()

    return step, model.num_params()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for width in args.widths:
        common = dict(layers=args.layers, batch=args.batch, seq=args.seq, device=args.device, dtype=dtype)
        loop, n_params = step_fn(width, foreach=False, **common)
        batched, _ = step_fn(width, foreach=True, **common)
        cmp = compare(
            {"adamw_loop": loop, "adamw_foreach": batched},
            baseline="adamw_loop",
            warmup=args.warmup,
            repeats=args.repeats,
            device=args.device,
        )
        tokens = args.batch * args.seq
        for row in cmp.rows(d_model=width, params=n_params):
            row["tokens_per_s"] = tokens / (row["median_ms"] / 1e3)
            rows.append(row)
        print(cmp.table())
    paths = write_results(
        "train_step",
        rows,
        out_dir=args.out,
        meta={"device": args.device, "dtype": args.dtype, "layers": args.layers, "batch": args.batch, "seq": args.seq},
        curve={"x": "d_model", "y": "tokens_per_s", "group": "name", "logx": True, "title": "GPT train step"},
    )
    print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
