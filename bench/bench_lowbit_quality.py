"""Training quality and state memory of AdamW with 8- and 4-bit states (``llmpar.ops.lowbit``) next to fp32 AdamW and
torchao's AdamW8bit / AdamW4bit, on the same runs (issue #33's goals: final loss within 1 % (8-bit) / 2 % (4-bit) of
fp32 AdamW; optimizer-state bytes <= 0.3x / <= 0.2x of fp32 AdamW, measured from the state tensors).

    python bench/bench_lowbit_quality.py --backend auto     # demo GPT + tiny HF Llama, 300 steps each (CPU)
    python bench/bench_lowbit_quality.py --steps 50 --models gpt

Data: token sequences from a fixed random bigram chain (a learnable distribution whose entropy bounds the loss), the
same batches for every optimizer; the final loss is the mean over 4 held-out batches after the last step. Every run
starts from the same weights. torchao keeps tensors under 4096 elements in fp32 (its ``min_quant_size``): its
state bytes count that too. Ours quantize every tensor (blocks of 256 / 128 along each param).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llmpar.models import GPT, GPTConfig  # noqa: E402
from llmpar.optim import FusedAdamW  # noqa: E402

from harness import write_results  # noqa: E402

VOCAB, SEQ, BATCH = 96, 32, 16


def bigram_chain(seed: int = 0) -> torch.Tensor:
    """Row-stochastic [VOCAB, VOCAB]: each token has a few likely successors (a peaked, learnable distribution)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 2.5
    return torch.softmax(logits, dim=1)


def batch(chain: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    tok = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(SEQ):
        tok[:, t + 1] = torch.multinomial(chain[tok[:, t]], 1, generator=g).squeeze(1)
    return tok[:, :-1], tok[:, 1:]


def make_model(name: str) -> tuple[torch.nn.Module, callable]:
    """(model, loss(x, y)) with fixed initial weights."""
    if name == "gpt":
        model = GPT(
            GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=128, seq_len=SEQ), seed=0, dtype=torch.float32
        )
        return model, lambda x, y: model.loss(model(x), y)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(cfg)
    return model, lambda x, y: torch.nn.functional.cross_entropy(
        model(input_ids=x).logits.reshape(-1, VOCAB), y.reshape(-1)
    )


def make_optimizer(kind: str, params, lr: float, wd: float) -> torch.optim.Optimizer:
    if kind.startswith("torchao"):
        from torchao.optim import AdamW4bit, AdamW8bit

        return (AdamW8bit if kind.endswith("8bit") else AdamW4bit)(params, lr=lr, weight_decay=wd)
    return FusedAdamW(
        params,
        lr=lr,
        weight_decay=wd,
        state_precision={"fp32": "fp32", "llmpar-int8": "int8", "llmpar-int4": "int4"}[kind],
    )


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state, from the tensors (step counters left out): torchao's subclasses by their codes +
    scales (its shared qmap left out, as ours is)."""
    total = 0
    for st in opt.state.values():
        for key, t in st.items():
            if key == "step" or not isinstance(t, torch.Tensor):
                continue
            if hasattr(t, "codes") and hasattr(t, "scale"):
                total += t.codes.numel() * t.codes.element_size() + t.scale.numel() * t.scale.element_size()
            else:
                total += t.numel() * t.element_size()
    return total


def run(model_name: str, kind: str, steps: int, lr: float, wd: float, chain: torch.Tensor) -> dict:
    model, loss_fn = make_model(model_name)
    opt = make_optimizer(kind, model.parameters(), lr, wd)
    curve, t0 = [], time.perf_counter()
    for step in range(steps):
        x, y = batch(chain, step)
        loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(loss.item())
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        final = sum(loss_fn(*batch(chain, 1_000_000 + k)).item() for k in range(4)) / 4
    n = sum(p.numel() for p in model.parameters())
    return {
        "model": model_name,
        "optimizer": kind,
        "steps": steps,
        "final_loss": final,
        "curve": curve,
        "state_bytes": state_bytes(opt),
        "params": n,
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument(
        "--backend",
        default="auto",
        help="LLMPAR_BACKEND for llmpar's step (auto: the fused kernels "
        "where built, the CPU C++ one here; torch: the reference path, "
        "~15x slower on CPU)",
    )
    args = ap.parse_args()
    if args.backend != "auto":
        os.environ["LLMPAR_BACKEND"] = args.backend
    torch.set_num_threads(max(1, torch.get_num_threads()))
    kinds = ["fp32", "llmpar-int8", "llmpar-int4"]
    torchao_version = None
    if not args.no_torchao:
        try:
            import torchao

            torchao_version = torchao.__version__
            kinds += ["torchao-8bit", "torchao-4bit"]
        except ImportError as e:
            print(f'torchao not available ({e}): its runs are left out (pip install -e ".[baselines]")')
    chain = bigram_chain()
    entropy = float(-(chain * chain.log()).sum(1).mean())
    rows, curves = [], {}
    for model_name in args.models:
        base = None
        for kind in kinds:
            r = run(model_name, kind, args.steps, args.lr, args.weight_decay, chain)
            base = r if kind == "fp32" else base
            row = {k: v for k, v in r.items() if k != "curve"}
            row["loss_vs_fp32"] = r["final_loss"] / base["final_loss"]
            row["state_bytes_vs_fp32"] = r["state_bytes"] / base["state_bytes"]
            rows.append(row)
            curves[f"{model_name}/{kind}"] = r["curve"]
            print(
                f"{model_name:6s} {kind:13s} final {r['final_loss']:.4f} ({row['loss_vs_fp32']:.4f}x fp32)  "
                f"state {r['state_bytes'] / 1e6:.3f} MB ({row['state_bytes_vs_fp32']:.3f}x)  {r['seconds']:.0f} s",
                flush=True,
            )
    meta = {
        "steps": args.steps,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "vocab": VOCAB,
        "seq": SEQ,
        "batch": BATCH,
        "bigram_entropy": entropy,
        "torchao": torchao_version,
        "backend": args.backend,
        "goals": "loss_vs_fp32 <= 1.01 (8-bit), <= 1.02 (4-bit); state_bytes_vs_fp32 <= 0.3 / 0.2",
    }
    write_results("lowbit_quality", rows, meta)
    here = os.path.dirname(os.path.abspath(__file__))
    _plot(curves, entropy, os.path.join(here, "results", "lowbit_quality_curves.png"))


def _plot(curves: dict[str, list[float]], entropy: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({k.split("/")[0] for k in curves})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for key, ys in curves.items():
            if key.startswith(m + "/"):
                k = 10  # moving average over 10 steps
                sm = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
                ax.plot(sm, label=key.split("/")[1], linewidth=1)
        ax.axhline(entropy, color="gray", linestyle=":", label="bigram entropy")
        ax.set_title(f"{m}: training loss (10-step mean)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_ylim(entropy - 0.1, None)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
