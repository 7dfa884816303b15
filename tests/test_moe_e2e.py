"""transformers' MoE causal LMs trained end to end through ``llmpar.initialize`` with expert parallelism: tiny
Qwen3-MoE, Mixtral and DeepSeek-V3 (configs built here, no downloads) on 4 CPU ranks, ``"expert_parallel":
{"enabled": true, "autoep_size": 2}`` (ep=2 x edp=2; the dense part over dp=4) at ZeRO-1, 2 and 3, with gradient
clipping and the routers' load-balancing loss in the model's loss: the losses and the gathered weights (every
expert under its global index) follow one process running transformers' own experts (no swap, no EP) on the whole
batch to 1e-5. One launch, every model and stage inside it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_moe_hf import VOCAB, _model

import llmpar
from llmpar.moe.hf import HFMoEBlock
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


def _reference(name: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, transformers' own blocks: each step the mean of the dp ranks' losses (each rank's loss over its
    own tokens, as the router's load-balancing loss is), clipped, plain AdamW."""
    model = _model(name).train()
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
    model = _model(name).train()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }
    engine, opt, _, _ = llmpar.initialize(model=model, config=config)
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
    worst: dict[str, float] = {}
    for name in HF_MODELS:
        start = {k: v.detach().clone() for k, v in _model(name).named_parameters()}
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
