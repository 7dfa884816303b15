"""MoE through ``llmpar.initialize``: the ``"expert_parallel"`` block (DeepSpeed 0.19's AutoEP keys, parsed and
refused as documented), and on 4 CPU ranks a model built with ``ep_group=None`` spread over ep=2 at initialize,
trained with ZeRO-1 over 2 accumulation steps, gradient clipping, the aux losses added by ``engine.backward`` and
the aux-loss-free expert bias moved after each step from the load over the data-parallel ranks: it follows one process
to 1e-5 (losses, params, biases), and the progress line reports each layer's max / mean tokens per expert."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from test_moe_zero import E, _batch, _loss, _Net
from torch import nn

import llmpar
from llmpar.distributed.dims import ParallelDims
from llmpar.moe import RouterConfig
from llmpar.optim import FusedAdamW
from llmpar.runtime.config import Blocks
from llmpar.zero.gather import consolidated_state_dict

from multirank import multirank


# ------------------------------------------------------------------------------------------------ the block
def test_autoep_block_parses_deepspeed_keys():
    raw = {
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 4,
            "preset_model": "deepseek_v3",
            "top_k": 8,
            "route_norm": True,
            "routed_scaling_factor": 2.5,
            "num_expert_groups": 8,
            "num_limited_groups": 4,
            "load_balance_coeff": None,
            "use_grouped_mm": False,
            "combine_impl": "weighted_sum",
            "comm_num_sm": 20,
            "expert_w1": "gate_up_proj",
        }
    }
    ep = Blocks.parse(raw).expert_parallel
    assert (ep.enabled, ep.ep, ep.top_k, ep.overrides) == (True, 4, 8, {"expert_w1": "gate_up_proj"})
    r = ep.router_config()
    assert (r.score_func, r.route_norm, r.routed_scaling_factor, r.n_group, r.topk_group) == (
        "sigmoid",
        True,
        2.5,
        8,
        4,
    )
    mix = Blocks.parse({"expert_parallel": {"preset_model": "mixtral", "autoep_size": 2}}).expert_parallel
    assert mix.ep == 1 and mix.router_config().score_func == "softmax" and mix.router_config().route_norm
    assert Blocks.parse({}).expert_parallel.ep == 1


@pytest.mark.parametrize(
    "block, match",
    [
        ({"autoep_size": 0}, "autoep_size"),
        ({"preset_model": "llama"}, "preset_model.*mixtral"),
        ({"score_func": "relu"}, "score_func"),
        ({"load_balance_coeff": 0.01}, "load_balance_coeff"),
        ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),
        ({"comm_backend": "deepep"}, "comm_backend"),
        ({"score_apply": "pre"}, "score_apply"),
        ({"autoep_sise": 2}, "autoep_size"),
    ],
)
def test_autoep_block_refuses_naming_the_key(block, match):
    with pytest.raises(ValueError, match=match):
        Blocks.parse({"expert_parallel": block})


def test_deepspeed_tagged_params_are_experts():
    """A param tagged as DeepSpeed tags an expert (``allreduce = False``, ``group_name = "ep_size_<ep>"``) is an
    expert to ZeRO: split from the dense params, and refused without an expert-data-parallel group at ep > 1 rather
    than averaged over dp with other ranks' experts."""
    from llmpar.zero.experts import expert_ep_size, refuse_spread_experts, split_expert_groups

    dense, tagged, local = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(4))
    tagged.allreduce, tagged.group_name = False, "ep_size_2"
    local.allreduce, local.group_name = False, "ep_size_1"
    group = {"params": [dense, tagged, local], "names": ["w", "e", "l"], "lr": 0.1, "betas": (0.9, 0.99)}
    group.update(eps=1e-8, weight_decay=0.0)
    rest, experts, owner = split_expert_groups([group])
    assert rest[0]["names"] == ["w"] and [n for n, _ in experts[0]["params"]] == ["e", "l"] and owner == [0]
    assert (expert_ep_size(tagged), expert_ep_size(local), expert_ep_size(dense)) == (2, 1, 1)
    with pytest.raises(ValueError, match="e hold experts spread over ep=2 ranks"):
        refuse_spread_experts([group])


# ------------------------------------------------------------------------------------------------ the engine
STEPS, GAS, CLIP = 3, 2, 0.05


def _router() -> RouterConfig:
    return RouterConfig(aux_loss_coeff=0.05, z_loss_coeff=0.01, expert_bias=True, bias_update_rate=0.05)


