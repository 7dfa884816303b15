"""llmpar.initialize + Engine on CPU/gloo ranks: tp x dp parity with one process, memory held = the ZeRO formula,
bytes moved = 2 psi, accumulation boundaries, and configs that differ between ranks."""

import pytest
import torch
import torch.distributed as dist
from zero_helpers import GPT_CFG, engine_loop, single_gpt_losses

import llmpar
from llmpar.distributed.collectives import CommCounter
from llmpar.models import GPT, GPTConfig

from multirank import RankFailure, run_ranks


def _ds_config(stage, micro, **extra):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "overlap_comm": True},
        **extra,
    }


def tp_dp_body(stage, tp, micro, steps):
    env = llmpar.init_distributed(tp=tp)
    model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64)
    llmpar.parallelize(model, env.mesh["tp"])
    engine, _, _, _ = llmpar.initialize(model=model, config=_ds_config(stage, micro), mesh=env.mesh)
    return engine_loop(engine, model, steps, micro, env.mesh["dp"])


def _single(steps, n):
    return single_gpt_losses(GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64), steps, n)


@pytest.mark.parametrize("stage", [1, 2])
def test_tp2_dp2_matches_single_process(stage):
    outs = run_ranks(tp_dp_body, 4, stage, 2, 2, 5, timeout=120)
    ref = _single(5, 4)
    for rank, losses in enumerate(outs):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-7, atol=1e-9, msg=f"rank {rank}")


def memory_body(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(301, 257), torch.nn.GELU(), torch.nn.Linear(257, 129))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000},
    }
    counter = CommCounter()
    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg, counter=counter)
    counter.reset()
    x = torch.randn(2, 301, dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return opt.memory_bytes(), opt.num_params(), dict(counter.volume), dict(counter.bytes_sent)


@pytest.mark.parametrize("stage, world", [(1, 2), (2, 2), (1, 4), (2, 4), (0, 2)])
def test_memory_and_communication_equal_the_zero_formulas(stage, world):
    for mem, psi, volume, sent in run_ranks(memory_body, world, stage, timeout=60):
        held = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer_state"]
        n = world if stage > 0 else 1
        formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n}[stage]
        assert abs(held - formula) / formula < 0.05, (stage, world, mem, formula)
        total = sum(v for k, v in volume.items())
        assert abs(total - 2 * psi) / (2 * psi) < 0.01, volume  # 2 psi per step, every stage
        if stage > 0:
            assert set(volume) == {"reduce_scatter", "all_gather", "all_reduce"} and volume["all_reduce"] == 4
            ring = 2 * (world - 1) / world * psi * 2  # bytes sent per rank (bf16)
            assert abs(sum(sent.values()) - ring) / ring < 0.01


def accumulation_body():
    model = torch.nn.Linear(5, 3)
    cfg = {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 2,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.1, "warmup_min_lr": 0.01, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, sched = llmpar.initialize(model=model, config=cfg)
    seen = []
    for _micro in range(9):
        before = model.weight.detach().clone()
        loss = engine(torch.randn(2, 5)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        seen.append((not torch.equal(before, model.weight), engine.global_steps, engine.get_lr()[0]))
    skips = {
        stage: (_skip_run(stage, {(1, 2), (0, 7)}, ()), _skip_run(stage, (), {2, 3, 6, 7})) for stage in (0, 1, 2, 3)
    }
    return engine.gradient_accumulation_steps(), seen, skips


def _skip_run(stage: int, skip_backward, drop) -> tuple:
    """8 micro-steps (gas 2) on 2 ranks; ``(rank, micro)`` in ``skip_backward``: that rank calls step() without
    backward(); a micro in ``drop``: no rank runs it. Returns (params, global / skipped steps, lr, warnings)."""
    import logging

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.1, "warmup_min_lr": 0.01, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = llmpar.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(rank)
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("llmpar").addHandler(handler)
    try:
        for micro in range(8):
            x = torch.randn(2, 5, generator=g, dtype=torch.float64)
            if micro in drop:
                continue
            loss = engine(x).pow(2).mean()
            if (rank, micro) not in skip_backward:
                engine.backward(loss)
            engine.step()
    finally:
        logging.getLogger("llmpar").removeHandler(handler)
    with llmpar.zero.GatheredParameters(list(model.parameters())):
        params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    warned = [r.getMessage() for r in records if "without engine.backward()" in r.getMessage()]
    out = (params, engine.global_steps, engine.skipped_steps, engine.get_lr()[0], warned)
    engine.destroy()
    return out


def test_step_applies_only_at_accumulation_boundaries():
    """And a rank whose step() comes without backward() (rank 1 on a first micro-step, rank 0 on a boundary one):
    every rank runs the same reductions and skips that optimizer step (ZeRO 0-3): the same params and lr as a run
    without those accumulations, the skips counted on every rank, a warning on the rank that skipped."""
    outs = run_ranks(accumulation_body, 2, timeout=120)
    gas, seen, _ = outs[0]
    assert gas == 3
    assert [changed for changed, _, _ in seen] == [False, False, True] * 3
    assert [steps for _, steps, _ in seen] == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert [lr for _, _, lr in seen][2::3] == pytest.approx([0.01, 0.0325, 0.055])  # DeepSpeed's linear warm-up
    for rank, (_, _, skips) in enumerate(outs):
        for stage, (
            (params, steps, skipped, lr, warned),
            (want, want_steps, want_skipped, want_lr, none),
        ) in skips.items():
            assert (steps, skipped, want_steps, want_skipped) == (4, 2, 2, 0), (stage, rank)
            torch.testing.assert_close(params, want, rtol=0, atol=0, msg=f"stage {stage} rank {rank}")
            torch.testing.assert_close(params, outs[0][2][stage][0][0], rtol=0, atol=0)
            assert lr == want_lr and not none, stage
            at = "optimizer step 3, micro step 7" if rank == 0 else "optimizer step 1, micro step 2"
            assert (
                len(warned) == 1
                and f"global rank {rank} without engine.backward() since the last step ({at})" in warned[0]
            ), (stage, rank, warned)


def mismatch_body():
    lr = 1e-3 * (1 + dist.get_rank())
    llmpar.initialize(
        model=torch.nn.Linear(3, 3),
        config={"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": lr}}},
    )


