"""The memory estimate against the bytes llmpar really holds on each rank (tensor-parallel layers, ZeRO stages).

A GPT of llmpar.models is split with llmpar.parallelize on tp CPU ranks; each rank counts the parameter and
gradient bytes it holds, and the planner's per-rank estimate for the same shape must match within 5% (it is
exact for the parameter count when the planner's model of the split is right). The ZeRO tests compare the model
states ZeroOptimizer.memory_bytes() reports (device and host pools) with the planner's, within 5% (issue #19 goal 6;
bench/bench_scaling.py reports the same comparison for the bench GPTs)."""

import pytest
import torch
import torch.distributed as dist

from llmpar.models import GPT, GPTConfig
from llmpar.planning import Layout, ModelSpec, estimate_memory

from multirank import run_ranks

CFG = dict(vocab_size=1001, n_layer=3, n_head=4, d_model=32, seq_len=16, bias=True, tie_embeddings=False)


def _held_bytes():
    from llmpar import parallelize

    model = GPT(GPTConfig(**CFG), seed=0)
    if dist.get_world_size() > 1:
        parallelize(model, dist.group.WORLD)
    x = torch.randint(0, CFG["vocab_size"], (2, 8))
    model(x).float().pow(2).mean().backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return params, grads, sum(p.numel() for p in model.parameters())


