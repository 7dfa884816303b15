"""The product's documentation snippet ("Implémentation avec DeepSpeed") runs exactly as written, with
``llmpar.initialize`` in place of ``deepspeed.initialize``: ZeRO-3 + offload_optimizer cpu + offload_param cpu + bf16,
then trains (loss falls) on 2 CPU/gloo ranks."""

import glob
import os
import re

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

SEED_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "seed")


def _snippet() -> str:
    for path in sorted(glob.glob(os.path.join(SEED_DIR, "*.txt"))):
        text = open(path, encoding="utf-8").read()
        m = re.search(r"Implémentation avec DeepSpeed\s*\n(.*?\n\))\s*\n", text, re.S)
        if m:
            return (
                m.group(1)
                .replace("import deepspeed", "import llmpar")
                .replace("deepspeed.initialize", "llmpar.initialize")
            )
    pytest.skip(f"no seed file with the DeepSpeed snippet under {SEED_DIR}")


def snippet_body(code):
    from llmpar.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=32, seq_len=16), seed=0)
    scope = {"model": model}
    exec(compile(code, "<seed snippet>", "exec"), scope)  # noqa: S102
    engine, optimizer = scope["model_engine"], scope["optimizer"]
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(12):
        start = torch.randint(0, 61, (4, 1), generator=g)
        seq = (start * 5 + 3 * torch.arange(17)) % 61  # learnable: x[t+1] = x[t] + 3 (mod 61) from a random start
        loss = model.loss(engine(seq[:, :-1]), seq[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    mem = optimizer.memory_bytes()
    return (
        losses,
        engine.zero_optimization_stage(),
        dict(optimizer.placement.where),
        mem,
        next(model.parameters()).dtype,
    )


def test_doc_snippet_runs_as_written():
    code = _snippet()
    assert '"stage": 3' in code and "offload_param" in code and "llmpar.initialize(" in code
    for losses, stage, where, mem, dtype in run_ranks(snippet_body, 2, code, timeout=120):
        assert stage == 3 and dtype == torch.bfloat16
        assert where == {"params": "host", "grads": "host", "master": "host", "optimizer_state": "host"}
        assert all(map(lambda v: v == v, losses)) and losses[-1] < 0.92 * losses[0], losses
        assert mem["host"] > 0
