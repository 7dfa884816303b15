"""The MoE layer over an expert-parallel group of 2 and 4 CPU ranks (gloo) equals the layer on one process: outputs,
input / router / shared-expert gradients of each rank's own tokens, and the experts' gradients gathered over the
group (to 1e-6); a rank whose experts get no tokens, a rank with no tokens at all, one expert taking every token and
capacity dropping; and the bad inputs, refused on every rank before the exchange could hang. One launch per ep size,
every check inside it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from llmpar.moe import MoEBlock, RouterConfig

from multirank import multirank

H, INTER = 12, 8


def _cases(ep: int) -> dict[str, dict]:
    last = list(range(8 - 8 // ep, 8))  # the last rank's experts (of 8)
    sig = dict(score_func="sigmoid", expert_bias=True, route_norm=True)
    return {
        "softmax-shared-gate-aux": dict(
            kw=dict(top_k=2, router=RouterConfig(route_norm=True, aux_loss_coeff=0.1, z_loss_coeff=0.01)),
            shared=dict(shared_intermediate_size=6, shared_gate=True),
        ),
        "deepseek-v3-groups": dict(
            kw=dict(top_k=3, router=RouterConfig(n_group=4, topk_group=2, routed_scaling_factor=2.5, **sig)),
            shared=dict(shared_intermediate_size=6),
            bias={e: 0.05 * e for e in range(8)},
        ),
        "no-tokens-to-the-last-rank-and-none-on-rank-1": dict(
            kw=dict(top_k=2, router=RouterConfig(**sig)), bias={e: -10.0 for e in last}, empty_rank=1
        ),
        "one-expert-takes-all": dict(kw=dict(top_k=1, router=RouterConfig(**sig)), bias={0: 10.0}),
        "capacity": dict(kw=dict(top_k=2, capacity_factor=0.7)),
    }


def _tokens(rank: int, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    n = 0 if case.get("empty_rank") == rank else 3 + 4 * rank  # uneven token counts per rank
    return torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)


def _build(case: dict, ep_group) -> MoEBlock:
    torch.manual_seed(0)
    layer = MoEBlock(H, INTER, 8, ep_group=ep_group, **case["kw"], **case.get("shared", {}))
    if case.get("bias"):
        for e, b in case["bias"].items():
            layer.router.expert_bias[e] = b
    return layer


def _run(layer: MoEBlock, x: torch.Tensor, g: torch.Tensor):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = layer(x)
    ((out * g).sum() + layer.aux_loss).backward()
    grads = {n: (p.grad if p.grad is not None else None) for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads, layer.stats


def _parity(name: str, case: dict) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    layer = _build(case, dist.group.WORLD)
    ref = _build(case, None)
    out, xg, grads, stats = _run(layer, *_tokens(rank, case))
    expert_sum = {n: torch.zeros_like(p) for n, p in ref.experts.named_parameters()}
    dropped_ref = None
    for src in range(world):  # every rank's tokens through the one-process layer; the experts' gradients add up
        r_out, r_xg, r_grads, r_stats = _run(ref, *_tokens(src, case))
        for n in expert_sum:
            expert_sum[n] += r_grads[f"experts.{n}"]
        if src == rank:
            mine, dropped_ref = (r_out, r_xg, r_grads), r_stats.dropped
    r_out, r_xg, r_grads = mine
    close = dict(rtol=1e-6, atol=1e-6, msg=lambda m: f"{name} (rank {rank} of {world}): {m}")
    torch.testing.assert_close(out, r_out, **close)
    torch.testing.assert_close(xg, r_xg, **close)
    for n, gr in grads.items():
        if n.startswith("experts."):
            assert gr is not None, f"{name}: {n} got no gradient on rank {rank}"
            full = torch.empty((world * gr.shape[0], *gr.shape[1:]))
            dist.all_gather_into_tensor(full, gr.contiguous())
            torch.testing.assert_close(full, expert_sum[n[len("experts.") :]], **close)
        else:
            torch.testing.assert_close(gr, r_grads[n], **close)
    assert stats.dropped == dropped_ref
    received = torch.tensor(stats.received)
    everyone = torch.empty(world * len(stats.received), dtype=torch.int64)
    dist.all_gather_into_tensor(everyone, received)
    total = sum(_tokens(s, case)[0].shape[0] for s in range(world)) * layer.top_k
    dropped = torch.tensor([stats.dropped])
    dist.all_reduce(dropped)
    assert int(everyone.sum()) + int(dropped) == total, name
    if name.startswith("no-tokens"):
        assert everyone.view(world, -1)[-1].sum() == 0 and everyone.sum() > 0
        if rank == world - 1:
            assert grads["experts.gate_up_proj"].abs().sum() == 0  # zeros, not None
    if name == "one-expert-takes-all":
        assert everyone.tolist() == [total] + [0] * (8 - 1)
    if name == "capacity":
        assert int(dropped) > 0


def _raises_everywhere(fn, match_mine: str, match_others: str, culprit: int | None) -> None:
    rank = dist.get_rank()
    match = match_mine if culprit is None or rank == culprit else match_others
    with pytest.raises(ValueError, match=match):
        fn()


def _bad_inputs() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    wg = dist.group.WORLD
    odd = 2 * world + 1
    _raises_everywhere(lambda: MoEBlock(H, INTER, odd, 2, ep_group=wg), f"num_experts={odd} is not divisible", "", None)
    _raises_everywhere(
        lambda: MoEBlock(H, INTER, world, world + 1, ep_group=wg), "is larger than num_experts", "", None
    )
    # invalid on one rank only: that rank's message everywhere
    top_k = 100 if rank == 1 else 2
    _raises_everywhere(
        lambda: MoEBlock(H, INTER, 8, top_k, ep_group=wg),
        "top_k=100 is larger",
        "rank 1 failed: top_k=100 is larger",
        1,
    )
    # valid everywhere, but not the same arguments
    _raises_everywhere(lambda: MoEBlock(H, INTER, 8, 2 + (rank == 0), ep_group=wg), "disagree", "disagree", None)
    layer = MoEBlock(H, INTER, 8, 2, ep_group=wg)
    x = torch.randn(5, H)
    bad = x.clone()
    bad[2, 3] = math.nan
    _raises_everywhere(
        lambda: layer(bad if rank == 1 else x),
        "non-finite logits \\(NaN or inf\\) for 1 of 5 tokens on expert-parallel rank 1",
        "expert-parallel rank 1 \\(global rank 1\\) failed: its router produced non-finite logits",
        1,
    )
    _raises_everywhere(
        lambda: layer(torch.randn(5, H + 1) if rank == 0 else x),
        f"must be \\[..., hidden_size={H}\\]",
        "rank 0 \\(global rank 0\\) failed: its input to the MoE layer was refused",
        0,
    )
    # nothing was left in flight: the next forward and backward run everywhere
    layer(x).sum().backward()
    assert layer.experts.gate_up_proj.grad is not None


@multirank(2, 4, timeout=240)
def test_expert_parallel_equals_one_process_and_refuses_bad_input_everywhere():
    world = dist.get_world_size()
    for name, case in _cases(world).items():
        _parity(name, case)
    _bad_inputs()
