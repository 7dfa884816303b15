"""The small GPT: shapes, causality, deterministic init, loss, config errors, and a qkv/proj layout that a
tensor-parallel split (whole heads per rank) can cut."""

import math

import pytest
import torch
from torch import nn

from llmpar.models import GPT, GPTConfig, lm_loss


def _cfg(**kw):
    base = dict(vocab_size=61, n_layer=2, n_head=4, d_model=32, seq_len=17)
    base.update(kw)
    return GPTConfig(**base)


def test_forward_shape_and_names():
    model = GPT(_cfg(), seed=0)
    idx = torch.randint(0, 61, (3, 11))
    assert model(idx).shape == (3, 11, 61)
    names = dict(model.named_modules())
    for n in (
        "tok_emb",
        "pos_emb",
        "blocks.1.attn.qkv",
        "blocks.1.attn.proj",
        "blocks.0.mlp.fc",
        "blocks.0.mlp.proj",
        "ln_f",
        "lm_head",
    ):
        assert n in names, n
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    assert model.blocks[0].attn.n_head == 4
    assert model.config.d_ff == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_masking(dtype):
    model = GPT(_cfg(), seed=1, dtype=dtype).eval()
    idx = torch.randint(0, 61, (2, 17))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 7) % 61  # change tokens 9.. only
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_deterministic_init_by_seed():
    sa = GPT(_cfg(), seed=3).state_dict()
    sb = GPT(_cfg(), seed=3).state_dict()
    sc = GPT(_cfg(), seed=4).state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])
    # the same draw whatever the dtype: an fp64 model starts at the fp32 model's values
    s64 = GPT(_cfg(), seed=3, dtype=torch.float64).state_dict()
    for k in sa:
        assert s64[k].dtype == torch.float64 and torch.equal(s64[k].float(), sa[k]), k


def test_init_statistics():
    model = GPT(_cfg(d_model=64, n_layer=4), seed=0)
    assert abs(model.blocks[0].mlp.fc.weight.std().item() - 0.02) < 2e-3
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - 0.02 / math.sqrt(8)) < 1e-3
    assert torch.equal(model.blocks[0].ln1.weight, torch.ones(64))
    assert torch.count_nonzero(model.blocks[0].attn.qkv.bias) == 0


def test_loss_on_random_data_is_near_uniform_and_has_grads():
    torch.manual_seed(0)
    model = GPT(_cfg(), seed=0)
    idx, tgt = torch.randint(0, 61, (4, 17)), torch.randint(0, 61, (4, 17))
    loss = model.loss(model(idx), tgt)
    assert abs(loss.item() - math.log(61)) < 0.1  # small init: close to uniform
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    ref = torch.nn.functional.cross_entropy(model(idx).reshape(-1, 61), tgt.reshape(-1))
    torch.testing.assert_close(lm_loss(model(idx), tgt), ref)


def test_tied_embeddings_share_one_tensor():
    model = GPT(_cfg(tie_embeddings=True), seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.num_params() == GPT(_cfg(), seed=0).num_params() - 61 * 32


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(d_model=30, n_head=4), "not divisible by n_head=4"),
        (dict(n_layer=0), "n_layer"),
        (dict(dropout=1.5), "dropout"),
    ],
)
def test_config_errors_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_errors_on_bad_input():
    model = GPT(_cfg(), seed=0)
    with pytest.raises(ValueError, match="longer than seq_len=17"):
        model(torch.zeros(1, 18, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        model(torch.zeros(18, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 4))


def _split_linear(lin: nn.Linear, parts: int, dim: int, rank: int, keep_bias: bool) -> nn.Linear:
    w = lin.weight.detach().chunk(parts, dim=dim)[rank]
    out = nn.Linear(w.shape[1], w.shape[0], bias=keep_bias).to(w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if keep_bias:
            b = lin.bias.detach()
            out.bias.copy_(b.chunk(parts)[rank] if dim == 0 else b)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_splits_into_whole_heads(tp):
    """Column-split qkv (rows) + row-split proj (columns), summed over the 'ranks', equals the full attention:
    the qkv layout puts whole heads (their q, k and v) in each contiguous chunk of rows."""
    model = GPT(_cfg(), seed=5, dtype=torch.float64)
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    full = attn(x)
    total = torch.zeros_like(full)
    for r in range(tp):
        part = GPT(_cfg(), seed=5, dtype=torch.float64).blocks[0].attn
        part.qkv = _split_linear(attn.qkv, tp, 0, r, keep_bias=True)
        part.proj = _split_linear(attn.proj, tp, 1, r, keep_bias=False)
        total += part(x)
    total += attn.proj.bias
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)


def test_generate_extends_and_is_seeded():
    model = GPT(_cfg(), seed=0)
    prompt = torch.randint(0, 61, (1, 3))
    a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 23) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)


def test_pipeline_blocks_share_the_model_and_compute_it():
    model = GPT(_cfg(tie_embeddings=True), seed=0, dtype=torch.float64)
    blocks = model.pipeline_blocks()
    assert [n for n, _ in blocks] == ["embed", "blocks.0", "blocks.1", "head"]
    embed, head = blocks[0][1], blocks[-1][1]
    assert embed.tok_emb is model.tok_emb and head.lm_head is model.lm_head and blocks[1][1] is model.blocks[0]
    assert embed.tok_emb.weight is head.lm_head.weight  # tied: one tensor, seen by a pipeline split as shared
    assert [n for n, _ in embed.named_parameters()] == ["tok_emb.weight", "pos_emb.weight"]
    idx = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    y = idx
    for _, b in blocks:
        y = b(y)
    torch.testing.assert_close(y, model(idx), rtol=0, atol=0)
    with pytest.raises(ValueError, match="longer than seq_len=17"):
        embed(torch.zeros(1, 18, dtype=torch.int64))
