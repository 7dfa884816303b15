"""Expert parallelism under ZeRO: the ``ep`` / ``edp`` groups of ``ParallelDims`` (which ranks, bad degrees), and a
tiny model with two ``MoEBlock`` layers trained EP x DP x ZeRO-{1,2,3} on 4 CPU ranks (ep=2, edp=2) following one
process on the whole batch to 1e-5 (losses, dense params, every rank's expert slice), with gradient clipping that
binds (each expert counted once), the aux losses in the loss, CPU offload (optimizer; params at stage 3) and int8
states, and (stage 3) one rank whose experts receive no tokens (its zero grads still reduced: no hang). One launch,
every layout inside it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero_helpers import reference_loop

from llmpar.distributed.dims import ParallelDims
from llmpar.moe import MoEBlock, RouterConfig
from llmpar.planning.moe import MoESpec, alltoall_bytes, moe_memory, suggest_ep
from llmpar.zero import ZeroConfig, ZeroOptimizer
from llmpar.zero.experts import split_expert_groups
from llmpar.zero.gather import consolidated_state_dict

from multirank import multirank

H, INTER, E, OUT = 12, 8, 8, 3


# ------------------------------------------------------------------------------------------------ the groups
def test_ep_and_edp_ranks():
    d = ParallelDims(dp=4, cp=2, ep=4, world_size=8)
    assert d.edp == 2 and d.degree("ep") == 4 and d.degree("edp") == 2
    assert d.derived_ranks("ep", 0) == [0, 1, 2, 3] and d.derived_ranks("ep", 5) == [4, 5, 6, 7]
    assert d.derived_ranks("edp", 0) == [0, 4] and d.derived_ranks("edp", 7) == [3, 7]
    t = ParallelDims(tp=2, dp=4, ep=2, world_size=8)  # experts replicated over tp: same tp coordinate
    assert t.derived_ranks("ep", 0) == [0, 2] and t.derived_ranks("edp", 0) == [0, 4]
    assert t.derived_ranks("ep", 3) == [1, 3] and t.derived_ranks("edp", 3) == [3, 7]
    for r in range(8):  # ep x edp partitions each dp x cp group
        ep, edp = set(t.derived_ranks("ep", r)), set(t.derived_ranks("edp", r))
        assert ep & edp == {r} and len(ep) * len(edp) == len(t.derived_ranks("dp_cp", r))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dp=4, ep=3, world_size=4), "ep=3 does not divide dp\\*cp"),
        (dict(dp=2, ep=0, world_size=2), "ep=0 is not valid"),
    ],
)
def test_bad_ep_degree(kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kw)


def test_unknown_group_named():
    with pytest.raises(ValueError, match="no derived group 'xp'.*edp"):
        ParallelDims(dp=2, world_size=2).derived_ranks("xp", 0)


def test_split_expert_groups_keeps_hyperparameters():
    model = _Net(None, RouterConfig())
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named], "names": [n for n, _ in named], "lr": 0.5, "betas": (0.9, 0.99)}]
    groups[0].update(eps=1e-8, weight_decay=0.0)
    dense, experts, owner = split_expert_groups(groups)
    names = [n for n, _ in experts[0]["params"]]
    assert names == [f"moe{i}.experts.{w}" for i in (1, 2) for w in ("gate_up_proj", "down_proj")]
    assert not any(".experts." in n for n in dense[0]["names"]) and owner == [0] and experts[0]["lr"] == 0.5


# ------------------------------------------------------------------------------------------------ the planner
SPEC = MoESpec(moe_layers=3, num_experts=8, top_k=2, hidden=10, expert_intermediate=6, dense_params=1000)


def test_moe_planner_formulas():
    assert SPEC.expert_params == 3 * 8 * 3 * 10 * 6  # 4320
    m = moe_memory(SPEC, dp=4, ep=2, zero_stage=1, precision="fp32")  # 4 + 4 B/param, 8 B of moments over dp / edp
    assert m["dense"] == pytest.approx(1000 * (8 + 8 / 4)) and m["experts"] == pytest.approx(4320 / 2 * (8 + 8 / 2))
    m3 = moe_memory(SPEC, dp=4, ep=4, zero_stage=3, precision="fp32")  # ep=dp: edp=1, experts unsharded by ZeRO
    assert m3["experts"] == pytest.approx(4320 / 4 * 16) and m3["dense"] == pytest.approx(1000 * 16 / 4)
    assert alltoall_bytes(SPEC, ep=1, tokens_per_rank=100) == 0
    assert alltoall_bytes(SPEC, ep=4, tokens_per_rank=100, activation_bytes=2) == pytest.approx(
        3 * 4 * 100 * 2 * 0.75 * 10 * 2
    )
    need = {ep: moe_memory(SPEC, dp=8, ep=ep)["total"] for ep in (1, 2, 4, 8)}
    assert need[1] > need[2] > need[4] > need[8]
    assert suggest_ep(SPEC, dp=8, budget_bytes=need[2], ranks_per_node=8) == 2
    assert suggest_ep(SPEC, dp=8, budget_bytes=need[8] - 1, ranks_per_node=4) == 4  # none fits: the node's largest
    with pytest.raises(ValueError, match="ep=3 does not divide dp=8"):
        moe_memory(SPEC, dp=8, ep=3)


# ------------------------------------------------------------------------------------------------ parity
class _Net(nn.Module):
    def __init__(self, ep_group, router: RouterConfig) -> None:
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe1 = MoEBlock(H, INTER, E, 2, ep_group=ep_group, router=router, shared_intermediate_size=6)
        self.moe2 = MoEBlock(H, INTER, E, 2, ep_group=ep_group, router=router)
        self.out = nn.Linear(H, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.moe1(h)
        h = h + self.moe2(h)
        return self.out(h)


def _loss(net: _Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(x), y) + net.moe1.aux_loss + net.moe2.aux_loss


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 5, H, generator=g), torch.randn(2, 5, OUT, generator=g)


LAYOUTS = {  # name: (stage, zero_config extras, state precision, clip)
    "zero1-clip": (1, {}, None, 0.05),
    "zero2-clip-offload": (2, {"offload_optimizer": {"device": "cpu"}}, None, 0.05),
    "zero2-int8": (2, {}, "int8", None),
    "zero3-clip": (3, {"stage3_param_persistence_threshold": 0}, None, 0.05),
    "zero3-offload-clip": (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, None, 0.05),
}


def _build(ep_group, starve: bool) -> _Net:
    torch.manual_seed(0)
    router = RouterConfig(aux_loss_coeff=0.05, z_loss_coeff=0.01, expert_bias=starve, score_func="softmax")
    net = _Net(ep_group, router)
    if starve:  # no token reaches experts 4..7 (ep rank 1's): its grads are zeros, still reduced
        for moe in (net.moe1, net.moe2):
            moe.router.expert_bias[E // 2 :] = -100.0
    return net


def _train_layout(name: str, dims: ParallelDims, steps: int = 3) -> dict[str, float]:
    stage, extra, precision, clip = LAYOUTS[name]
    starve = name.startswith("zero3")
    rank, dp = dist.get_rank(), dist.get_world_size()
    ep_group, edp_group = dims.group("ep"), dims.group("edp")
    net = _build(ep_group, starve)
    opt_cfg = dict(lr=2e-2, weight_decay=0.1) | ({"state_precision": precision} if precision else {})
    opt = ZeroOptimizer(
        list(net.named_parameters()),
        opt_cfg,
        dist.group.WORLD,
        zero_config=ZeroConfig(stage=stage, **extra),
        max_grad_norm=clip,
        module=net,
        expert_group=edp_group,
        ep_group=ep_group,
    )
    assert opt.experts is not None and {id(p) for b in opt.experts.buffers for p in b.params} == {
        id(p) for n, p in net.named_parameters() if ".experts." in n
    }
    losses = []
    for s in range(steps):
        x, y = _batch(s, rank)
        loss = _loss(net, x, y)
        loss.backward()
        total = loss.detach().double()
        dist.all_reduce(total)
        assert opt.step()
        opt.zero_grad()
        losses.append(total.item() / dp)
    if precision is None and "offload" not in name:  # the planner's model states against the buffers' bytes
        psi_e = sum(p.numel() for n, p in _build(None, False).named_parameters() if ".experts." in n)
        spec = MoESpec(moe_layers=2, num_experts=E, top_k=2, hidden=H, expert_intermediate=INTER, dense_params=1)
        assert spec.expert_params == psi_e
        want_e = moe_memory(spec, dp=dp, ep=dims.ep, zero_stage=stage, precision="fp32")["experts"]
        got_e = opt.experts.memory_bytes()
        got_e = sum(got_e[k] for k in ("params", "grads", "master", "optimizer_state"))
        assert abs(got_e - want_e) <= 0.1 * want_e, (got_e, want_e)  # padding to whole shards aside
    dense = consolidated_state_dict(net, opt, rank0_only=False)  # stage 3: each optimizer gathers its own params
    experts = consolidated_state_dict(net, opt.experts, rank0_only=False)
    got = {k: (experts if ".experts." in k else dense)[k] for k in dense}
    if precision is not None:  # int8 states: no exact reference; the run trains and stays finite
        return {"loss": 0.0 if all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0] else 1.0}
    ref = _build(None, starve)
    # one process, the whole batch one rank's tokens at a time (the aux losses are per rank's tokens): the mean loss
    want = reference_loop(ref, [{"params": list(ref.named_parameters())}], steps, dp, _batch, _loss, clip or 1e9)
    sd = ref.state_dict()
    n = E // dims.ep
    lo = dims.derived_ranks("ep", rank).index(rank) * n  # this rank's experts
    errs = {"loss": max(abs(a - b) for a, b in zip(losses, want))}
    for k, v in got.items():
        full = sd[k][lo : lo + n] if ".experts." in k else sd[k]
        errs[k] = (v.double() - full.double()).abs().max().item()
    return errs


@pytest.mark.slow(reason="every ZeRO stage with experts over edp (offload, int8, starved experts) in one 4-rank launch")
@multirank(4, timeout=400)
def test_ep_zero_stages_follow_one_process():
    dims = ParallelDims(dp=4, ep=2)
    spread = _build(dims.group("ep"), False)
    with pytest.raises(ValueError, match="moe1.experts.gate_up_proj.*ep=2.*expert_group"):  # no silent mixing
        ZeroOptimizer(list(spread.named_parameters()), {}, dist.group.WORLD, stage=1)
    worst = {}
    for name in LAYOUTS:
        errs = _train_layout(name, dims)
        worst[name] = max(errs.values())
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"{name}: {bad}"
    return worst
