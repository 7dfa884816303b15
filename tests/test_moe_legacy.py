"""DeepSpeed's legacy MoE API under llmpar (``llmpar.moe.layer.MoE``, ``llmpar.utils.groups``, ``llmpar.moe.utils``)
against the installed DeepSpeed, live: the same weights and tokens give the same output, l_aux and exp_counts and the
same gradients (to 1e-6 relative) on one process for every gate (top-1 / top-2 / top-k, dropping or not, Random Token
Selection and the second-expert sampling under the same seed, train and eval capacity, the residual MoE), and on 2
ranks with ep_size=2 (one launch, every case inside it); the group layouts are DeepSpeed's; the optimizer groups
split as DeepSpeed's; bad arguments raise errors naming them (on every rank for a bad input)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from torch import nn

from llmpar.moe.layer import MoE
from llmpar.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from llmpar.utils import groups

from multirank import run_ranks

H, INNER, E = 12, 20, 4


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, INNER), nn.GELU(), nn.Linear(INNER, H))


def _spread(moe: nn.Module, first: int) -> None:
    """Give local expert i the weights of global expert ``first + i`` (deep copies start equal)."""
    for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        gen = torch.Generator().manual_seed(100 + first + i)
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = float(theirs.detach().abs().max()) if theirs.numel() else 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


def _compare(theirs: nn.Module, ours: nn.Module, x: torch.Tensor, seed: int, used_token=None, ep: int = 1) -> None:
    """Forward + backward both under the same seed; outputs, l_aux, exp_counts and every gradient agree (with
    ``ep`` > 1, ``ours`` holds only its rank's experts of ``theirs``: the expert gradients are not compared)."""
    weight = torch.linspace(-1.0, 2.0, H)
    results = []
    for layer in (theirs, ours):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        torch.manual_seed(seed)
        out, l_aux, counts = layer(xi, used_token) if used_token is not None else layer(xi)
        ((out * weight).sum() + 0.5 * l_aux).backward()
        results.append((out, l_aux, counts, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (a, la, ca, ga, pa), (b, lb, cb, gb, pb) = results
    assert torch.equal(cb, ca), (cb, ca)
    assert cb.dtype == ca.dtype and b.dtype == a.dtype and b.shape == a.shape
    _close(b, a, "output")
    _close(lb, la, "l_aux")
    _close(gb, ga, "input gradient")
    if ep > 1:
        pa = {n: g for n, g in pa.items() if "experts" not in n}
        pb = {n: g for n, g in pb.items() if "experts" not in n}
    assert pa.keys() == pb.keys()
    for name in pa:
        _close(pb[name], pa[name], f"gradient of {name}")


def _pair(ep_size: int = 1, first: int = 0, **kw) -> tuple[nn.Module, MoE]:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    torch.manual_seed(1)
    expert = _expert()
    torch.manual_seed(2)
    theirs = DeepSpeedMoE(H, expert, num_experts=E, ep_size=ep_size, **kw)
    torch.manual_seed(2)
    ours = MoE(H, expert, num_experts=E, ep_size=ep_size, **kw)
    _spread(theirs, first)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


GATES = {
    "top1-drop": dict(k=1, capacity_factor=0.75, use_rts=False),
    "top1-drop-rts": dict(k=1, capacity_factor=0.75),
    "top1-rsample-jitter": dict(k=1, noisy_gate_policy="RSample", capacity_factor=0.9),
    "top1-jitter-nodrop": dict(k=1, noisy_gate_policy="Jitter", drop_tokens=False),
    "top2-drop": dict(k=2, capacity_factor=0.6, top2_2nd_expert_sampling=False),
    "top2-drop-sampling": dict(k=2, capacity_factor=0.6),
    "top2-nodrop": dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False),
    "top3-drop-probs": dict(k=3, capacity_factor=0.5),
    "top3-nodrop": dict(k=3, drop_tokens=False),
    "top2-residual": dict(k=2, use_residual=True, top2_2nd_expert_sampling=False, capacity_factor=0.8),
}


@pytest.mark.parametrize("name", list(GATES))
def test_legacy_moe_matches_deepspeed(name, ds_ext_dir, monkeypatch):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ds_ext_dir))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    theirs, ours = _pair(min_capacity=2, eval_capacity_factor=0.5, **GATES[name])
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 17, H, generator=gen)
    for training, seed in itertools.product((True, False), (11, 12)):
        theirs.train(training)
        ours.train(training)
        _compare(theirs, ours, x, seed)


