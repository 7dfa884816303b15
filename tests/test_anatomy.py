"""llmpar.models.anatomy: the blocks, shard units, pipeline sequence, family, attention, MLPs and embeddings of
llmpar's GPT, nn.Sequential models, nested lists (an MoE-like layer), a module held by two lists, a model that
answers through pipeline_blocks(), and a transformers Llama; and that the callers (activation checkpointing, ZeRO-3
units, the pipeline split, tensor-parallel plans) give the anatomy's answers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmpar.models import GPT, GPTConfig
from llmpar.models import anatomy as A

CFG = dict(vocab_size=64, n_layer=3, n_head=4, d_model=32, seq_len=16)


def names(named):
    return [n for n, _ in named]


class Moe(nn.Module):
    """Two layers, each with a ModuleList of experts; one expert shared by both layers; a param-less activation."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        shared = nn.Linear(6, 6)
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.router = nn.Linear(6, 3)
            layer.experts = nn.ModuleList([nn.Linear(6, 6), shared, nn.ReLU()])
            self.layers.append(layer)
        self.out = nn.Linear(6, 11)


class Piped(nn.Module):
    """No container: its own modules among pipeline_blocks() are the blocks."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def pipeline_blocks(self):
        return [("a", self.a), ("extra", nn.Linear(3, 3)), ("b", self.b)]


def test_gpt():
    gpt = GPT(GPTConfig(**CFG))
    layers = [f"blocks.{i}" for i in range(3)]
    assert names(A.blocks(gpt)) == layers
    assert names(A.shard_units(gpt)) == ["", "tok_emb", "pos_emb", *layers, "ln_f", "lm_head"]
    assert names(A.pipeline_sequence(gpt)) == ["embed", *layers, "head"]
    assert A.family(gpt) == "gpt"
    attn = A.attention_modules(gpt)
    assert names(attn) == [f"{n}.attn" for n in layers] and A.head_counts(attn[0][1]) == {"n_head": 4}
    assert names(A.mlp_modules(gpt)) == [f"{n}.mlp" for n in layers]
    assert names(A.input_embeddings(gpt)) == ["tok_emb", "pos_emb"]
    assert A.output_head(gpt)[0] == "lm_head"


def test_sequential_root():
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    assert names(A.blocks(seq)) == ["0", "2"]  # the root's children with params; no block inside a block
    assert names(A.pipeline_sequence(seq)) == ["0", "1", "2"]  # the activation is part of the computation
    # units: the root, every nested container's elements, the root's own non-container children with params
    assert names(A.shard_units(seq)) == ["", "0", "2.0", "2.1"]
    assert A.family(seq) is None and A.attention_modules(seq) == [] and A.output_head(seq) is None


def test_nested_lists_and_a_shared_module():
    """Blocks are the outermost elements (the experts belong to their layer); units go down to every element; the
    expert held by both layers is one unit (and would be one block), under its first name."""
    model = Moe()
    assert names(A.blocks(model)) == ["layers.0", "layers.1"]
    assert names(A.shard_units(model)) == [
        "",
        "emb",
        "layers.0",
        "layers.0.experts.0",
        "layers.0.experts.1",
        "layers.1",
        "layers.1.experts.0",
        "out",
    ]
    lists = nn.Module()
    shared = nn.Linear(2, 2)
    lists.first = nn.ModuleList([shared, nn.Linear(2, 2)])
    lists.second = nn.ModuleList([shared])
    assert names(A.blocks(lists)) == ["first.0", "first.1"]
    assert names(A.input_embeddings(model)) == ["emb"] and A.output_head(model) is None


def test_pipeline_blocks_answer():
    assert names(A.blocks(Piped())) == ["a", "b"]  # the extra module is not the model's own
    assert names(A.pipeline_sequence(Piped())) == ["a", "extra", "b"]
    assert A.blocks(nn.Linear(3, 3)) == []


def test_pipeline_sequence_refuses_what_it_cannot_split():
    with pytest.raises(TypeError, match="pass an nn.Sequential or a module with a pipeline_blocks"):
        A.pipeline_sequence(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match="no blocks to split"):
        A.pipeline_sequence(nn.Sequential())

    class Bad(nn.Module):
        def pipeline_blocks(self):
            return [nn.Linear(2, 2)]

    with pytest.raises(TypeError, match=r"\(name, nn.Module\) pairs"):
        A.pipeline_sequence(Bad())


def test_head_counts_and_attention_rule():
    m = nn.Module()
    m.num_heads, m.num_key_value_heads, m.n_head, m.head_dim = 8, 2, True, 4  # a bool is not a count
    assert A.head_counts(m) == {"num_heads": 8, "num_key_value_heads": 2} and A.is_attention(m)
    hf_like = nn.Module()
    hf_like.head_dim, hf_like.is_causal, hf_like.config = 4, True, object()
    assert A.head_counts(hf_like) == {} and A.is_attention(hf_like)
    no_dim = nn.Module()
    no_dim.num_heads = 8
    assert not A.is_attention(no_dim)


def test_the_callers_ask_the_anatomy():
    """Activation checkpointing, ZeRO-3 units, the pipeline split and the tp default plan give the anatomy's
    answers; a module held by two lists is checkpointed once (it was listed twice)."""
    from llmpar.pipeline.blocks import to_blocks
    from llmpar.runtime.activations import exposed_blocks
    from llmpar.tensor_parallel.parallelize import DEFAULT_PLANS, _pick_default_plan
    from llmpar.zero.units import unit_modules

    lists = nn.Module()
    shared = nn.Linear(2, 2)
    lists.first = nn.ModuleList([shared, nn.Linear(2, 2)])
    lists.second = nn.ModuleList([shared, nn.Linear(2, 2)])
    assert names(exposed_blocks(lists)) == ["first.0", "first.1", "second.1"]
    for model in (GPT(GPTConfig(**CFG)), Moe(), nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)), lists):
        assert exposed_blocks(model) == A.blocks(model)
        assert unit_modules(model) == A.shard_units(model)
    gpt = GPT(GPTConfig(**CFG))
    assert names(to_blocks(gpt)) == names(A.pipeline_sequence(gpt)) and _pick_default_plan(gpt) is DEFAULT_PLANS["gpt"]
    with pytest.raises(ValueError, match="no default tensor-parallel plan fits Moe"):
        _pick_default_plan(Moe())
    from llmpar.pipeline.stages import _default_plan  # the pipeline's tp plan: the same family rule

    assert _default_plan(gpt) == DEFAULT_PLANS["gpt"]
    with pytest.raises(ValueError, match="no default tensor-parallel plan fits Moe"):
        _default_plan(Moe())


def test_transformers_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    layers = ["model.layers.0", "model.layers.1"]
    assert names(A.blocks(model)) == layers
    # the base model is a unit (its embeddings and final norm), its layers units inside it
    assert names(A.shard_units(model)) == ["", "model", *layers, "lm_head"]
    assert A.family(model) == "llama"
    assert names(A.attention_modules(model)) == [f"{n}.self_attn" for n in layers]
    assert names(A.mlp_modules(model)) == [f"{n}.mlp" for n in layers]
    assert names(A.input_embeddings(model)) == ["model.embed_tokens"]
    assert A.output_head(model)[0] == "lm_head"
