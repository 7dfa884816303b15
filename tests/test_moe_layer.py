"""The MoE pieces on one process: router math against float64 references written here, the grouped expert MLP and
the local dispatcher against plain loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmpar.moe import (
    LocalDispatcher,
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
