"""transformers' MoE causal LMs (tiny configs built here: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss) with
their sparse blocks swapped for llmpar's MoE block (``llmpar.moe.hf.swap_moe_blocks``): the same logits, loss (with
the router aux loss) and gradients as the model before the swap (fp32, 1e-6), on one process and over 2
expert-parallel ranks; the same Parameter objects (no copy); transformers' names in the state dict (a swapped model's
state dict loads into an unswapped one); ``save_pretrained`` -> ``from_pretrained`` round trips, and checkpoints in
the older per-expert layout (``experts.{i}.w1/w2/w3``, ``experts.{i}.gate_proj/up_proj/down_proj``) loaded by
transformers and then swapped; a configuration the swap cannot reproduce is refused naming it."""

from __future__ import annotations

import copy

import pytest
import torch

from llmpar.moe.hf import SPECS, HFMoEBlock, swap_moe_blocks

transformers = pytest.importorskip("transformers")

VOCAB, H, LAYERS = 61, 16, 2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=H,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _config(name: str):
    if name == "mixtral":
        return transformers.MixtralConfig(
            **COMMON, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2, head_dim=8
        )
    if name == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **COMMON,
            intermediate_size=20,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=10,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        )
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON,
            intermediate_size=20,
            moe_intermediate_size=12,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=8,
        )
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **COMMON,
            intermediate_size=20,
            moe_intermediate_size=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            norm_topk_prob=True,
        )
    if name == "gpt_oss":
        return _gpt_oss_config()
    raise KeyError(name)


MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
ALL_MODELS = [*MODELS, "gpt_oss"]


def _model(name: str):
    torch.manual_seed(0)
    cfg = _config(name)
    cfg._attn_implementation = "eager"
    if hasattr(cfg, "output_router_logits"):  # the load-balancing loss from the recorded router logits, in the loss
        cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.3
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # every MoE tensor random and not small (the routers start at zero in some models)
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if ".gate." in n or ".router." in n or "e_score_correction_bias" in n or "shared_expert_gate" in n:
                t.normal_(0.0, 0.5)
            elif "experts" in n:
                t.normal_(0.0, 0.2)
    return model.eval()


def _grads(model) -> dict[str, torch.Tensor]:
    """Gradients by transformers' parameter names (a swapped block's names mapped back)."""
    names = {}
    for prefix, m in model.named_modules():
        if isinstance(m, HFMoEBlock):
            names |= {f"{prefix}.{ours}": f"{prefix}.{theirs}" for ours, theirs in m.hf_names.items()}
    return {names.get(n, n): p.grad for n, p in model.named_parameters()}


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    if model.config.to_dict().get("output_router_logits"):
        blocks = sum(isinstance(m, HFMoEBlock) or type(m).__name__ in SPECS for m in model.modules())
        assert len(out.router_logits) == blocks
        if model.config.model_type != "deepseek_v3":  # DeepSeek-V3 records them but adds no loss of them
            assert float(out.aux_loss.detach()) > 0.5
    return torch.cat([out.logits.detach().flatten(), out.loss.detach().view(1)]), _grads(model)


def _close(a, b, what, scale: float = 0.0):
    """To 1e-6 of the reference's largest entry (or of ``scale``: the largest gradient of the whole model, for a
    gradient that is zero up to rounding, such as a key projection's bias)."""
    atol = 1e-6 * max(float(b.abs().max()), scale)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=atol, msg=lambda m: f"{what}: {m}")


def _scale(grads: dict[str, torch.Tensor]) -> float:
    return max(float(g.abs().max()) for g in grads.values() if g is not None)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_swapped_model_equals_transformers(name):
    ref = _model(name)
    model = copy.deepcopy(ref)
    blocks = [m for m in model.modules() if type(m).__name__ in SPECS]
    experts = [b.experts.gate_up_proj for b in blocks]
    if name == "mixtral":  # a forward before the swap: the model's output hooks are then installed already
        model(input_ids=torch.zeros(1, 3, dtype=torch.long))
    swapped = swap_moe_blocks(model)
    assert swapped == len(blocks) == (1 if name == "deepseek_v3" else LAYERS)
    ours = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert [b.experts.gate_up_proj for b in ours] == experts  # the same Parameter objects: nothing copied
    assert all(getattr(p, "expert_parallel", False) for p in experts)
    assert model.state_dict().keys() == ref.state_dict().keys()  # transformers' names
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    (la, ga), (lb, gb) = _run(ref, ids), _run(model, ids)
    _close(lb, la, "logits and loss")
    assert gb.keys() == ga.keys()
    for n in ga:
        _close(gb[n], ga[n], f"gradient of {n}", _scale(ga))
    assert swap_moe_blocks(model) == 0  # nothing left to swap
    with torch.no_grad():  # the swapped model saves under transformers' names: it loads into an unswapped one
        for p in model.parameters():
            p.mul_(1.5)
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _close(ref(input_ids=ids).logits, model(input_ids=ids).logits, "logits after a state-dict round trip")


