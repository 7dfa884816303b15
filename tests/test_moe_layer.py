"""The MoE layer on one process: router math against float64 references written here, the layer against a plain
per-expert loop (bitwise in fp32, forward and gradients), transformers' MoE blocks loaded by slicing, and the bad
inputs it refuses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmpar.moe import (
    LocalDispatcher,
    MoEBlock,
    Router,
    RouterConfig,
    grouped_mlp,
    load_balancing_loss,
    sequence_aux_loss,
    z_loss,
)
from llmpar.moe.losses import aux_scores

T, H, E = 37, 19, 12

ROUTER_CASES = {
    "softmax": (RouterConfig(), 3),
    "softmax-norm": (RouterConfig(route_norm=True), 2),
    "sigmoid-groups-scaled": (
        RouterConfig(score_func="sigmoid", route_norm=True, routed_scaling_factor=2.5, n_group=4, topk_group=2),
        4,
    ),
    "sigmoid-bias-groups": (RouterConfig(score_func="sigmoid", expert_bias=True, n_group=3, topk_group=2), 3),
    "softmax-groups-max": (RouterConfig(n_group=4, topk_group=3, group_score="max"), 5),
    "force-balance": (RouterConfig(force_balance=True, route_norm=True), 5),
}


def reference_route(x: torch.Tensor, weight: torch.Tensor, cfg: RouterConfig, k: int, bias: torch.Tensor | None):
    """Routing in float64, one token at a time."""
    logits = x.double() @ weight.double().t()
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    n = logits.shape[1]
    idx, w = [], []
    for t in range(logits.shape[0]):
        s = scores[t]
        if cfg.force_balance:
            chosen = [(t * k + j) % n for j in range(k)]
        else:
            choice = s + (bias.double() if bias is not None else 0.0)
            allowed = set(range(n))
            if cfg.n_group > 1:
                size = n // cfg.n_group
                groups = []
                for g in range(cfg.n_group):
                    members = sorted(choice[g * size : (g + 1) * size].tolist(), reverse=True)
                    groups.append((members[0] if cfg.group_score == "max" else sum(members[:2]), g))
                best = [g for _, g in sorted(groups, reverse=True)[: cfg.topk_group]]
                allowed = {g * size + i for g in best for i in range(size)}
            chosen = sorted(allowed, key=lambda e: -choice[e].item())[:k]
        weights = s[chosen]
        if cfg.route_norm:
            weights = weights / weights.sum()
        idx.append(chosen)
        w.append(weights * cfg.routed_scaling_factor)
    return torch.tensor(idx), torch.stack(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_router_matches_a_float64_reference(case, dtype):
    cfg, k = ROUTER_CASES[case]
    torch.manual_seed(1)
    router = Router(H, E, k, cfg, init_std=0.5, dtype=dtype)
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(T, H).to(dtype)
    r = router(x)
    assert r.logits.dtype == r.weights.dtype == torch.float32 and r.indices.dtype == torch.int64
    idx, w = reference_route(x, router.weight, cfg, k, router.expert_bias)
    assert torch.equal(r.indices, idx), case
    torch.testing.assert_close(r.weights.double(), w, rtol=1e-6, atol=1e-6)
    assert torch.equal(r.counts, torch.bincount(idx.reshape(-1), minlength=E))
    assert int(r.nonfinite) == 0
    if cfg.force_balance:  # T k slots over E experts: as even as integers allow
        assert int(r.counts.max() - r.counts.min()) <= 1


def test_router_weights_carry_the_gradient_of_the_unbiased_scores():
    cfg = RouterConfig(score_func="sigmoid", expert_bias=True, route_norm=True)
    torch.manual_seed(2)
    router = Router(H, E, 3, cfg, init_std=0.5).double()
    router.expert_bias.copy_(torch.randn(E, dtype=torch.float64))
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    r = router(x)
    idx = r.indices

    def weights(x_):
        s = torch.sigmoid(x_ @ router.weight.t()).gather(1, idx)
        return s / (s.sum(-1, keepdim=True) + 1e-20)

    torch.testing.assert_close(r.weights, weights(x), rtol=0, atol=1e-15)
    g = torch.randn_like(r.weights)
    (gx,) = torch.autograd.grad((r.weights * g).sum(), x)
    (ref,) = torch.autograd.grad((weights(x) * g).sum(), x)
    torch.testing.assert_close(gx, ref, rtol=1e-12, atol=1e-12)
    assert "expert_bias" in router.state_dict() and not any("bias" in n for n, _ in router.named_parameters())


def _reference_losses(logits: torch.Tensor, k: int, score_func: str, seq_len: int):
    logits = logits.double()
    n_tok, n_exp = logits.shape
    p = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)

    def balance(rows):
        picked = [0.0] * n_exp
        for t in rows:
            for e in torch.topk(p[t], k).indices.tolist():
                picked[e] += 1
        total = 0.0
        for e in range(n_exp):
            f = picked[e] / (k * len(rows))
            total = total + f * sum(p[t, e] for t in rows) / len(rows)
        return n_exp * total

    aux = balance(list(range(n_tok)))
    seqs = [balance(list(range(b * seq_len, (b + 1) * seq_len))) for b in range(n_tok // seq_len)]
    z = sum(torch.log(torch.exp(logits[t]).sum()) ** 2 for t in range(n_tok)) / n_tok
    return aux, sum(seqs) / len(seqs), z


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_losses_match_float64_references_and_transformers(score_func):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(3)
    k, seq_len = 3, 11
    logits = torch.randn(3 * seq_len, E, dtype=torch.float64) * 2
    aux, seq, z = _reference_losses(logits, k, score_func, seq_len)
    p = aux_scores(logits, score_func)
    torch.testing.assert_close(load_balancing_loss(p, k), aux, rtol=1e-12, atol=0)
    torch.testing.assert_close(sequence_aux_loss(p, k, seq_len), seq, rtol=1e-12, atol=0)
    torch.testing.assert_close(z_loss(logits), z, rtol=1e-12, atol=0)
    if score_func == "softmax":  # transformers leaves out the 1/k
        hf = load_balancing_loss_func((logits,), E, k)  # accumulated in fp32
        torch.testing.assert_close(hf.double(), k * load_balancing_loss(p, k), rtol=1e-6, atol=0)
    for fn in (lambda lg: load_balancing_loss(aux_scores(lg, score_func), k), z_loss):
        assert torch.autograd.gradcheck(fn, (logits[:7].clone().requires_grad_(),))
    # the router sums the weighted losses; a batch [B, S, H] is cut into sequences of S tokens
    cfg = RouterConfig(score_func=score_func, aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2, z_loss_coeff=0.3)
    router = Router(H, E, k, cfg).double()
    r = router(torch.randn(3 * seq_len, H, dtype=torch.float64), seq_len=seq_len)
    aux, seq, z = _reference_losses(r.logits, k, score_func, seq_len)
    torch.testing.assert_close(r.aux_loss, 0.1 * aux + 0.2 * seq + 0.3 * z, rtol=1e-12, atol=0)


def test_expert_bias_moves_against_the_load_and_only_in_training():
    torch.manual_seed(4)
    cfg = RouterConfig(score_func="sigmoid", expert_bias=True, bias_update_rate=0.01)
    router = Router(H, E, 2, cfg, init_std=0.5)
    loads = torch.zeros(E)
    for _ in range(3):
        loads += router(torch.randn(T, H)).counts.float()
    router.eval()
    router(torch.randn(T, H))  # not counted
    assert torch.equal(router.expert_load, loads)
    bias_before = router.expert_bias.clone()
    used = router.update_expert_bias()
    assert torch.equal(used, loads) and not router.expert_load.any()
    expected = bias_before + 0.01 * torch.sign(loads.mean() - loads)
    assert torch.equal(router.expert_bias, expected) and router.expert_bias.abs().sum() > 0
    with pytest.raises(ValueError, match="expert_bias=True"):
        Router(H, E, 2).update_expert_bias()


def reference_moe(layer: MoEBlock, x: torch.Tensor, capacity_factor: float | None = None) -> torch.Tensor:
    """The layer written plainly: route, then one expert at a time over the tokens that picked it (capacity: each
    expert keeps its highest-weight slots, ties to the earlier token), weigh in fp32, add the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    routing = layer.router(flat, seq_len=x.shape[-2] if x.dim() == 3 else None)
    idx, w = routing.indices, routing.weights
    n_tok, k = idx.shape
    ys = flat.new_zeros(n_tok, k, flat.shape[-1])
    x_slots = flat.unsqueeze(1).expand(-1, k, -1)  # slot (t, j) reads token t
    for e in range(layer.num_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if capacity_factor is not None:
            cap = math.ceil(capacity_factor * n_tok * k / layer.num_experts)
            ranked = sorted(range(len(tok)), key=lambda i: (-w[tok[i], slot[i]].item(), tok[i].item()))
            kept = sorted(ranked[:cap])
            tok, slot = tok[kept], slot[kept]
        gate, up = F.linear(x_slots[tok, slot], layer.experts.gate_up_proj[e]).chunk(2, dim=-1)
        ys = ys.index_put((tok, slot), F.linear(F.silu(gate) * up, layer.experts.down_proj[e]))
    acc = ys[:, 0].float() * w[:, 0:1]
    for j in range(1, k):
        acc = acc + ys[:, j].float() * w[:, j : j + 1]
    out = acc.to(x.dtype)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(flat)
    return out.view(x.shape)


LAYER_CASES = {
    "softmax-k2": dict(num_experts=6, top_k=2),
    "deepseek-v3": dict(
        num_experts=8,
        top_k=3,
        router=RouterConfig(score_func="sigmoid", route_norm=True, routed_scaling_factor=2.5, n_group=4, topk_group=2),
        shared_intermediate_size=10,
    ),
    "qwen2-shared-gate": dict(
        num_experts=6, top_k=4, router=RouterConfig(), shared_intermediate_size=7, shared_gate=True
    ),
    "capacity": dict(num_experts=6, top_k=2, capacity_factor=0.6),
    "one-expert-takes-all": dict(
        num_experts=6, top_k=1, router=RouterConfig(score_func="sigmoid", expert_bias=True), shared_intermediate_size=5
    ),
}


def _grads(module, x):
    return [x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_equals_the_per_expert_loop_bitwise(case):
    kw = LAYER_CASES[case]
    torch.manual_seed(5)
    layer = MoEBlock(H, 12, **kw)
    if case == "one-expert-takes-all":
        layer.router.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 5.0, 0]))  # every token picks expert 4
    x = torch.randn(3, 13, H, requires_grad=True)
    g = torch.randn(3, 13, H)
    out = layer(x)
    (out * g).sum().backward()
    got = [out.detach()] + [t.clone() for t in _grads(layer, x)]
    layer.zero_grad()
    x.grad = None
    ref = reference_moe(layer, x, kw.get("capacity_factor"))
    (ref * g).sum().backward()
    want = [ref.detach()] + _grads(layer, x)
    names = ["out", "x.grad"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got, want):
        assert a is not None and b is not None, name
        assert torch.equal(a, b), f"{case}: {name} differs by {(a - b).abs().max()}"
    stats, counts = layer.stats, layer.tokens_per_expert
    assert sum(stats.received) + stats.dropped == 39 * layer.top_k == int(counts.sum())
    if case == "capacity":
        assert stats.dropped > 0 and max(stats.received) <= math.ceil(0.6 * 39 * 2 / 6)
    if case == "one-expert-takes-all":
        assert stats.received == [0, 0, 0, 0, 39, 0]
        assert layer.experts.gate_up_proj.grad[[0, 1, 2, 3, 5]].abs().sum() == 0
    else:
        assert stats.dropped == 0 or case == "capacity"


