"""``llmpar.parallelize`` on whole models == the unsplit model: llmpar's GPT and a HuggingFace Llama built from a
config (random init, no download); logits, every gradient, and a short training run's losses step by step."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmpar.tensor_parallel import ColumnParallelLinear, ParallelLMHead, parallelize, vocab_parallel_cross_entropy

from multirank import run_ranks

WORLD = (1, 2, 4)
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _close(got, want, what, dtype):
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _assert_grads_match(par: nn.Module, ref: nn.Module, dtype) -> int:
    tp, rank = dist.get_world_size(), dist.get_rank()
    n = 0
    for name, p in par.named_parameters():
        want = ref.get_parameter(name).grad
        assert p.grad is not None, f"{name} has no gradient"
        if getattr(p, "tensor_model_parallel", False):
            dim = p.partition_dim
            if want.shape[dim] % tp:  # padded vocabulary
                pad = [0, 0] * (want.dim() - 1 - dim) + [0, p.shape[dim] * tp - want.shape[dim]]
                want = torch.nn.functional.pad(want, pad)
            want = want.narrow(dim, rank * p.shape[dim], p.shape[dim])
        _close(p.grad, want, f"grad of {name}", dtype)
        n += 1
    return n


def _gpt(dtype, tie=False):
    from llmpar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=1001, n_layer=2, n_head=4, d_model=32, seq_len=8, tie_embeddings=tie)
    return GPT(cfg, seed=0, dtype=dtype)


def _gpt_body(sp: bool, chunks: int, overlap: bool, dtype_name: str, tie: bool = False):
    dtype = getattr(torch, dtype_name)
    ref = _gpt(torch.float64, tie)
    torch.manual_seed(11)
    idx = torch.randint(0, 1001, (4, 5))  # batch 4 (divides tp = 1, 2, 4 under sequence parallelism), 5 tokens
    tgt = torch.randint(0, 1001, (4, 5))
    logits_ref = ref(idx)
    ref.loss(logits_ref, tgt).backward()
    par = parallelize(
        copy.deepcopy(ref).to(dtype),
        dist.group.WORLD,
        sequence_parallel=sp,
        comm_chunks=chunks,
        overlap_grad_comm=overlap,
    )
    par.zero_grad(set_to_none=True)
    assert isinstance(par.blocks[0].attn.qkv, ColumnParallelLinear) and isinstance(par.lm_head, ParallelLMHead)
    assert (par.lm_head.weight is par.tok_emb.weight) == tie  # a tied embedding stays one (split) parameter
    logits = par(idx)
    par.loss(logits, tgt).backward()
    _close(logits, logits_ref, "logits", dtype)
    assert _assert_grads_match(par, ref, dtype) == len(list(ref.parameters()))


@pytest.mark.parametrize("world_size", WORLD)
@pytest.mark.parametrize("sp,chunks,overlap", [(False, 1, False), (False, 2, True), (True, 2, True)])
def test_gpt_parallelize_matches_single_device(world_size, sp, chunks, overlap):
    for dtype in ("float64", "float32"):
        run_ranks(_gpt_body, world_size, sp, chunks, overlap, dtype)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("sp", [False, True])
def test_gpt_tied_embeddings_stay_tied_and_match_single_device(world_size, sp):
    run_ranks(_gpt_body, world_size, sp, 1, True, "float64", True)


def _gpt_train_body(sp: bool, vocab_loss: bool):
    """Five AdamW steps; returns the losses (compared with tp=1 by the test)."""
    model = _gpt(torch.float32)
    model = parallelize(model, dist.group.WORLD, sequence_parallel=sp, gather_logits=not vocab_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 1001, (4, 6), generator=gen)  # one batch, learned over the steps
    tgt = torch.roll(idx, -1, dims=1)
    losses = []
    for _ in range(5):
        logits = model(idx)
        if vocab_loss:  # never gather the vocabulary: loss from the logit shards (their padding columns are -inf,
            loss = vocab_parallel_cross_entropy(logits, tgt, dist.group.WORLD)  # so no vocab_size is needed)
        else:
            loss = model.loss(logits, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("sp,vocab_loss", [(False, False), (True, True), (False, True)])
def test_gpt_training_losses_match_tp1_step_by_step(world_size, sp, vocab_loss):
    want = run_ranks(_gpt_train_body, 1, False, False)[0]
    got = run_ranks(_gpt_train_body, world_size, sp, vocab_loss)
    for rank_losses in got:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert want[-1] < want[0]


# ---------------------------------------------------------------- HuggingFace Llama
def _llama(dtype, kv_heads=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1001,
        hidden_size=32,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
        pad_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def _llama_body(sp: bool, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    ref = _llama(torch.float64)
    torch.manual_seed(12)
    ids = torch.randint(0, 1001, (4, 5))
    ids[0, 0] = 0  # the padding id
    labels = torch.randint(0, 1001, (4, 5))
    out_ref = ref(input_ids=ids, labels=labels)
    out_ref.loss.backward()
    par = parallelize(copy.deepcopy(ref).to(dtype), dist.group.WORLD, sequence_parallel=sp)
    par.zero_grad(set_to_none=True)
    out = par(input_ids=ids, labels=labels)
    out.loss.backward()
    _close(out.logits, out_ref.logits, "logits", dtype)
    _close(out.loss, out_ref.loss, "loss", dtype)
    assert _assert_grads_match(par, ref, dtype) == len(list(ref.parameters()))


@pytest.mark.parametrize("world_size", WORLD)
@pytest.mark.parametrize("sp", [False, True])
def test_hf_llama_parallelize_matches_unsplit_model(world_size, sp):
    for dtype in ("float64", "float32"):
        run_ranks(_llama_body, world_size, sp, dtype)


# ---------------------------------------------------------------- plans that do not fit
def _plan_errors_body():
    from llmpar.models.gpt import GPT, GPTConfig

    g = dist.group.WORLD
    tp = dist.get_world_size()
    with pytest.raises(ValueError, match="match no module"):
        parallelize(_gpt(torch.float32), g, {"attn.qkv": "column", "nope.fc": "row"})
    with pytest.raises(TypeError, match="module 'blocks.0.ln1' is a LayerNorm"):
        parallelize(_gpt(torch.float32), g, {"ln1": "column"})
    with pytest.raises(ValueError, match="is not one of"):
        parallelize(_gpt(torch.float32), g, {"attn.qkv": "colum"})
    with pytest.raises(ValueError, match="no default tensor-parallel plan fits Sequential"):
        parallelize(nn.Sequential(nn.Linear(4, 4)), g)
    if tp == 4:
        small = GPT(GPTConfig(vocab_size=11, n_layer=1, n_head=2, d_model=8, seq_len=4))
        with pytest.raises(ValueError, match="module 'blocks.0.attn': n_head=2 is not divisible by tp=4"):
            parallelize(small, g)
        with pytest.raises(ValueError, match="module 'model.layers.0.self_attn.k_proj'.*whole number of heads"):
            parallelize(_llama(torch.float32, kv_heads=2), g)
        assert isinstance(small.blocks[0].attn.qkv, nn.Linear), "a failed parallelize must leave the model as it was"


@pytest.mark.parametrize("world_size", (1, 4))
def test_plan_errors_name_the_module(world_size):
    run_ranks(_plan_errors_body, world_size)


def _clip_body():
    from llmpar.tensor_parallel import clip_grad_norm_

    ref = _gpt(torch.float64)
    idx = torch.randint(0, 1001, (2, 5), generator=torch.Generator().manual_seed(4))
    ref.loss(ref(idx), idx).backward()
    par = parallelize(copy.deepcopy(ref), dist.group.WORLD)
    par.loss(par(idx), idx).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    got = clip_grad_norm_(par.parameters(), 0.05, dist.group.WORLD)
    _close(got, want, "grad norm", torch.float64)
    _assert_grads_match(par, ref, torch.float64)  # and the clipped gradients


@pytest.mark.parametrize("world_size", (1, 2))
def test_clip_grad_norm_counts_split_params_across_ranks(world_size):
    run_ranks(_clip_body, world_size)
