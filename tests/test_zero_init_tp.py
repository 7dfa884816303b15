"""A model built inside ``llmpar.zero.Init`` and split by ``llmpar.initialize``'s ``"tensor_parallel"`` block at
ZeRO-3: each rank materialises only its tp slices (then its ZeRO partition), and the values equal those of the plain
build of the same seed split the same way (``torch.equal``), for an untied HF Llama and llmpar's GPT (tied head)."""

import pytest
import torch

import llmpar
import llmpar.zero
from llmpar.models import GPT, GPTConfig
from llmpar.tensor_parallel.parallelize import parallelize

from multirank import run_ranks

transformers = pytest.importorskip("transformers")


def _config():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "tensor_parallel": {"size": 2},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def _makers():
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=3,
    )
    return {
        "llama": lambda: transformers.LlamaForCausalLM(cfg),
        "gpt": lambda: GPT(GPTConfig(vocab_size=51, d_model=16, n_head=2, n_layer=2, seq_len=8), seed=3),
    }


def tp_body(seed):
    """Per model: params differing from the plain build split by tp, and the sizes bounding the build."""
    out = {}
    for name, make in _makers().items():
        torch.manual_seed(seed)
        with llmpar.zero.Init():
            model = make()
        engine, opt, _, _ = llmpar.initialize(model=model, config=_config())
        torch.manual_seed(seed)
        ref = parallelize(make(), engine.tp_group)  # the plain build, split the same way
        with llmpar.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            got = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        want = dict(ref.named_parameters(remove_duplicate=False))
        bad = [n for n in want if n not in got or got[n].shape != want[n].shape or not torch.equal(got[n], want[n])]
        out[name] = dict(
            bad=bad,
            missing=sorted(set(got) - set(want)),
            peak=opt.init_peak_numel,
            local=sum(p.ds_numel for p in model.parameters()),
            full=sum(p.numel() for p in make().parameters()),
            std=float(next(iter(got.values())).std()),
        )
    return out


def test_zero_init_model_split_by_tensor_parallel_equals_the_plain_build():
    for per_rank in run_ranks(tp_body, 2, 5, timeout=120):
        for name, r in per_rank.items():
            assert r["bad"] == [] and r["missing"] == [], (name, r)
            assert r["std"] > 0, name
            assert r["local"] < r["full"], (name, r)  # each rank's model is its tp slice
            assert r["peak"] < r["local"], (name, r)  # materialised one unit at a time, never the model
