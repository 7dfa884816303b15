"""transformers' MoE causal LMs trained end to end through ``llmpar.initialize`` with expert parallelism: tiny
Qwen3-MoE, Mixtral and DeepSeek-V3 (configs built here, no downloads) on 4 CPU ranks, ``"expert_parallel":
{"enabled": true, "autoep_size": 2}`` (ep=2 x edp=2; the dense part over dp=4) at ZeRO-1, 2 and 3, with gradient
clipping and the routers' load-balancing loss in the model's loss (DeepSeek-V3 with ep rank 1's experts given no
token: their zero gradients reduced, no hang at any stage): the losses and the gathered weights (every expert under
its global index) follow one process running transformers' own experts (no swap, no EP) on the whole
batch to 1e-5. One launch, every model and stage inside it.

In the same pooled ranks: DeepSpeed's legacy ``MoE`` at ep_size=2 under ``llmpar.initialize`` (the optimizer from
``split_params_into_different_moe_groups_for_optimizer``: a client AdamW or ``model_parameters``; ZeRO 0-3) follows the
layer at ep_size=1 on one process to 1e-6, and layers of two ep sizes are refused; and llmpar's GPT with MoE blocks
trained with ep=2 over dp=2 x cp=2 (ring attention at ZeRO-1, Ulysses at ZeRO-3) follows one process to 1e-5, and so
do Qwen3-MoE, Qwen2-MoE and Mixtral (swapped blocks at ep=2, the router loss over the whole sequence) against one
process with transformers' own experts and full-sequence attention."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_moe_hf import VOCAB, _model

import llmpar
from llmpar.distributed.dims import ParallelDims
from llmpar.models import GPT, GPTConfig
from llmpar.models.gpt import lm_loss
from llmpar.moe import MoEBlock
from llmpar.moe.hf import HFMoEBlock
from llmpar.moe.layer import MoE
from llmpar.moe.utils import split_params_into_different_moe_groups_for_optimizer
from llmpar.utils import groups
from llmpar.zero.gather import consolidated_state_dict

from multirank import multirank

transformers = pytest.importorskip("transformers")

HF_MODELS = ("qwen3_moe", "mixtral", "deepseek_v3")
STAGES = (1, 2, 3)
STEPS, LR, CLIP, MICRO, SEQ = 2, 2e-2, 0.5, 2, 7


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def _hf_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name of a swapped model -> transformers' name."""
    out = {}
    for prefix, m in model.named_modules():
        if isinstance(m, HFMoEBlock):
            out |= {f"{prefix}.{ours}": f"{prefix}.{theirs}" for ours, theirs in m.hf_names.items()}
    return out