def _reference(dp: int) -> tuple[list[float], _Net]:
    torch.manual_seed(0)
    ref = _Net(None, _router())
    opt = FusedAdamW(ref.parameters(), lr=2e-2, weight_decay=0.1)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for m in range(GAS):
            for r in range(dp):
                x, y = _batch(GAS * s + m, r)
                loss = _loss(ref, x, y) / (GAS * dp)
                loss.backward()
                total += loss.item()
        nn.utils.clip_grad_norm_(list(ref.parameters()), CLIP)
        opt.step()
        opt.zero_grad()
        for moe in (ref.moe1, ref.moe2):
            moe.update_expert_bias()
        losses.append(total)
    return losses, ref


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.slow(
    reason="the whole initialize path of an expert-parallel engine (spread, aux, biases, logs, refusals) in one launch"
)
@multirank(4, timeout=300)
def test_initialize_spreads_experts_and_follows_one_process():
    rank, dp = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1},
        "expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": True},
    }
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by ep=3"):
        bad = {**config, "expert_parallel": {"enabled": True, "autoep_size": 3}}
        llmpar.initialize(model=_Net(None, _router()), config=bad)
    with pytest.raises(ValueError, match="autoep_size.*=2 with a .pipeline. block and .tensor_parallel.size.=2"):
        piped = {**config, "pipeline": {"stages": 2}, "tensor_parallel": {"size": 2}}  # EP x PP: tests/test_moe_pipe.py
        llmpar.initialize(model=_Net(None, _router()), config=piped)
    plain = {k: v for k, v in config.items() if k != "expert_parallel"}
    dims = ParallelDims(dp=dp, ep=2)
    built = _Net(dims.group("ep"), _router())  # built over the ep group: the engine derives the same, no block needed
    eng, o, _, _ = llmpar.initialize(model=built, config=plain)
    assert eng.moe.ep == 2 and o.experts is not None
    with pytest.raises(ValueError, match="exchanges tokens over ranks"):  # built over the wrong ranks (edp's)
        llmpar.initialize(model=_Net(dims.group("edp"), _router()), config=plain)
    torch.manual_seed(0)
    net = _Net(None, _router())  # whole experts: spread at initialize
    lines = _Lines()
    logging.getLogger("llmpar").addHandler(lines)
    try:
        engine, opt, _, _ = llmpar.initialize(model=net, config=config)
        assert net.moe1.experts.gate_up_proj.shape[0] == E // 2 and net.moe1.ep_size == 2
        assert opt.experts is not None and engine.moe.ep == 2
        losses = []
        for s in range(STEPS):
            total = torch.zeros((), dtype=torch.float64)
            for m in range(GAS):
                x, y = _batch(GAS * s + m, rank)
                out = engine(x)
                scaled = engine.backward(nn.functional.mse_loss(out, y))  # + the aux losses, / GAS
                engine.step()
                total += scaled.detach().double()
            dist.all_reduce(total)
            losses.append(total.item() / dp)
    finally:
        logging.getLogger("llmpar").removeHandler(lines)
    dense = consolidated_state_dict(net, opt, rank0_only=False)  # the experts whole: every ep rank's rows in order
    shown = engine.module_state_dict()  # the same on dp rank 0, {} elsewhere
    assert (sorted(shown) == sorted(dense)) if rank == 0 else shown == {}
    assert all(torch.equal(v, dense[k]) for k, v in shown.items())
    want, ref = _reference(dp)
    sd = ref.state_dict()
    errs = {"loss": max(abs(a - b) for a, b in zip(losses, want))}
    for k, v in dense.items():
        assert v.shape == sd[k].shape, (k, v.shape)  # gate_up_proj [E, 2I, H]: global, not this rank's E / ep
        errs[k] = (v.double() - sd[k].double()).abs().max().item()
    bad = {k: e for k, e in errs.items() if e > 1e-5}
    assert not bad, bad
    assert not torch.equal(ref.moe1.router.expert_bias, torch.zeros(E))  # the bias moved (and equals the reference)
    if rank == 0:
        progress = [line for line in lines.lines if line.startswith("step=")]
        assert len(progress) == STEPS and all("moe max/mean=[moe1: " in line for line in progress), progress
        ratio = float(progress[-1].split("moe1: ")[1].split(",")[0])
        counts = net.moe1.tokens_per_expert.double()
        assert ratio >= 1.0 and counts.sum() > 0
    engine.destroy()  # the expert optimizer's hooks go too
    assert opt.experts.destroyed
    return errs
