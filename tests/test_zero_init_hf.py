"""``llmpar.zero.Init`` builds a model whose weights equal the plain build's: ``torch.manual_seed(s)`` + a build in the
block + ``llmpar.initialize`` at ZeRO-3 gives, param by param and buffer by buffer (``torch.equal``), what
``torch.manual_seed(s)`` + a plain build gives -- for HF Llama / Qwen2 / GPT-2 (tied and untied) and plain torch
modules -- without any rank holding the whole model; what a replay cannot reproduce is refused where it runs."""

import pytest
import torch
from torch import nn

import llmpar
import llmpar.zero
from llmpar.models import GPT, GPTConfig
from llmpar.zero.init import _DEFERRED, replace_meta_params

from multirank import run_ranks

transformers = pytest.importorskip("transformers")


def _hf(name, tied):
    small = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=3,
    )
    if name == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**small)
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**small)
    return transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=97,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )


class _Odd(nn.Module):
    """Init patterns beyond reset_parameters: a param from an out-of-place product, a padding row, inits that skip
    meta tensors (trunc_normal_, orthogonal_), a write through a strided view, a value read back into Python."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(24, 16) * 0.02)
        self.emb = nn.Embedding(11, 16, padding_idx=2)
        self.proj = nn.Linear(16, 16)
        nn.init.trunc_normal_(self.proj.weight, std=0.1)
        self.rot = nn.Linear(16, 8)
        nn.init.orthogonal_(self.rot.weight)
        with torch.no_grad():
            self.rot.weight.view(-1)[::3].add_(1.0)
        self.offset = nn.Parameter(torch.full((8,), float(self.scale.detach().abs().mean())))
        self.register_buffer("mask", torch.tril(torch.ones(6, 6, dtype=torch.bool)))


def _plain(name):
    if name == "gpt":
        return lambda: GPT(GPTConfig(vocab_size=50, d_model=16, n_head=2, n_layer=2, seq_len=8), seed=3)
    if name == "sequential":
        return lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return _Odd


def _maker(case):
    if isinstance(case, tuple):
        cls, cfg = _hf(*case)
        return lambda: cls(cfg)
    return _plain(case)


def _n_tied(model):
    return len(list(model.named_parameters(remove_duplicate=False))) - len(list(model.parameters()))


def _config(**extra):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def _gathered(model):
    with llmpar.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return params, {n: b.clone() for n, b in model.named_buffers()}


def built_sharded_body(cases, seed, extra):
    """Per case: names of params / buffers differing from the plain build, and the sizes bounding the build."""
    out = {}
    for case in cases:
        make = _maker(case)
        torch.manual_seed(seed)
        ref = make()
        ref_rng = torch.random.get_rng_state()
        if extra.get("bf16"):
            ref.to(torch.bfloat16)
        torch.manual_seed(seed)
        with llmpar.zero.Init(config_dict_or_path=_config(**extra)):
            model = make()
        same_rng = torch.equal(torch.random.get_rng_state(), ref_rng)
        assert all(p.is_meta for p in model.parameters())
        engine, opt, _, _ = llmpar.initialize(model=model, config=_config(**extra))
        params, buffers = _gathered(model)
        want = dict(ref.named_parameters(remove_duplicate=False))
        bad = [n for n in want if n not in params or not torch.equal(params[n], want[n].detach())]
        bad += [n for n, b in ref.named_buffers() if not torch.equal(buffers[n], b)]
        biggest_unit = max(sum(p.ds_numel for p in ps) for ps in opt.plan.needs)  # ds_numel: released params
        biggest_param = max(p.ds_numel for p in model.parameters())  # are empty tensors
        out[str(case)] = dict(
            bad=bad,
            rng=same_rng,
            peak=opt.init_peak_numel,
            unit=biggest_unit,
            param=biggest_param,
            total=sum(p.ds_numel for p in model.parameters()),
            tied=_n_tied(model),
            ref_tied=_n_tied(ref),
            std=float(params[next(iter(params))].float().std()),
        )
    return out


def _check(results):
    for per_rank in results:
        for case, r in per_rank.items():
            assert r["bad"] == [], (case, r["bad"])  # every param and buffer torch.equal to the plain build's
            assert r["rng"], case  # the generator ends the block where a plain build leaves it
            assert r["tied"] == r["ref_tied"], case  # tied lm_head / embedding come out tied
            assert r["std"] > 0, case
            assert r["peak"] <= r["unit"], (case, r)  # one unit's params whole at a time, never the model
            assert r["peak"] < r["total"], (case, r)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_models_built_sharded_equal_the_plain_build(tied):
    _check(run_ranks(built_sharded_body, 2, [("llama", tied), ("qwen2", tied), ("gpt2", tied)], 5, {}, timeout=180))


def test_hf_model_built_sharded_in_bf16_equals_the_plain_build_cast():
    _check(run_ranks(built_sharded_body, 2, [("llama", False)], 11, {"bf16": {"enabled": True}}, timeout=120))


def test_plain_torch_models_built_sharded_equal_the_plain_build():
    _check(run_ranks(built_sharded_body, 2, ["gpt", "sequential", "odd"], 7, {}, timeout=180))


def training_body(seed):
    cls, cfg = _hf("llama", True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 2, 12), generator=g)
    losses = []
    for sharded in (False, True):
        torch.manual_seed(seed)
        with llmpar.zero.Init(enabled=sharded):
            model = cls(cfg)
        engine, *_ = llmpar.initialize(model=model, config=_config())
        run = []
        for x in ids:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            run.append(loss.item())
        losses.append(run)
    return losses


def test_training_after_a_sharded_build_matches_the_plain_build():
    for plain, sharded in run_ranks(training_body, 2, 9, timeout=120):
        assert all(torch.isfinite(torch.tensor(sharded)))
        torch.testing.assert_close(torch.tensor(sharded), torch.tensor(plain), rtol=1e-6, atol=1e-6)


def different_seeds_body():
    torch.manual_seed(torch.distributed.get_rank())
    with llmpar.zero.Init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    try:
        llmpar.initialize(model=model, config=_config())
        refused = None
    except ValueError as e:
        refused = str(e)
    with llmpar.zero.Init():  # draws from the global generator that its own seeded init overwrites: accepted
        gpt = _plain("gpt")()
    engine, *_ = llmpar.initialize(model=gpt, config=_config())  # held: the params' owner while gathered
    params, _ = _gathered(gpt)
    return refused, all(torch.equal(params[n], p) for n, p in _plain("gpt")().named_parameters())


def test_ranks_built_from_different_random_states_are_refused():
    for refused, gpt_equal in run_ranks(different_seeds_body, 2, timeout=60):
        assert refused is not None and "different random states" in refused and "torch.manual_seed" in refused
        assert gpt_equal  # only the states a replay uses must agree


# ------------------------------------------------------------------------------------------------ one process
class _ForEach(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        with torch.no_grad():
            torch._foreach_mul_([self.lin.weight, self.lin.bias], 0.5)


def test_an_init_the_recording_cannot_replay_is_refused_naming_the_module():
    with pytest.raises(llmpar.zero.DeferredInitError, match=r"_foreach_mul_.*several tensors.*_ForEach\.__init__"):
        with llmpar.zero.Init():
            _ForEach()


def test_meta_params_not_built_under_init_are_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(
        ValueError,
        match=r"param 0\.weight \(3, 3\) is on the meta device but was not built inside "
        r"llmpar\.zero\.Init",
    ):
        replace_meta_params(model, torch.device("cpu"))


def test_disabled_init_builds_normally():
    cls, cfg = _hf("llama", False)
    torch.manual_seed(1)
    ref = cls(cfg)
    torch.manual_seed(1)
    with llmpar.zero.Init(enabled=False):
        model = cls(cfg)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert not p.is_meta and torch.equal(p, q), n


def test_inside_the_block_tensors_look_real_and_nested_blocks_record_once():
    torch.manual_seed(2)
    ref = nn.Linear(4, 4)
    torch.manual_seed(2)
    with llmpar.zero.Init():
        with llmpar.zero.Init():
            lin = nn.Linear(4, 4)
        assert not lin.weight.is_meta and lin.weight.device == torch.device("cpu")  # as a plain build sees it
        assert lin.weight.tolist() == ref.weight.tolist()  # read back: replayed
    assert lin.weight.is_meta and lin.bias.is_meta  # no memory held
    assert torch.equal(getattr(lin.weight, _DEFERRED).value(), ref.weight)
    assert torch.equal(getattr(lin.bias, _DEFERRED).value(), ref.bias)