def test_grouped_mlp_empty_experts_zero_tokens_and_one_expert():
    torch.manual_seed(6)
    gate_up = torch.randn(4, 2 * 5, 7, requires_grad=True)
    down = torch.randn(4, 7, 5, requires_grad=True)
    for counts in ([0, 0, 0, 0], [0, 9, 0, 0], [3, 0, 4, 1], [0, 0, 0, 6]):
        x = torch.randn(sum(counts), 7, requires_grad=True)
        y = grouped_mlp(x, torch.tensor(counts), gate_up, down)
        y.sum().backward() if y.numel() else (y.sum() + 0 * gate_up.sum() + 0 * down.sum()).backward()
        assert y.shape == (sum(counts), 7)
        pieces, start = [], 0
        for e, c in enumerate(counts):
            xe = x[start : start + c]
            a = F.silu(xe @ gate_up[e, :5].t()) * (xe @ gate_up[e, 5:].t())
            pieces.append(a @ down[e].t())
            start += c
        torch.testing.assert_close(y, torch.cat(pieces), rtol=1e-6, atol=1e-6)
        assert gate_up.grad is not None and down.grad is not None
        for e, c in enumerate(counts):
            if c == 0:
                assert gate_up.grad[e].abs().sum() == 0
        gate_up.grad = down.grad = None
    with pytest.raises(ValueError, match="counts must hold 4"):
        grouped_mlp(torch.randn(3, 7), [3, 0], gate_up, down)
    with pytest.raises(ValueError, match="sum\\(counts\\)=4"):
        grouped_mlp(torch.randn(3, 7), [1, 1, 1, 1], gate_up, down)


