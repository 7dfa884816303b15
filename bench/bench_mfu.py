"""The headline number: tokens/s and MFU of a ~1B Llama-shaped model trained on one GPU through ``llmpar.initialize``
(bf16 with fp32 masters, FusedAdamW, llmpar's flash attention), next to the same model in plain torch (bf16 autocast,
SDPA attention, torch's fused AdamW) in the same run, on the same batches.

    python bench/bench_mfu.py --device cuda --out bench/results     # 1.1B, seq 4096 (~2-4 min on an H100)
    python bench/bench_mfu.py --toy --out /tmp/mfu                   # CPU, a few seconds: the suite runs this

Model: TinyLlama-1.1B's shape (22 layers, d_model 2048, SwiGLU 5632, 32 query / 4 key-value heads, vocab 32000, untied
head), built locally from transformers' ``LlamaConfig`` (random weights, no download); without transformers, the same
shape from :class:`BuiltinLlama` below (said in the table). FLOPs per token and MFU by PaLM's convention
(``llmpar/runtime/mfu.py``: 6 N + 12 n_layer d_model seq, the device's bf16 dense peak). Each case: ``--warmup``
steps (Triton compiles, autotuning, allocator warm-up), then ``--steps`` timed steps (forward, backward, optimizer
step) ending in a device sync; tokens/s = micro-batch x seq x steps / time. Peak memory is torch's allocator peak.
A case that fails (out of memory, a kernel error) is a row with its error, so the other case still reports.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llmpar.runtime import mfu  # noqa: E402

from harness import _sync, write_results  # noqa: E402

SHAPES = {  # LlamaConfig fields
    "1b": dict(
        num_hidden_layers=22,
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "toy": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
}
ATTN = "llmpar_attention"  # not "*flash*": transformers reads such names as hub kernels


# ------------------------------------------------------------------------------------------------ the model
def _llmpar_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
):
    """transformers' attention-function signature over llmpar's flash attention: q [B, Hq, S, D], k / v [B, Hkv, S,
    D] (GQA as is) -> ([B, S, Hq, D], None). Causal, no padding mask (the bench's batches have none)."""
    from llmpar.ops.attention import flash_attention

    if isinstance(attention_mask, torch.Tensor) or dropout:
        raise ValueError("the bench's llmpar attention takes no attention_mask and no dropout")
    return flash_attention(query, key, value, scale=scaling, causal=True).transpose(1, 2), None


def _register_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN, _llmpar_attention)
    AttentionMaskInterface.register(ATTN, lambda *args, **kwargs: None)  # causal inside the kernel, no mask tensor


