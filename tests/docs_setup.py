"""What the code blocks of the docs take as given (``<!-- docs-test: setup=NAME -->``, tests/docs_blocks.py).

A page shows the lines a user writes; the model, the batch or the directory those lines use come from here, small
and random (never zeros), so each block runs for real on the test ranks. Each setup returns the block's namespace.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import llmpar
from llmpar.models.gpt import GPT, GPTConfig

VOCAB, SEQ = 97, 16


def _gpt(**kw: Any) -> GPT:
    cfg = dict(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, seq_len=SEQ)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg), seed=0)


def _tokens(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _base() -> dict[str, Any]:
    return {"llmpar": llmpar, "torch": torch, "nn": nn}


class _LossGPT(nn.Module):
    """A model whose forward takes a batch (x, y) and returns the loss, as many training scripts write it."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt()

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return GPT.loss(self.gpt(x), y)


def flat() -> dict[str, Any]:
    """concepts.md: buffers for a flat reduce-scatter over the dp group (dp = world / tp = 1 on 2 ranks)."""
    return {**_base(), "flat": torch.randn(12), "out": torch.empty(12)}


def tp() -> dict[str, Any]:
    """tensor-parallel.md: a tp=2 mesh, a plain linear to split, a GPT to parallelize, a vocab-split logits shard."""
    env = llmpar.init_distributed(tp=2)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 2 * 48, generator=g)
    r = env.mesh["tp"].get_local_rank()
    return {
        **_base(),
        "env": env,
        "existing_linear": nn.Linear(1024, 4096),
        "model": _gpt(),
        "logits_shard": logits[:, r * 48 : (r + 1) * 48].contiguous(),
        "target": torch.randint(0, 96, (5,), generator=g),
    }


def model() -> dict[str, Any]:
    """A small GPT (optimizers.md, zero.md)."""
    return {**_base(), "model": _gpt()}


def loss_model() -> dict[str, Any]:
    """zero.md: a model returning its loss, and this rank's batch of 8 rows."""
    return {**_base(), "model": _LossGPT(), "batch": _tokens(8)}


def ds_script() -> dict[str, Any]:
    """migrating-deepspeed.md: what a DeepSpeed example script has before its deepspeed lines."""
    with open("ds.json", "w") as f:
        json.dump(
            {
                "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 2},
            },
            f,
        )
    net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(3)
    trainset = torch.utils.data.TensorDataset(torch.randn(32, 12, generator=g), torch.randint(0, 5, (32,), generator=g))
    args = llmpar.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", "ds.json"])
    return {
        **_base(),
        "parser": argparse.ArgumentParser(),
        "args": args,
        "net": net,
        "params": [p for p in net.parameters() if p.requires_grad],
        "trainset": trainset,
        "criterion": nn.CrossEntropyLoss(),
        "ckpt_dir": "ckpt",
    }


def pipe() -> dict[str, Any]:
    """pipeline.md: a GPT to cut into stages, its loss, the whole batch (16 rows: 8 micro-batches of 2)."""
    x, y = _tokens(16)
    dist.broadcast(x, 0), dist.broadcast(y, 0)  # every rank holds the same batch (one dp group of 4)
    return {**_base(), "model": _gpt(n_layer=4), "loss_fn": GPT.loss, "x": x, "y": y}


def engine() -> dict[str, Any]:
    """checkpoints.md: an engine that took one step."""
    eng, *_ = llmpar.initialize(
        model=_gpt(), config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    )
    x, y = _tokens(2)
    eng.backward(GPT.loss(eng(x), y))
    eng.step()
    return {**_base(), "engine": eng, "pos": 2}


def _tiny_llama(path: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    return model


def hf_weights() -> dict[str, Any]:
    """checkpoint-conversion.md: an engine over a Llama and a save_pretrained directory of its weights."""
    model = _tiny_llama("llama_dir")
    eng, *_ = llmpar.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    )
    return {**_base(), "engine": eng}


def long_context() -> dict[str, Any]:
    """context-parallel.md: a saved Llama (`path`), long.json on 2 ranks (cp=2), and this dp rank's batches."""
    _tiny_llama("llama")
    with open("long.json", "w") as f:
        json.dump(
            {
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 2e-5}},
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3},
                "context_parallel": {"size": 2, "mode": "ring"},
            },
            f,
        )
    g = torch.Generator().manual_seed(5)  # the same batches on both ranks: one dp group of 2 cp ranks
    ids = torch.randint(0, VOCAB, (3, 1, 24), generator=g)
    loader = [{"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)} for x in ids]
    return {**_base(), "path": "llama", "loader": loader}


def ops() -> dict[str, Any]:
    """kernels.md: gradients to pack, a linear's operands, attention inputs (GQA: 4 query heads, 2 kv heads)."""
    g = torch.Generator().manual_seed(11)
    shapes = [(5, 7), (123,), (3, 3, 3)]
    params = [torch.randn(s, generator=g) for s in shapes]
    B, Hq, Hkv, S, D = 2, 4, 2, 9, 16
    q = torch.randn(B, Hq, S, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    half = 5
    pos = torch.arange(S)
    from llmpar.ops import attention_fwd

    o1, lse1 = attention_fwd(q, k[:, :, :half], v[:, :, :half], q_pos=pos, k_pos=pos[:half])
    o2, lse2 = attention_fwd(q, k[:, :, half:], v[:, :, half:], q_pos=pos, k_pos=pos[half:])
    from llmpar.ops import merge_partials

    out, lse = merge_partials(o1, lse1, o2, lse2)
    return {
        **_base(),
        "grads": [torch.randn(s, generator=g) for s in shapes],
        "world": 2,
        "params": params,
        "x": torch.randn(600, 24, generator=g),
        "w": torch.randn(40, 24, generator=g),
        "b": torch.randn(40, generator=g),
        "q": q,
        "k": k,
        "v": v,
        "mask": torch.rand(B, S, generator=g) > 0.2,
        "k_blk": k[:, :, :half],
        "v_blk": v[:, :, :half],
        "qp": pos,
        "kp": pos[:half],
        "o1": o1,
        "lse1": lse1,
        "o2": o2,
        "lse2": lse2,
        "out": out,
        "lse": lse,
        "dout": torch.randn(B, Hq, S, D, generator=g),
    }


SETUPS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (flat, tp, model, loss_model, ds_script, pipe, engine, hf_weights, long_context, ops)
}
os.environ.setdefault("HF_HUB_OFFLINE", "1")