def test_local_dispatch_sorts_stably_drops_by_weight_and_combines_in_fp32():
    torch.manual_seed(9)
    n_tok, k, n_exp = 23, 3, 5
    router = Router(H, n_exp, k, RouterConfig(route_norm=True), init_std=0.5)
    x = torch.randn(n_tok, H)
    routing = router(x)
    x_sorted, counts, meta = LocalDispatcher(n_exp).dispatch(x, routing)
    slots = [(e, t) for t in range(n_tok) for e in routing.indices[t].tolist()]
    want = [t for _, t in sorted(slots, key=lambda s: s[0])]  # Python's sort is stable: token order per expert
    assert torch.equal(x_sorted, x[want]) and counts == torch.bincount(routing.indices.reshape(-1)).tolist()
    out = LocalDispatcher(n_exp).combine(x_sorted * 2, meta)  # experts doubling their input
    w = routing.weights
    torch.testing.assert_close(out, 2 * x * w.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    # capacity 0.5: ceil(0.5 * 23 * 3 / 5) = 7 slots per expert, the highest weights kept (ties: earlier slot)
    x_kept, kept, meta = LocalDispatcher(n_exp, capacity_factor=0.5).dispatch(x, routing)
    assert max(kept) <= 7 and meta.stats.dropped == n_tok * k - sum(kept) > 0
    for e in range(n_exp):
        mine = [(t, j) for t in range(n_tok) for j in range(k) if routing.indices[t, j] == e]
        best = sorted(mine, key=lambda s: (-w[s].item(), s))[:7]
        rows = torch.tensor([t for t, _ in sorted(best)], dtype=torch.long)
        assert torch.equal(x_kept[sum(kept[:e]) : sum(kept[: e + 1])], x[rows])
    out = LocalDispatcher(n_exp, capacity_factor=0.5).combine(x_kept, meta)
    keep = torch.zeros(n_tok, k)
    for e in range(n_exp):
        mine = [(t, j) for t in range(n_tok) for j in range(k) if routing.indices[t, j] == e]
        for s in sorted(mine, key=lambda s: (-w[s].item(), s))[:7]:
            keep[s] = 1
    torch.testing.assert_close(out, x * (w * keep).sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)


def _hf_block(name: str):
    """A tiny transformers MoE block and the MoE layer that holds the same weights (a slice / a copy)."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qw

    torch.manual_seed(7)
    if name.startswith("qwen3"):
        cfg = qw.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=12, num_experts=8, num_experts_per_tok=3)
        cfg.norm_topk_prob = name.endswith("norm")
        hf = qw.Qwen3MoeSparseMoeBlock(cfg)
        ours = MoEBlock(H, 12, 8, 3, router=RouterConfig(route_norm=cfg.norm_topk_prob))
        pairs = [("gate.weight", "router.weight")]
    else:
        cfg = ds.DeepseekV3Config(
            hidden_size=H,
            moe_intermediate_size=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            n_shared_experts=2,
            norm_topk_prob=True,
        )
        hf = ds.DeepseekV3MoE(cfg)
        rc = RouterConfig(score_func="sigmoid", route_norm=True, routed_scaling_factor=2.5, n_group=4, topk_group=2)
        ours = MoEBlock(
            H, 12, 8, 3, router=RouterConfig(**{**rc.__dict__, "expert_bias": True}), shared_intermediate_size=24
        )
        pairs = [("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "router.expert_bias")]
        pairs += [
            (f"shared_experts.{p}.weight", f"shared_experts.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")
        ]
    pairs += [("experts.gate_up_proj", "experts.gate_up_proj"), ("experts.down_proj", "experts.down_proj")]
    theirs, mine = (
        dict(hf.named_parameters()) | dict(hf.named_buffers()),
        dict(ours.named_parameters()) | dict(ours.named_buffers()),
    )
    with torch.no_grad():
        for a, b in pairs:
            theirs[a].normal_(0, 0.3) if a.endswith("bias") or a == "gate.weight" else theirs[a].normal_(0, 0.1)
            mine[b].copy_(theirs[a])
    return hf, ours


@pytest.mark.parametrize("name", ["qwen3", "qwen3-norm", "deepseek-v3"])
def test_transformers_moe_blocks_load_by_copy_and_match(name):
    hf, ours = _hf_block(name)
    x = torch.randn(2, 9, H)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-6, atol=1e-6)


def test_bf16_layer_is_close_to_its_float64_twin():
    torch.manual_seed(8)
    layer = MoEBlock(
        H, 12, 6, 2, router=RouterConfig(route_norm=True), shared_intermediate_size=8, dtype=torch.bfloat16
    )
    twin = MoEBlock(H, 12, 6, 2, router=RouterConfig(route_norm=True), shared_intermediate_size=8, dtype=torch.float64)
    twin.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    x = (torch.randn(4, 11, H) * 2).bfloat16()
    out, ref = layer(x), twin(x.double())
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, err


BAD_ARGS = [
    (dict(num_experts=4, top_k=5), ValueError, "top_k=5 is larger than num_experts=4"),
    (dict(num_experts=0, top_k=1), ValueError, "num_experts=0 must be >= 1"),
    (dict(num_experts=4, top_k=2.0), TypeError, "top_k must be an int"),
    (dict(num_experts=6, top_k=2, router=RouterConfig(n_group=4)), ValueError, "n_group=4 does not divide"),
    (dict(num_experts=8, top_k=2, router=RouterConfig(n_group=4, topk_group=5)), ValueError, "topk_group=5"),
    (dict(num_experts=8, top_k=5, router=RouterConfig(n_group=4, topk_group=2)), ValueError, "top_k=5 is larger than"),
    (dict(num_experts=8, top_k=2, router=RouterConfig(score_func="relu")), ValueError, "score_func='relu'"),
    (dict(num_experts=8, top_k=2, router=RouterConfig(z_loss_coeff=math.nan)), ValueError, "z_loss_coeff=nan"),
    (dict(num_experts=8, top_k=2, capacity_factor=0.0), ValueError, "capacity_factor=0.0"),
    (dict(num_experts=8, top_k=2, capacity_factor="1"), TypeError, "capacity_factor must be a number"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_ARGS, ids=[m for _, _, m in BAD_ARGS])
def test_bad_arguments_are_refused_naming_them(kw, exc, match):
    with pytest.raises(exc, match=match.replace("(", "\\(").replace("[", "\\[")):
        MoEBlock(H, 12, **kw)


def test_bad_inputs_are_refused_naming_them():
    layer = MoEBlock(H, 12, 6, 2)
    with pytest.raises(ValueError, match=f"must be \\[..., hidden_size={H}\\]"):
        layer(torch.randn(5, H + 1))
    with pytest.raises(ValueError, match="floating point"):
        layer(torch.ones(5, H, dtype=torch.int64))
    x = torch.randn(5, H)
    x[3, 0] = math.nan
    with pytest.raises(ValueError, match="non-finite logits \\(NaN or inf\\) for 1 of 5 tokens"):
        layer(x)
    with torch.no_grad():
        layer.router.weight[2, 1] = math.inf
    with pytest.raises(ValueError, match="for 5 of 5 tokens"):
        layer(torch.randn(5, H))