def test_legacy_moe_used_token_matches_deepspeed(ds_ext_dir, monkeypatch):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ds_ext_dir))
    theirs, ours = _pair(k=1, capacity_factor=1.0, min_capacity=2, use_rts=False)
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(3))
    used = (torch.arange(29) % 3 != 0).float()
    _compare(theirs, ours, x, 5, used_token=used)


def _ranks_body(ext: str) -> list[str]:
    """On each of 2 ranks (ep_size=2): DeepSpeed's MoE and ours over DeepSpeed's / our "ep_size_2" groups, rank r
    holding global experts 2r, 2r + 1, each rank its own tokens (uneven counts); then a bad input on rank 1 only."""
    os.environ["TORCH_EXTENSIONS_DIR"] = ext
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.utils.groups as ds_groups
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    for table in (ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP):
        table.clear()  # a group of an earlier test in this pooled process is gone
    groups._reset()
    rank = dist.get_rank()
    done = []
    for name, kw in GATES.items():
        theirs, ours = _pair(ep_size=2, first=2 * rank, min_capacity=2, **kw)
        theirs.set_deepspeed_parallelism()
        ours.set_deepspeed_parallelism()
        assert groups._get_expert_parallel_group_ranks("ep_size_2") == list(
            ds_groups._get_expert_parallel_group_ranks("ep_size_2")
        )
        x = torch.randn(16, H, generator=torch.Generator().manual_seed(50 + rank))  # DeepSpeed: same count per rank
        _compare(theirs, ours, x, 21 + rank)
        # uneven token counts (DeepSpeed's buffers would not match): ep=2 equals the 4 experts on one process
        # (the same gate weight: both built from seed 2)
        _, local = _pair(ep_size=1, min_capacity=2, **kw)
        _spread(local, 0)
        _compare(
            local, ours, torch.randn(5 + 8 * rank, H, generator=torch.Generator().manual_seed(60 + rank)), 31, ep=2
        )
        done.append(name)
    bad = torch.randn(5, H + 1 if rank == 1 else H)
    try:
        ours(bad)
    except ValueError as err:
        done.append(f"refused: {err}")
    return done


@pytest.mark.slow(
    reason="one 2-rank launch of DeepSpeed's MoE and ours over every gate (10 cases, forward + backward each, plus the "
    "uneven-token check): the live DeepSpeed expert-parallel baseline, ~10 s on an idle 2-core machine"
)
def test_legacy_moe_matches_deepspeed_on_two_ranks(ds_ext_dir):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    per_rank = run_ranks(_ranks_body, 2, str(ds_ext_dir), timeout=240)
    for rank, done in enumerate(per_rank):
        assert done[:-1] == list(GATES), (rank, done)
        assert done[-1].startswith("refused: ")
    assert "13" in per_rank[1][-1]  # the rank with the bad input names its shape
    assert "rank 1" in per_rank[0][-1]  # the other rank names the failing one


def test_group_layouts_are_deepspeeds():
    """DeepSpeed's docstring example (16 ranks, ep 2) and the data-before-expert / tensor-parallel orderings."""
    ep, edp = groups._layout(16, 2, 1, 1, "tp", False)
    assert ep == [[2 * i, 2 * i + 1] for i in range(8)]
    assert edp == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    ep, edp = groups._layout(8, 2, 1, 1, "tp", True)
    assert edp == [[0, 1, 2, 3], [4, 5, 6, 7]] and ep == [[0, 4], [1, 5], [2, 6], [3, 7]]
    ep, edp = groups._layout(8, 2, 2, 1, "tp", False)  # two pipeline stages of 4 ranks
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ep, edp = groups._layout(8, 2, 1, 2, "tp", False)  # tp 2: ranks ordered lane by lane (0 2 4 6 1 3 5 7)
    assert ep == [[0, 2], [4, 6], [1, 3], [5, 7]] and edp == [[0, 4, 1, 5], [2, 6, 3, 7]]
    with pytest.raises(ValueError, match="ep_size=3"):
        groups._layout(8, 3, 1, 1, "tp", False)