def test_config_mismatch_between_ranks_is_a_clear_error_everywhere():
    with pytest.raises(RankFailure, match="config differs between ranks") as info:
        run_ranks(mismatch_body, 2, timeout=30)
    assert "rank 0 traceback" in str(info.value) and "rank 1 traceback" in str(info.value)


def test_initialize_rejects_optimizer_objects_it_cannot_map():
    """AdamW / Adam objects are mapped onto ZeRO (tests/test_deepspeed_api.py); others name what is supported."""
    model = torch.nn.Linear(3, 3)
    with pytest.raises(TypeError, match="optimizer=SGD: .*torch.optim.AdamW"):
        llmpar.initialize(
            model=model, config={"train_batch_size": 1}, optimizer=torch.optim.SGD(model.parameters(), 0.1)
        )


def tp_block_body(stage, tp, micro, steps):
    """The same run as tp_dp_body, but the config's "tensor_parallel" block does the mesh and the split."""
    model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64)
    engine, _, _, _ = llmpar.initialize(model=model, config=_ds_config(stage, micro, tensor_parallel={"size": tp}))
    assert engine.tp_group is not None and dist.get_world_size(engine.tp_group.get()) == tp
    assert any(getattr(p, "tensor_model_parallel", False) for p in model.parameters())
    assert engine.mesh is not None and engine.mesh["tp"].size() == tp
    return engine_loop(engine, model, steps, micro, engine.mesh["dp"])


def test_tensor_parallel_block_builds_the_mesh_and_splits_the_model():
    outs = run_ranks(tp_block_body, 4, 2, 2, 2, 4, timeout=120)
    ref = _single(4, 4)
    for rank, losses in enumerate(outs):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-7, atol=1e-9, msg=f"rank {rank}")


def one_bad_rank_body(kind, tmpdir):
    """Rank 1 alone gets an invalid config; every rank must report rank 1's own error (no hang, no peer reset)."""
    import os

    good = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    config: object = good
    if dist.get_rank() == 1:
        config = {**good, "zero_optimisation": {"stage": 2}} if kind == "key" else os.path.join(tmpdir, "missing.json")
    mesh = llmpar.init_distributed(tp=2).mesh if kind == "mesh" else None
    if kind == "mesh" and dist.get_rank() == 1:
        config = {**good, "optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}
    try:
        llmpar.initialize(model=torch.nn.Linear(3, 3), config=config, mesh=mesh)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(
    "kind, world, match",
    [
        ("key", 2, 'did you mean "zero_optimization"'),
        ("file", 2, "missing.json cannot be read"),
        ("mesh", 4, "optimizer.params.lr.*finite"),
    ],
)
def test_a_config_invalid_on_one_rank_fails_every_rank_with_its_message(kind, world, match, tmp_path):
    import re

    outs = run_ranks(one_bad_rank_body, world, kind, str(tmp_path), timeout=60)
    for rank, out in enumerate(outs):
        assert out is not None, f"rank {rank} did not fail"
        assert out[0] in ("ValueError", "TypeError") and re.search(match, out[1]), (rank, out)
        if rank != 1:
            assert "rank 1 failed" in out[1], (rank, out)


def different_seeds_body(stage):
    """Every rank builds the GPT with its own seed: initialize must start all of them from dp rank 0's params."""
    model = GPT(GPTConfig(**GPT_CFG), seed=1 + 100 * dist.get_rank(), dtype=torch.float64)
    cfg = _ds_config(stage, 2)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    mesh = llmpar.init_distributed(tp=1).mesh
    engine, _, _, _ = llmpar.initialize(model=model, config=cfg, mesh=mesh)
    return engine_loop(engine, model, 3, 2, mesh["dp"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_built_with_different_seeds_start_from_rank0(stage):
    outs = run_ranks(different_seeds_body, 2, stage, timeout=120)
    ref = single_gpt_losses(GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64), 3, 4)
    for rank, losses in enumerate(outs):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-7, atol=1e-9, msg=f"rank {rank}")


def test_bare_model_parameters_keep_the_models_names():
    model = GPT(GPTConfig(**{**GPT_CFG, "tie_embeddings": True}), seed=1, dtype=torch.float64)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    for given in (model.parameters(), groups):
        _, opt, _, _ = llmpar.initialize(model=model, config={"train_batch_size": 1}, model_parameters=given)
        names = [n for g in opt.param_groups for n in g["names"]]
        first = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), n)
        assert sorted(names) == sorted(first.values()), names  # the tied weight once, under its first name
        assert not any(n.startswith("group") for n in names)