def _per_expert(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The state dict in the older per-expert layout (Mixtral: ``block_sparse_moe.experts.{i}.w1/w2/w3``; the
    others: ``mlp.experts.{i}.gate_proj/up_proj/down_proj``)."""
    out = {}
    for key, t in state.items():
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            base = key.rsplit(".", 1)[0]
            if name == "mixtral":
                base = base.replace(".mlp.", ".block_sparse_moe.")
            for i in range(t.shape[0]):
                if key.endswith("gate_up_proj"):
                    gate, up = t[i].chunk(2, dim=0)
                    names = ("w1", "w3") if name == "mixtral" else ("gate_proj", "up_proj")
                    out[f"{base}.{i}.{names[0]}.weight"], out[f"{base}.{i}.{names[1]}.weight"] = gate, up
                else:
                    out[f"{base}.{i}.{'w2' if name == 'mixtral' else 'down_proj'}.weight"] = t[i]
        elif name == "mixtral" and ".mlp.gate." in key:
            out[key.replace(".mlp.", ".block_sparse_moe.")] = t
        else:
            out[key] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


@pytest.mark.parametrize("name", ALL_MODELS)
def test_from_pretrained_per_expert_and_packed_then_swap_round_trips(name, tmp_path):
    from safetensors.torch import save_file

    ref = _model(name)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    old = tmp_path / "per_expert"
    if name == "gpt_oss":  # gpt-oss has no per-expert layout: transformers' own save
        ref.save_pretrained(old)
    else:
        ref.config.save_pretrained(old)
        state = _per_expert(ref.state_dict(), name)
        assert not any(k.endswith("gate_up_proj") for k in state)
        save_file(state, str(old / "model.safetensors"), metadata={"format": "pt"})
    for source in (old, None):
        if source is None:  # packed: what the swapped model saves, loaded by plain transformers
            swapped = transformers.AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).eval()
            assert swap_moe_blocks(swapped) > 0
            swapped.save_pretrained(tmp_path / "packed")
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "packed", dtype=torch.float32)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        model.eval()
        assert swap_moe_blocks(model) > 0
        with torch.no_grad():
            _close(model(input_ids=ids).logits, want, f"logits after loading {source or 'the packed save'}")


def test_load_state_dict_takes_transformers_names():
    ref, model = _model("qwen2_moe"), _model("qwen2_moe")
    swap_moe_blocks(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _close(model(input_ids=ids).logits, ref(input_ids=ids).logits, "logits")


def _gpt_oss_config():
    return transformers.GptOssConfig(
        **{**COMMON, "num_key_value_heads": 1},
        intermediate_size=12,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        layer_types=["full_attention"] * LAYERS,
    )


def test_bad_configurations_are_named():
    cfg = _config("mixtral")
    cfg.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        swap_moe_blocks(transformers.AutoModelForCausalLM.from_config(cfg))
    cfg = _config("qwen3_moe")
    cfg.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        swap_moe_blocks(transformers.AutoModelForCausalLM.from_config(cfg))


def _ep_body(names: list[str]) -> list[str]:
    """On each of 2 ranks: the model swapped over an expert-parallel group of both ranks, each rank its own tokens,
    against the unswapped model on the same tokens: logits and non-expert gradients equal, the experts' gradients
    equal this rank's slice of the unswapped gradients summed over the ranks."""
    import torch.distributed as dist

    rank, group = dist.get_rank(), dist.new_group([0, 1])
    done = []
    for name in names:
        ref = _model(name)
        model, later = copy.deepcopy(ref), copy.deepcopy(ref)
        assert swap_moe_blocks(model, ep_group=group) > 0
        assert swap_moe_blocks(later) > 0  # swapped at ep=1, then spread as llmpar.initialize does
        for block in later.modules():
            if isinstance(block, HFMoEBlock):
                block.set_ep_group(group)
        ids = torch.randint(0, VOCAB, (1, 5 + 4 * rank), generator=torch.Generator().manual_seed(10 + rank))
        (la, ga), (lb, gb) = _run(ref, ids), _run(model, ids)
        _, g_later = _run(later, ids)
        assert all(torch.equal(g_later[n], gb[n]) for n in gb), f"{name}: set_ep_group differs from a swap at ep=2"
        _close(lb, la, f"{name} logits")
        for n, g in ga.items():
            if ".experts." in n:
                dist.all_reduce(g, group=group)
                e = g.shape[0] // 2
                g = g[rank * e : (rank + 1) * e]
                assert model.state_dict()[n].shape[0] == e  # this rank's slice
            _close(gb[n], g, f"{name} gradient of {n}", _scale(ga))
        done.append(name)
    return done


@pytest.mark.slow(
    reason="the one 2-rank launch of the swapped transformers models (Qwen2-MoE, DeepSeek-V3 forward + backward "
    "against "
    "the unswapped models, and gpt-oss): ~12 s on an idle 2-core machine, most of it building the models"
)
def test_swapped_model_over_two_expert_parallel_ranks_equals_transformers():
    from multirank import run_ranks

    names = ["qwen2_moe", "deepseek_v3", "gpt_oss"]
    assert run_ranks(_ep_body, 2, names, timeout=180) == [names, names]


def test_initialize_swaps_the_blocks_when_expert_parallel_is_enabled():
    """``llmpar.initialize`` with ``"expert_parallel": {"enabled": true}`` (DeepSpeed's AutoEP) runs a transformers
    MoE model on llmpar's blocks: swapped before the optimizer steps (a client optimizer built before initialize still
    steps the same Parameters), training as the unswapped model does under plain AdamW (1e-6); without the block the
    model is left as it is."""
    import llmpar

    ref = _model("qwen3_moe").train()
    data = [torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for ids in data:
        ref_opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 1}}
    untouched = copy.deepcopy(ref)
    llmpar.initialize(model=untouched, optimizer=torch.optim.AdamW(untouched.parameters(), lr=1e-2), config=config)
    assert not any(isinstance(m, HFMoEBlock) for m in untouched.modules())
    model = _model("qwen3_moe").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = llmpar.initialize(
        model=model, optimizer=opt, config={**config, "expert_parallel": {"enabled": True, "autoep_size": 1}}
    )
    assert sum(isinstance(m, HFMoEBlock) for m in model.modules()) == LAYERS
    got = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got_sd, want_sd = model.state_dict(), ref.state_dict()  # transformers' names on both
    assert got_sd.keys() == want_sd.keys()
    for name, t in want_sd.items():
        torch.testing.assert_close(got_sd[name], t, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