def _spec() -> ModelSpec:
    return ModelSpec(
        n_layers=CFG["n_layer"],
        hidden=CFG["d_model"],
        n_heads=CFG["n_head"],
        vocab=CFG["vocab_size"],
        seq_len=CFG["seq_len"],
        tied_embeddings=False,
        bias=True,
        learned_positions=True,
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_estimate_matches_bytes_held_by_tensor_parallel_ranks(tp):
    held = run_ranks(_held_bytes, tp)
    est = estimate_memory(_spec(), Layout(tp=tp), precision="fp32")
    assert est.psi_rank == _spec().params_per_rank(tp=tp)
    for rank, (param_bytes, grad_bytes, _numel) in enumerate(held):
        assert abs(est.params - param_bytes) <= 0.05 * param_bytes, (rank, est.params, param_bytes)
        assert abs(est.grads - grad_bytes) <= 0.05 * grad_bytes, (rank, est.grads, grad_bytes)
    # the busiest rank's parameter count is what the planner computes, to the element
    assert max(h[2] for h in held) == est.psi_rank


@pytest.mark.parametrize("stage, world", [(0, 2), (1, 2), (2, 2), (1, 4), (2, 4)])
def test_estimate_matches_bytes_held_by_zero_ranks(stage, world):
    """planning.model_state_bytes (bf16 params, fp32 master + moments) against what ZeroOptimizer really holds."""
    from test_engine import memory_body

    from llmpar.planning import model_state_bytes

    for rank, (mem, psi, _, _) in enumerate(run_ranks(memory_body, world, stage, timeout=60)):
        est = model_state_bytes(psi, dp=world, zero_stage=stage, precision="fp32_master")
        pairs = {
            "params": mem["params"],
            "grads": mem["grads"],
            "master+optimizer": mem["master"] + mem["optimizer_state"],
        }
        want = {"params": est["params"], "grads": est["grads"], "master+optimizer": est["master"] + est["optimizer"]}
        for kind, held in pairs.items():
            assert abs(want[kind] - held) <= 0.05 * held, (rank, kind, want[kind], held)


def _zero3_memory_body(offload):
    import llmpar

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(301, 257), torch.nn.GELU(), torch.nn.Linear(257, 129))
    zero = {"stage": 3, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    engine, opt, _, _ = llmpar.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zero}
    )
    x = torch.randn(2, 301, dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return opt.memory_bytes(), opt.num_params()


@pytest.mark.parametrize("world, offload", [(2, False), (4, False), (2, True)])
def test_estimate_matches_bytes_held_by_zero3_ranks(world, offload):
    """ZeRO-3 (and ZeRO-3 + optimizer offload): device and host bytes per rank against the planner's estimate."""
    from llmpar.planning import model_state_bytes

    for rank, (mem, psi) in enumerate(run_ranks(_zero3_memory_body, world, offload, timeout=90)):
        est = model_state_bytes(
            psi, dp=world, zero_stage=3, precision="fp32_master", offload="optimizer" if offload else "none"
        )
        est_device = est["params"] + est["grads"] + est["master"] + est["optimizer"]
        assert abs(est_device - mem["device"]) <= 0.05 * mem["device"], (rank, est, mem)
        if offload:
            assert abs(est["cpu"] - mem["host"]) <= 0.05 * mem["host"], (rank, est, mem)


# ------------------------------------------------------------------ estimate_memory against ZeroOptimizer.memory_bytes
# odd sizes (units padded to dp x 16 elements), and a persistence threshold that keeps the biases, norms and the
# position table gathered at stage 3 but shards the matrices
ODD = dict(vocab_size=257, n_layer=2, n_head=3, d_model=48, seq_len=13, tie_embeddings=False)
PERSIST = 1000
MODES = [(bf16, offload) for bf16 in (False, True) for offload in ("none", "optimizer", "optimizer+params")]


def _zero_bytes_body(stage, cases, bucket):
    """memory_bytes() of llmpar.initialize's ZeroOptimizer after two steps, for each (bf16, offload) of ``cases``."""
    import llmpar
    from llmpar.models import GPT, GPTConfig

    out = []
    for bf16, offload in cases:
        zero = {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_param_persistence_threshold": PERSIST,
        }
        if offload != "none":
            zero["offload_optimizer"] = {"device": "cpu"}
        if offload == "optimizer+params":
            zero["offload_param"] = {"device": "cpu"}
        engine, opt, _, _ = llmpar.initialize(
            model=GPT(GPTConfig(**ODD), seed=0),
            config={
                "train_micro_batch_size_per_gpu": 2,
                "bf16": {"enabled": bf16},
                "zero_optimization": zero,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            },
        )
        x = torch.randint(0, ODD["vocab_size"], (2, ODD["seq_len"] + 1), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            engine.backward(engine.module.loss(engine(x[:, :-1]), x[:, 1:]))
            engine.step()
        mem = opt.memory_bytes()
        out.append({"device": mem["device"], "host": mem["host"], "psi": opt.num_params()})
        del engine, opt
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_memory_matches_zero_optimizer_bytes(stage, world):
    """llmpar.planning.estimate_memory (on the nn.Module) against the bytes ZeroOptimizer holds on each rank, device
    and host, within 5%: stages 0-3, dp 1/2/4, fp32 and bf16 (fp32 master), without offload, with optimizer offload
    and (stage 3) with parameter offload too. The terms that matter here: the fp32 master the host step keeps for
    fp32 params too, and the persistent (small) params stage 3 keeps gathered next to their shards."""
    from llmpar.models import GPT, GPTConfig

    bucket = 5000
    cases = [(b, o) for b, o in MODES if (o == "none" or stage > 0) and (o != "optimizer+params" or stage == 3)]
    model = GPT(GPTConfig(**ODD), seed=0)
    for rank, held in enumerate(run_ranks(_zero_bytes_body, world, stage, cases, bucket, timeout=120)):
        for (bf16, offload), mem in zip(cases, held):
            assert mem["psi"] == sum(p.numel() for p in model.parameters())
            est = estimate_memory(
                model,
                Layout(dp=world, zero_stage=stage, offload=offload),
                precision="fp32_master" if bf16 else "fp32",
                bucket_bytes=bucket * (2 if bf16 else 4),
                persistence_threshold=PERSIST,
            )
            what = (rank, bf16, offload, est.to_dict(), mem)
            assert abs(est.model_states - mem["device"]) <= 0.05 * mem["device"], what
            assert abs(est.cpu - mem["host"]) <= 0.05 * max(mem["host"], 1), what