class _Block(nn.Module):
    def __init__(self, s: dict, rope: torch.Tensor) -> None:
        super().__init__()
        d, hq, hkv, f = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["intermediate_size"]
        self.hq, self.hkv, self.hd, self.rope = hq, hkv, d // hq, rope
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.q, self.k, self.v = (nn.Linear(d, h * (d // hq), bias=False) for h in (hq, hkv, hkv))
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up, self.down = (
            nn.Linear(d, f, bias=False),
            nn.Linear(d, f, bias=False),
            nn.Linear(f, d, bias=False),
        )

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = (t[: x.shape[2]].to(x.dtype) for t in self.rope.unbind(0))
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin

    def forward(self, x: torch.Tensor, attention: str) -> torch.Tensor:
        B, S, _ = x.shape
        h = self.norm1(x)
        q, k, v = (
            lin(h).view(B, S, n, self.hd).transpose(1, 2)
            for lin, n in ((self.q, self.hq), (self.k, self.hkv), (self.v, self.hkv))
        )
        q, k = self._rotate(q), self._rotate(k)
        if attention == ATTN:
            a = _llmpar_attention(self, q, k, v, None, scaling=self.hd**-0.5)[0]
        else:
            g = self.hq // self.hkv
            a = F.scaled_dot_product_attention(
                q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
            ).transpose(1, 2)
        x = x + self.o(a.reshape(B, S, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class BuiltinLlama(nn.Module):
    """The Llama architecture (RMSNorm, rotary positions, GQA, SwiGLU, untied head) for machines without
    transformers; ``model(input_ids=..., labels=...).loss`` like ``LlamaForCausalLM``; ``config`` carries the
    transformers field names llmpar's MFU count reads."""

    def __init__(self, shape: dict, attention: str, max_seq: int) -> None:
        super().__init__()
        d, hd = shape["hidden_size"], shape["hidden_size"] // shape["num_attention_heads"]
        self.config, self.attention = argparse.Namespace(**shape), attention
        inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(max_seq).float(), inv).repeat(1, 2)
        self.register_buffer("rope", torch.stack((ang.cos(), ang.sin())), persistent=False)
        self.embed = nn.Embedding(shape["vocab_size"], d)
        self.layers = nn.ModuleList(_Block(shape, self.rope) for _ in range(shape["num_hidden_layers"]))
        self.norm, self.lm_head = nn.RMSNorm(d, eps=1e-5), nn.Linear(d, shape["vocab_size"], bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> argparse.Namespace:
        x = self.embed(input_ids)
        for layer in self.layers:
            layer.rope = self.rope  # follows the module's device / dtype moves
            x = layer(x, self.attention)
        logits = self.lm_head(self.norm(x)).float()
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return argparse.Namespace(loss=loss)


def build_model(shape: dict, attention: str, *, impl: str, device: torch.device, seq: int, seed: int) -> nn.Module:
    """The model in float32 on ``device``, the same weights for every ``attention`` ("sdpa" or ATTN) given the seed."""
    torch.manual_seed(seed)
    with torch.device(device):
        if impl == "builtin":
            return BuiltinLlama(shape, attention, seq)
        from transformers import LlamaConfig, LlamaForCausalLM

        if attention == ATTN:
            _register_attention()
        cfg = LlamaConfig(
            **shape,
            max_position_embeddings=seq,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            attn_implementation=attention,
        )
        return LlamaForCausalLM(cfg)


# ------------------------------------------------------------------------------------------------ the cases
def _time_steps(step, batches: list[torch.Tensor], warmup: int, device: torch.device) -> tuple[float, list[float]]:
    """(seconds for the timed steps, every step's loss): ``warmup`` steps, then one per remaining batch."""
    losses = [step(b) for b in batches[:warmup]]
    _sync(device)
    t0 = time.perf_counter()
    losses += [step(b) for b in batches[warmup:]]
    _sync(device)
    return time.perf_counter() - t0, [float(x) for x in losses]


def run_torch(model: nn.Module, batches, warmup: int, device: torch.device, checkpoint: bool):
    """Plain torch: float32 weights, bf16 autocast, torch's fused AdamW."""
    if checkpoint:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _time_steps(step, batches, warmup, device)


def run_llmpar(
    model: nn.Module, batches, warmup: int, device: torch.device, checkpoint: bool, compile_backend: str | None = None
):
    """llmpar.initialize with a DeepSpeed config: bf16 (fp32 masters), AdamW (llmpar's FusedAdamW), ZeRO-1, dp = 1;
    with ``compile_backend``, ``engine.compile(backend=compile_backend)`` first (the warm-up steps compile)."""
    import llmpar

    if checkpoint:
        model.gradient_checkpointing_enable()
    config = {
        "train_micro_batch_size_per_gpu": batches[0].shape[0],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
    }
    engine = llmpar.initialize(model=model, config=config)[0]
    if compile_backend:
        engine.compile(backend=compile_backend)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return _time_steps(step, batches, warmup, device)


CASES = {
    "torch (SDPA, fused AdamW, autocast)": ("sdpa", run_torch),
    "llmpar (initialize, flash attention, FusedAdamW)": (ATTN, run_llmpar),
}
COMPILED = "llmpar + engine.compile()"  # the third case with --compile


def _write(args, rows, impl, shape, n_params, per_token, peak, peak_from, device) -> dict:
    """The table so far (speed-ups against the first case) into ``--out``: written after every case."""
    base = rows[0].get("tokens_per_s")
    for r in rows:
        if base and r.get("tokens_per_s"):
            r["speedup"] = round(r["tokens_per_s"] / base, 3)
    meta = {
        "model": f"Llama-shaped {n_params / 1e9:.3f}B params ({impl}): {shape}" if n_params else str(shape),
        "sequence": f"{args.seq} tokens x micro-batch {args.micro_batch}, {args.warmup} warm-up + "
        f"{args.steps} timed steps, activation checkpointing {'on' if args.checkpoint else 'off'}",
        "flops_per_token": f"{per_token:.4g} (PaLM: 6 N + 12 n_layer d_model seq)" if per_token else None,
        "peak": f"{peak} TFLOP/s ({peak_from})" if peak else f"unknown ({peak_from}): no MFU",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compile": f"{COMPILED}: backend {args.compile_backend}, warm-up steps compile" if args.compile else "off",
    }
    name = f"mfu_{'toy_' if args.toy else ''}{device.type}"
    return write_results(name, rows, meta, out_dir=args.out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SHAPES), default="1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing in both cases")
    p.add_argument("--impl", choices=("auto", "transformers", "builtin"), default="auto")
    p.add_argument("--compile", action="store_true", help=f"add the case {COMPILED!r} (the llmpar case compiled)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile")
    p.add_argument("--toy", action="store_true", help="CPU, toy shape, seq 64, 2 + 1 steps: the suite's check")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    if args.toy:
        args.device, args.size, args.seq, args.steps, args.warmup = "cpu", "toy", 64, 2, 1
    device = torch.device(args.device)
    impl = args.impl
    if impl == "auto":
        try:
            import transformers  # noqa: F401

            impl = "transformers"
        except ImportError:
            impl = "builtin"
    shape = SHAPES[args.size]
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, shape["vocab_size"], (args.micro_batch, args.seq), generator=gen).to(device)
        for _ in range(args.warmup + args.steps)
    ]
    tokens = args.micro_batch * args.seq * args.steps
    peak, peak_from = mfu.peak_tflops(device)
    rows, per_token, n_params = [], None, None
    cases = dict(CASES)
    if args.compile:
        cases[COMPILED] = (ATTN, functools.partial(run_llmpar, compile_backend=args.compile_backend))
    for name, (attention, run) in cases.items():
        row: dict[str, Any] = {"case": name}
        model = None
        try:
            model = build_model(shape, attention, impl=impl, device=device, seq=args.seq, seed=0)
            n_params = sum(p.numel() for p in model.parameters())
            per_token = mfu.flops_per_token(mfu.matmul_params(model), args.seq, mfu.attention_dims(model))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds, losses = run(model, batches, args.warmup, device, args.checkpoint)
            tps = tokens / seconds
            row.update(
                tokens_per_s=round(tps, 1),
                step_ms=round(1e3 * seconds / args.steps, 2),
                tflops_per_device=round(tps * per_token / 1e12, 3),
                mfu_pct=round(100 * tps * per_token / (peak * 1e12), 2) if peak else None,
                first_loss=round(losses[0], 4),
                last_loss=round(losses[-1], 4),
            )
            if device.type == "cuda":
                row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if not all(math.isfinite(x) for x in losses):
                row["error"] = f"non-finite loss: {losses}"
        except Exception as exc:  # noqa: BLE001 - one case failing (OOM, a kernel) must not lose the other's row
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(row)
        model = None  # freed before the next case builds its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        # written after each case: a run killed at its time limit keeps the cases it finished
        paths = _write(args, rows, impl, shape, n_params, per_token, peak, peak_from, device)
    print(open(paths["md"]).read())
    return {"rows": rows, "paths": paths}


if __name__ == "__main__":
    result = main()
    sys.exit(1 if any("error" in r for r in result["rows"]) else 0)