def test_optimizer_groups_split_as_deepspeed(ds_ext_dir, monkeypatch):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ds_ext_dir))
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as theirs_split

    theirs, ours = _pair(k=2)
    head = nn.Linear(H, 3)
    split = []
    for model in (theirs, ours):
        params = list(model.parameters()) + list(head.parameters())
        groups_in = [{"params": params, "name": "dense", "lr": 0.1, "weight_decay": 0.0}]
        fn = theirs_split if model is theirs else split_params_into_different_moe_groups_for_optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        split.append(
            [
                ({k: v for k, v in g.items() if k != "params"}, [names.get(id(p), "head") for p in g["params"]])
                for g in fn(groups_in, max_group_size=700)
            ]
        )
    assert split[1] == split[0]
    assert len(split[0]) > 2  # the experts' group was cut by max_group_size
    assert all(is_moe_param(p) for p in ours.deepspeed_moe.experts.parameters())
    assert not is_moe_param(ours.deepspeed_moe.gate.wg.weight)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        MoE(H, _expert(), num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match="k=5 is larger than num_experts=4"):
        MoE(H, _expert(), num_experts=4, k=5)
    with pytest.raises(ValueError, match="noisy_gate_policy='Gauss'"):
        MoE(H, _expert(), num_experts=4, noisy_gate_policy="Gauss")
    with pytest.raises(TypeError, match="expert must be a torch.nn.Module"):
        MoE(H, lambda x: x, num_experts=4)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoE(H, _expert(), num_experts=4, capacity_factor=0)
    layer = MoE(H, _expert(), num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="ep_size=2 but no expert-parallel group"):
        layer(torch.randn(8, H))
    layer = MoE(H, _expert(), num_experts=4, min_capacity=8)
    with pytest.raises(ValueError, match="fewer than min_capacity=8"):
        layer(torch.randn(5, H))
    with pytest.raises(ValueError, match=r"input \(5, 13\) must be a floating-point tensor \[\.\.\., 12\]"):
        layer(torch.randn(5, H + 1))
    with pytest.raises(ValueError, match="NaN"):
        layer(torch.full((9, H), float("nan")))
    with pytest.raises(KeyError, match="ep_size_8"):
        groups._get_expert_parallel_group("ep_size_8")


class _Net(nn.Module):
    """A DeepSpeed MoE example's shape: a projection, the legacy MoE (its l_aux added to the loss), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, H), nn.Linear(H, 3)
        self.moe = MoE(H, _expert(), num_experts=E, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
        _spread(self.moe, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(self.inp(x))
        return self.out(h).pow(2).mean() + 0.01 * l_aux


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_deepspeed_moe_script_trains_under_initialize_as_plain_adamw(stage):
    """``split_params_into_different_moe_groups_for_optimizer`` groups in a client AdamW, through
    ``llmpar.initialize`` at ZeRO stage 0 / 1 / 3: three steps land where plain torch AdamW lands (1e-6)."""
    import llmpar
    from llmpar.zero import GatheredParameters

    data = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def build() -> tuple[_Net, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = _Net()
        groups_ = split_params_into_different_moe_groups_for_optimizer({"params": net.parameters(), "name": "p"})
        assert [g["name"] for g in groups_] == ["p", "ep_size_1"] and groups_[1]["moe"]
        return net, torch.optim.AdamW(groups_, lr=1e-2)

    ref, opt = build()
    for x in data:
        opt.zero_grad()
        ref(x).backward()
        opt.step()
    net, opt = build()
    engine, *_ = llmpar.initialize(
        model=net, optimizer=opt, config={"train_batch_size": 6, "zero_optimization": {"stage": stage}}
    )
    for x in data:
        engine.backward(engine(x))
        engine.step()
    with GatheredParameters(list(net.parameters())):
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