def _hf_model(name: str) -> torch.nn.Module:
    """The tiny model of ``test_moe_hf`` in training mode; DeepSeek-V3's routing bias keeps every token off experts
    4..7 (ep rank 1's at ep=2): those ranks' experts get no tokens, their zero gradients are still reduced."""
    model = _model(name).train()
    if name == "deepseek_v3":
        with torch.no_grad():
            for n, t in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    t[t.shape[0] // 2 :] = -100.0
    return model


def _reference(name: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, transformers' own blocks: each step the mean of the dp ranks' losses (each rank's loss over its
    own tokens, as the router's load-balancing loss is), clipped, plain AdamW."""
    model = _hf_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for r in range(dp):
            ids = _ids(s, r)
            loss = model(input_ids=ids, labels=ids).loss / dp
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {
        n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()] if n in model.state_dict()
    }


def _train(name: str, stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, dp = dist.get_rank(), dist.get_world_size()
    model = _hf_model(name)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }
    kw: dict[str, Any] = {}
    if stage == 2:  # a client optimizer built before initialize swaps and spreads the experts: it still steps them
        kw["optimizer"] = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    engine, opt, _, _ = llmpar.initialize(model=model, config=config, **kw)
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert blocks and all(b.ep_size == 2 and b.experts.num_local_experts == b.num_experts // 2 for b in blocks)
    assert opt.experts is not None
    losses = []
    for s in range(STEPS):
        ids = _ids(s, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().double()
        dist.all_reduce(total)
        losses.append(total.item() / dp)
    if name == "deepseek_v3":  # the starved experts: ep rank 1's receive no token from any rank
        assert all(int(b.tokens_per_expert[b.num_experts // 2 :].sum()) == 0 for b in blocks)
    names = _hf_names(model)
    state = consolidated_state_dict(model, opt, rank0_only=False)
    engine.destroy()
    return losses, {names.get(k, k): v for k, v in state.items()}


@pytest.mark.slow(
    reason="tiny Qwen3-MoE / Mixtral / DeepSeek-V3 each trained at ZeRO-1/2/3 with ep=2 on 4 ranks (9 engines, "
    "3 one-process references) in one launch"
)
@multirank(4, timeout=600)
def test_hf_moe_models_trained_ep_dp_zero_follow_one_process():
    dp = dist.get_world_size()
    bad = {"train_batch_size": 4, "expert_parallel": {"enabled": True, "autoep_size": 4}}
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep=4"):  # Mixtral's 6 experts
        llmpar.initialize(model=_hf_model("mixtral"), config=bad)
    wide = {**bad, "expert_parallel": {"enabled": True, "autoep_size": 8}}  # divides Qwen3-MoE's 8 experts
    with pytest.raises(
        ValueError, match=r'"expert_parallel.autoep_size"=8 does not divide the 4 data-parallel \(x cp\) ranks'
    ):
        llmpar.initialize(model=_hf_model("qwen3_moe"), config=wide)
    worst: dict[str, float] = {}
    for name in HF_MODELS:
        start = {k: v.detach().clone() for k, v in _hf_model(name).named_parameters()}
        want, ref_weights = _reference(name, dp)
        for stage in STAGES:
            got, weights = _train(name, stage)
            errs = {"loss": max(abs(a - b) for a, b in zip(got, want))}
            assert weights.keys() >= ref_weights.keys(), sorted(set(ref_weights) - set(weights))
            for k, w in ref_weights.items():
                assert weights[k].shape == w.shape, (name, k, weights[k].shape, w.shape)
                errs[k] = (weights[k].double() - w.double()).abs().max().item()
            assert max(w0 for w0 in errs.values()) < 1e-5, (name, stage, {k: e for k, e in errs.items() if e >= 1e-5})
            moved = max((weights[k] - start[k]).abs().max().item() for k in start)
            assert moved > 1e-3, (name, stage, "the run did not train")
            worst[f"{name}/zero{stage}"] = max(errs.values())
    return worst


# ------------------------------------------------------------------------------------------------ DeepSpeed's MoE
class _LegacyNet(torch.nn.Module):
    """A DeepSpeed MoE script's model: a projection, ``llmpar.moe.layer.MoE`` (top-2, capacity dropping; its l_aux
    added to the loss by the script), a head; the experts this ep rank holds are global experts ``first + i``.
    ``starve``: every token picks experts 0 and 1 (the projection's bias positive, the gate's rows 2 and 3 negative):
    at ep_size=2 the second ep rank's experts get no token."""

    def __init__(self, ep_size: int, first: int, ep_group: object = None, starve: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(8, LH), torch.nn.Linear(LH, 3)
        expert = torch.nn.Sequential(torch.nn.Linear(LH, 10), torch.nn.GELU(), torch.nn.Linear(10, LH))
        self.moe = MoE(LH, expert, LE, ep_size, k=2, min_capacity=0, top2_2nd_expert_sampling=False, ep_group=ep_group)
        for i, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(100 + first + i)
            with torch.no_grad():
                for p in e.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if starve:
            with torch.no_grad():
                self.inp.bias.fill_(5.0)
                self.moe.deepspeed_moe.gate.wg.weight[2:] = -10.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(self.inp(x))
        return self.out(h).pow(2).mean() + 0.01 * l_aux


LH, LE, LEGACY_CLIP = 12, 4, 0.1  # the clipping binds (the gradient norm is ~0.34): every expert counted once


def _legacy_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(7, 8, generator=torch.Generator().manual_seed(500 + 10 * step + rank))


def _legacy_groups(net: torch.nn.Module) -> list[dict]:
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "p", "weight_decay": 0.01}
    )


def _legacy_reference(dp: int, starve: bool = False) -> dict[str, torch.Tensor]:
    """One process, ep_size=1 (every expert local), each rank's batch in turn, plain AdamW over DeepSpeed's groups."""
    net = _LegacyNet(1, 0, starve=starve)
    opt = torch.optim.AdamW(_legacy_groups(net), lr=LR)
    for s in range(STEPS):
        for r in range(dp):
            (net(_legacy_batch(s, r)) / dp).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), LEGACY_CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _legacy_train(stage: int, how: str) -> dict[str, float]:
    """ep_size=2 under ``llmpar.initialize`` (the engine gives the layer DeepSpeed's groups), the optimizer from
    DeepSpeed's MoE param groups: a client AdamW (``how="client"``), or ``model_parameters`` with the config's
    optimizer (``"groups"``); ``"ep_group"``: the layer built over ``ParallelDims(ep=2).group("ep")`` (llmpar's
    argument; the engine derives the expert-data-parallel group) with a client AdamW; ``"data_first"``: the script
    calls ``set_deepspeed_parallelism(use_data_before_expert_parallel_=True)`` itself (ep groups [0, 2], [1, 3]: the
    engine keeps them and shards over their expert-data-parallel groups [0, 1], [2, 3]); ``"starved"``: a client
    AdamW, every token routed to experts 0 and 1 (``_LegacyNet(starve=True)``)."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    n, data_first = LE // 2, how == "data_first"
    ep_group = ParallelDims(dp=dp, ep=2).group("ep") if how == "ep_group" else None
    ep_rank = rank // 2 if data_first else rank % 2  # ep groups of consecutive ranks (DeepSpeed's and ParallelDims')
    net = _LegacyNet(2, ep_rank * n, ep_group, starve=how == "starved")
    if data_first:
        groups._reset()  # "ep_size_2" in the other layout
        net.moe.set_deepspeed_parallelism(use_data_before_expert_parallel_=True)
    config: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": LEGACY_CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if how != "groups":
        kw: dict = {"optimizer": torch.optim.AdamW(_legacy_groups(net), lr=LR)}
    else:
        kw = {"model_parameters": _legacy_groups(net)}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR}}
    engine, opt, _, _ = llmpar.initialize(model=net, config=config, **kw)
    ep_ranks = dist.get_process_group_ranks(net.moe.deepspeed_moe.ep_group)
    assert ep_ranks == ([rank % 2, rank % 2 + 2] if data_first else [rank - rank % 2, rank - rank % 2 + 1])
    assert engine.moe.ep == 2 and dist.get_process_group_ranks(opt.experts.dp_group.get()) == (
        [rank - rank % 2, rank - rank % 2 + 1] if data_first else [rank % 2, rank % 2 + 2]
    )
    assert opt.experts is not None
    for s in range(STEPS):
        engine.backward(engine(_legacy_batch(s, rank)))
        engine.step()
        counts = net.moe.deepspeed_moe.exp_counts
        assert how != "starved" or (int(counts[2:].sum()) == 0 and int(counts[:2].sum()) > 0), counts
    full = consolidated_state_dict(net, opt, rank0_only=False)  # every expert under its global index
    shown = engine.module_state_dict()  # the same on rank 0 ({} elsewhere): what save_16bit_model writes
    assert sorted(shown) == sorted(full) if rank == 0 else shown == {}
    engine.destroy()
    want = _legacy_reference(dp, starve=how == "starved")
    assert sorted(full) == sorted(want), sorted(set(full) ^ set(want))
    return {k: (full[k].double() - w.double()).abs().max().item() for k, w in want.items()}


def _legacy_checkpoint() -> None:
    """A checkpoint of the ep_size=2 engine (ZeRO-2) loads into a fresh one exactly (every expert, gathered under its
    global index)."""
    import tempfile

    rank, cfg = dist.get_rank(), {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    groups._reset()  # DeepSpeed's default layout again

    def build(ep: int) -> Any:
        net = _LegacyNet(ep, (rank % 2) * (LE // 2) if ep == 2 else 0)
        return llmpar.initialize(model=net, optimizer=torch.optim.AdamW(_legacy_groups(net), lr=LR), config=cfg)[0]

    where = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(where)
    engine = build(2)
    engine.backward(engine(_legacy_batch(0, rank)))
    engine.step()
    engine.save_checkpoint(where[0], tag="t")
    saved = engine.module_state_dict()
    again = build(2)
    again.load_checkpoint(where[0], tag="t")
    loaded = again.module_state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    for e in (engine, again):
        e.destroy()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0], ignore_errors=True)


@multirank(4, timeout=300)
def test_deepspeed_moe_at_ep2_trains_under_initialize_as_one_process():
    groups._reset()  # groups of an earlier test in these pooled ranks are gone
    worst: dict[str, float] = {}
    for stage, how in (
        (0, "client"),
        (1, "groups"),
        (2, "ep_group"),
        (3, "client"),
        (3, "groups"),
        (3, "starved"),  # ep rank 1's experts get no token: no hang at ZeRO-3, zero grads reduced
        (2, "data_first"),  # last: it leaves DeepSpeed's registry in the other layout
    ):
        errs = _legacy_train(stage, how)
        bad = {k: e for k, e in errs.items() if e > 1e-6}
        assert not bad, (stage, how, bad)
        worst[f"zero{stage}/{how}"] = max(errs.values())
    _legacy_checkpoint()
    odd = _LegacyNet(2, 0, ParallelDims(dp=dist.get_world_size(), ep=2).group("edp"))  # no edp group known for it
    with pytest.raises(ValueError, match=r"exchanges tokens over ranks \[\d, \d\], not ParallelDims\(ep=2\)"):
        llmpar.initialize(model=odd, config={"train_batch_size": 4})
    two = _LegacyNet(2, 0)  # a second layer over another ep size: refused on every rank, naming both sizes
    two.moe2 = MoE(LH, torch.nn.Linear(LH, LH), num_experts=LE, ep_size=4)
    with pytest.raises(ValueError, match=r"ep_size \[2, 4\] in one model"):
        llmpar.initialize(model=two, config={"train_batch_size": 4})
    with pytest.raises(ValueError, match='autoep_size"=4 but the model.s MoE layers were built with ep_size=2'):
        config = {"train_batch_size": 4, "expert_parallel": {"enabled": True, "autoep_size": 4}}
        llmpar.initialize(model=_LegacyNet(2, 0), config=config)
    return worst


# ------------------------------------------------------------------------------------------------ EP with cp
GPT_CFG = dict(
    vocab_size=61, n_layer=2, n_head=4, d_model=16, seq_len=16, bias=False
)  # no key bias: its gradient is 0 up to rounding
CP_T, CP_E = 13, 4


def _moe_gpt(inter: int = 12, init_std: float = 0.02, **groups) -> GPT:
    """llmpar's GPT with each block's MLP a dropless top-2 MoEBlock (4 experts, router weights not small);
    ``groups``: the layers' ``ep_group`` / ``etp_group`` (the same weights: each rank keeps its slice of the draw)."""
    model = GPT(GPTConfig(**GPT_CFG), seed=3)
    torch.manual_seed(4)
    for block in model.blocks:
        block.mlp = MoEBlock(GPT_CFG["d_model"], inter, CP_E, 2, init_std=init_std, **groups)
        with torch.no_grad():
            block.mlp.router.weight.normal_(0.0, 0.5)
    return model


def _cp_batch(step: int, dp_rank: int, seed: int = 700, seq: int = CP_T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 10 * step + dp_rank)
    x = torch.randint(0, GPT_CFG["vocab_size"], (MICRO, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _cp_reference(dp: int) -> dict[str, torch.Tensor]:
    model = _moe_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for s in range(STEPS):
        for d in range(dp):
            idx, targets = _cp_batch(s, d)
            (lm_loss(model(idx), targets) / dp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@multirank(4, timeout=300)
def test_expert_parallel_with_context_parallel_follows_one_process():
    """ep=2 over the dp=2 x cp=2 ranks (each sequence split over its cp pair, the tokens of both halves exchanged
    over the ep pair), ZeRO-1 with ring attention and ZeRO-3 with Ulysses: the gathered weights follow one process on
    the whole batch to 1e-5."""
    worst: dict[str, float] = {}
    want = _cp_reference(2)
    for stage, mode in ((1, "ring"), (3, "ulysses")):
        model = _moe_gpt()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "context_parallel": {"size": 2, "mode": mode},
            "expert_parallel": {"enabled": True, "autoep_size": 2},
        }
        engine, opt, _, _ = llmpar.initialize(model=model, config=config)
        assert (engine.context_parallel.size, engine.dp_world_size, engine.moe.ep) == (2, 2, 2)
        assert all(b.mlp.ep_size == 2 for b in model.blocks) and opt.experts is not None
        for s in range(STEPS):
            idx, targets = _cp_batch(s, engine.dp_rank)
            engine.backward(engine(idx, targets))
            engine.step()
        got = consolidated_state_dict(model, opt, rank0_only=False)
        engine.destroy()
        errs = {k: (got[k].double() - w.double()).abs().max().item() for k, w in want.items()}
        bad = {k: e for k, e in errs.items() if e > 1e-5}
        assert not bad, (stage, bad)
        worst[f"zero{stage}/{mode}"] = max(errs.values())
    for name, stage, mode, ep in (
        ("qwen3_moe", 1, "ring", 2),
        ("qwen2_moe", 2, "ring", 2),
        ("mixtral", 3, "ulysses", 2),
        ("mixtral", 1, "ring", 1),  # no "expert_parallel": transformers' own MoE blocks under cp
    ):
        worst[f"{name}/zero{stage}/{mode}/ep{ep}"] = _hf_cp(name, stage, mode, ep)
    with pytest.raises(ValueError, match="does not run its multi-head latent attention"):
        llmpar.initialize(model=_hf_model("deepseek_v3"), config={**HF_CP, "context_parallel": {"size": 2}})
    return worst


HF_CP = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_clipping": CLIP,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
    "expert_parallel": {"enabled": True, "autoep_size": 2},
}


def _hf_cp(name: str, stage: int, mode: str, ep: int) -> float:
    """A transformers MoE model (swapped blocks at ep=2; ep=1: no "expert_parallel", transformers' own blocks) over
    dp=2 x cp=2: each dp pair's batch of SEQ=7 tokens split over its cp ranks (padded to 8), the router loss over the
    whole sequence; against one process running transformers' own experts and full-sequence attention on both dp
    batches (``_reference``): losses and the gathered weights to 1e-5. Returns the largest difference."""
    want_losses, want = _reference(name, 2)
    model = _hf_model(name)
    config = {
        **HF_CP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "context_parallel": {"size": 2, "mode": mode},
    }
    if ep == 1:
        del config["expert_parallel"]
    engine, opt, _, _ = llmpar.initialize(model=model, config=config)
    assert (engine.context_parallel.size, engine.dp_world_size) == (2, 2)
    assert model.config._attn_implementation == "llmpar_cp"
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    if ep == 2:
        assert engine.moe.ep == 2 and blocks and all(b.ep_size == 2 for b in blocks) and opt.experts is not None
    else:
        assert not blocks and opt.experts is None
    losses = []
    for s in range(STEPS):
        ids = _ids(s, engine.dp_rank)
        out = engine(input_ids=ids, labels=ids)
        assert float(out.aux_loss) > 0.5  # the whole sequence's load-balancing loss, in the loss
        engine.backward(out.loss)
        engine.step()
        total = out.loss.detach().double()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())  # the cp pair's losses agree: the mean over dp
    with torch.no_grad():  # return_dict=False: the same loss and whole-sequence aux loss, as a tuple
        ids = _ids(STEPS, engine.dp_rank)
        out, tup = engine(input_ids=ids, labels=ids), engine(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out.loss) and torch.equal(tup[1], out.aux_loss)
    names = _hf_names(model)
    state = consolidated_state_dict(model, opt, rank0_only=False)
    engine.destroy()
    got = {names.get(k, k): v for k, v in state.items()}
    errs = {"loss": max(abs(a - b) for a, b in zip(losses, want_losses))}
    errs |= {k: (got[k].double() - w.double()).abs().max().item() for k, w in want.items()}
    bad = {k: e for k, e in errs.items() if e > 1e-5}
    assert not bad, (name, stage, mode, bad)
    return max(errs.values())
