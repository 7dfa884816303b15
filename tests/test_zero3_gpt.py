"""ZeRO stage 3 on the GPT through ``llmpar.initialize`` (CPU/gloo ranks): tied embeddings and tp=2 x dp=2 match one
process; per-rank model state = 16 psi / N; bytes moved per step = 3 psi; gathered units, prefetch, user gathering."""

import pytest
import torch
import torch.distributed as dist
from zero_helpers import GPT_CFG, SEQ, engine_loop, gpt_batch, single_gpt_losses

import llmpar
from llmpar.distributed.collectives import CommCounter
from llmpar.models import GPT, GPTConfig
from llmpar.zero import GatheredParameters

from multirank import run_ranks

_batch = gpt_batch


def _config(micro, **zero):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 700,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 5000,
            **zero,
        },
    }


def gpt_body(tp, micro, steps, tie, zero):
    env = llmpar.init_distributed(tp=tp)
    model = GPT(GPTConfig(**GPT_CFG, tie_embeddings=tie), seed=1, dtype=torch.float64)
    if tp > 1:
        llmpar.parallelize(model, env.mesh["tp"])
    engine, opt, _, _ = llmpar.initialize(model=model, config=_config(micro, **zero), mesh=env.mesh)
    losses = engine_loop(engine, model, steps, micro, env.mesh["dp"])
    return losses, opt.stage3.gathers, opt.stage3.live_numel


def _single(steps, n, tie):
    return single_gpt_losses(GPT(GPTConfig(**GPT_CFG, tie_embeddings=tie), seed=1, dtype=torch.float64), steps, n)


@pytest.mark.parametrize(
    "tp, world, tie, zero",
    [
        (1, 2, True, {}),
        (1, 2, True, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "pin_memory": True}}),
        (2, 4, False, {}),
    ],
)
def test_gpt_stage3_matches_single_process(tp, world, tie, zero):
    outs = run_ranks(gpt_body, world, tp, 2, 4, tie, zero, timeout=120)
    ref = _single(4, 2 * world // tp, tie)
    for rank, (losses, gathers, live) in enumerate(outs):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-7, atol=1e-9, msg=f"rank {rank}")
        assert live == 0 and gathers > 0


def memory_body(offload):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=3, n_head=2, d_model=40, seq_len=SEQ), seed=2)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 25_000,
        "reduce_bucket_size": 10**6,
        "stage3_max_reuse_distance": 0,
    }  # lean: re-gathered for backward
    if offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    counter = CommCounter()
    engine, opt, _, _ = llmpar.initialize(
        model=model,
        config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zero},
        counter=counter,
    )
    x, y = _batch(0, 2)
    for _step in range(2):  # step 0 records the gather order, step 1 prefetches along it
        counter.reset()
        engine.backward(model.loss(engine(x), y))
        engine.step()
    units = [opt.stage3._numel(k) for k in opt.stage3.full]
    kept = sum(opt.stage3._numel(k) for k in opt.stage3.keep_for_bwd)
    return (
        opt.memory_bytes(),
        opt.num_params(),
        dict(counter.volume),
        sum(units),
        max(units),
        kept,
        model.blocks[0].mlp.fc.weight.untyped_storage().nbytes(),
    )


@pytest.mark.parametrize("world, offload", [(2, False), (4, False), (2, True)])
def test_memory_is_16_psi_over_n_and_traffic_is_3_psi(world, offload):
    for mem, psi, volume, padded, biggest, kept, fc_bytes in run_ranks(memory_body, world, offload, timeout=90):
        held = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer_state"]
        formula = (18 if offload else 16) * psi / world  # offload: fp32 grads on the host (DeepSpeed's too)
        assert abs(held - formula) / formula < 0.05, (mem, formula)
        assert fc_bytes == 0  # no param is whole between uses
        if offload:
            assert mem["device"] == 0 and mem["host"] == held
        assert mem["params"] == pytest.approx(2 * psi / world, rel=0.05)
        # gathered at once: the unit in use plus the prefetched ones (<= 25k elements), far below the model
        assert mem["gathered_peak"] <= 2 * (biggest + 25_000)
        assert mem["gathered_peak"] < 2 * padded
        # traffic of a step: forward all-gather + backward all-gather + reduce-scatter = 3 psi (elements, padded),
        # less the units backward starts with (kept gathered from forward, within the prefetch budget)
        assert 0 < kept <= 25_000 and volume["reduce_scatter"] == padded, (kept, volume)
        assert volume["all_gather"] == 2 * padded - kept, volume
        assert abs(padded - psi) / psi < 0.01


def gather_body():
    model = GPT(GPTConfig(**GPT_CFG, tie_embeddings=True), seed=1)
    engine, opt, _, _ = llmpar.initialize(model=model, config=_config(2))
    w = model.blocks[1].mlp.fc.weight
    assert w.untyped_storage().nbytes() == 0
    with GatheredParameters(w, opt, modifier_rank=0):
        before = w.detach().clone()
        if dist.get_rank() == 0:
            w.mul_(2.0)
    with GatheredParameters(w, opt):
        after = w.detach().clone()
    full = engine.module_state_dict()
    ref = GPT(GPTConfig(**GPT_CFG, tie_embeddings=True), seed=1).state_dict()
    return before, after, full, ref, w.untyped_storage().nbytes()


def test_gathered_parameters_and_full_state_dict():
    outs = run_ranks(gather_body, 2, timeout=60)
    for rank, (before, after, full, ref, freed) in enumerate(outs):
        torch.testing.assert_close(after, 2 * before)  # rank 0's change reached every shard
        assert freed == 0
        if rank == 0:
            assert list(full) == list(ref)  # tied head included under its own name
            assert torch.equal(full["lm_head.weight"], full["tok_emb.weight"])
            for n, v in ref.items():
                if n != "blocks.1.mlp.fc.weight":
                    torch.testing.assert_close(full[n], v)
            torch.testing.assert_close(full["blocks.1.mlp.fc.weight"], 2 * ref["blocks.1.mlp.fc.weight"])
        else:
            assert full == {}


def sharded_init_body(steps):
    from llmpar.zero import Init, consolidated_state_dict

    with Init():
        model = GPT(GPTConfig(**GPT_CFG, tie_embeddings=True), seed=1)
    assert next(model.parameters()).is_meta
    engine, opt, _, _ = llmpar.initialize(model=model, config=_config(2))
    psi = opt.num_params()
    full = consolidated_state_dict(model, opt, rank0_only=False)
    losses = []
    for s in range(steps):
        x, y = _batch(s, 2)  # every rank the same batch: the trajectory must not depend on dp
        loss = model.loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    biggest = max(sum(p.ds_numel for p in params) for params in opt.plan.needs)  # released params are empty
    return full, losses, opt.init_peak_numel, psi, biggest


def test_model_built_sharded_never_materialises_whole():
    one = run_ranks(sharded_init_body, 1, 3, timeout=60)[0]
    two = run_ranks(sharded_init_body, 2, 3, timeout=60)
    for full, losses, peak, psi, biggest in two:
        assert list(full) == list(one[0])
        for n, v in one[0].items():
            assert torch.equal(full[n], v), n  # the same values whatever dp
        assert full["blocks.0.attn.qkv.weight"].std() > 0.01  # really initialised
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[1]), rtol=1e-5, atol=1e-5)
        assert peak <= biggest < psi / 2  # at most one unit's params whole at a time (measured)
