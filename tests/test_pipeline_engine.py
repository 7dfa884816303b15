"""llmpar.initialize with a "pipeline" block: pp=2 x tp=2 (ZeRO-1, tied embeddings) and pp=2 x dp=2 (ZeRO-2) train
like the plain engine on one process (same config without the pipeline block, dp-concatenated batch, micro_batches
= gradient_accumulation_steps micro-steps) over 20 steps with clipping and a warmup schedule; bad pipeline configs
fail with errors naming the key, on every rank."""

import pytest
import torch

from llmpar.models import GPT, GPTConfig
from llmpar.runtime import Config

from multirank import run_ranks

STEPS, MICRO, T, V = 20, 2, 8, 32


def _model(tie):
    cfg = GPTConfig(vocab_size=V, n_layer=4, n_head=2, d_model=16, seq_len=T, tie_embeddings=tie)
    return GPT(cfg, seed=0, dtype=torch.float64)


def _ds(stage, extra):
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "steps_per_print": 1000,
        **extra,
    }


def _batch(step, dp_rank, rows):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    d = torch.randint(0, V, (rows, T + 1), generator=g)
    return d[:, :-1], d[:, 1:]


def _groups(model):
    """Weight decay 0.1 on matrices, none on vectors: bare params, named by initialize from the model."""
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def _pipe_body(pp, tp, stage, extra, tie, use_iter, groups=False):
    import llmpar

    model = _model(tie)
    engine, _, _, _ = llmpar.initialize(
        model=model, config=_ds(stage, extra), model_parameters=_groups(model) if groups else None
    )
    m = engine.gradient_accumulation_steps()
    dp_rank = engine.mesh["dp"].get_local_rank()
    losses = []
    for s in range(STEPS):
        x, y = _batch(s, dp_rank, MICRO * m)
        if use_iter:
            it = iter(zip(x.split(MICRO), y.split(MICRO)))
            losses.append(float(engine.train_batch(data_iter=it)))
        else:
            losses.append(float(engine.train_batch(x, y)))
    stats = engine.last_stats()
    return losses, engine.bubble_fraction(), stats.peak_in_flight, engine.global_steps, engine.get_lr()


def _plain_body(stage, m, dp, tie, groups=False):
    """The engine without pp, one process: micro-batches of MICRO * dp rows, gradient_accumulation_steps = m."""
    import llmpar

    cfg = _ds(stage, {"gradient_accumulation_steps": m})
    cfg["train_micro_batch_size_per_gpu"] = MICRO * dp
    model = _model(tie)
    engine, _, _, _ = llmpar.initialize(model=model, config=cfg, model_parameters=_groups(model) if groups else None)
    losses = []
    for s in range(STEPS):
        parts = [_batch(s, r, MICRO * m) for r in range(dp)]
        total = 0.0
        for i in range(m):  # micro-batch i: every dp rank's i-th MICRO rows
            x = torch.cat([p[0][i * MICRO : (i + 1) * MICRO] for p in parts])
            y = torch.cat([p[1][i * MICRO : (i + 1) * MICRO] for p in parts])
            loss = GPT.loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / m
        losses.append(total)
    return losses, engine.get_lr()


CASES = {  # (pp, tp, ZeRO stage, extra config, tied, data_iter, param groups)
    "pp2_tp2_zero1_1f1b": (
        2,
        2,
        1,
        {"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 4}, "tensor_parallel": {"size": 2}},
        True,
        False,
        False,
    ),
    "pp2_tp2_zero1_groups": (
        2,
        2,
        1,
        {"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 4}, "tensor_parallel": {"size": 2}},
        True,
        False,
        True,
    ),
    "pp2_dp2_zero2_gpipe": (
        2,
        1,
        2,
        {"pipeline": {"stages": 2, "schedule": "gpipe"}, "gradient_accumulation_steps": 3},
        False,
        True,
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_engine_matches_plain_engine(case):
    pp, tp, stage, extra, tie, use_iter, groups = CASES[case]
    m = extra["pipeline"].get("micro_batches", extra.get("gradient_accumulation_steps"))
    dp = 4 // (pp * tp)
    ref, ref_lr = run_ranks(_plain_body, 1, stage, m, dp, tie, groups, timeout=300)[0]
    outs = run_ranks(_pipe_body, 4, pp, tp, stage, extra, tie, use_iter, groups, timeout=300)
    if groups:  # the groups change the training: the reference without them differs
        plain = run_ranks(_plain_body, 1, stage, m, dp, tie, False, timeout=300)[0][0]
        assert abs(plain[-1] - ref[-1]) > 1e-6
    for rank, (losses, bubble, in_flight, steps, lr) in enumerate(outs):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref), rtol=1e-10, atol=1e-10, msg=lambda s: f"rank {rank}: {s}"
        )
        assert bubble == pytest.approx((pp - 1) / (m + pp - 1))
        assert steps == STEPS and lr == pytest.approx(ref_lr)
        assert 1 <= in_flight <= (pp if extra["pipeline"]["schedule"] == "1f1b" else m)


@pytest.mark.parametrize(
    "block, gas, match",
    [
        ({"stage": 2}, None, 'unknown key "pipeline.stage" \\(did you mean "stages"\\?\\)'),
        ({"stages": 2, "schedule": "zero_bubble"}, None, '"pipeline.schedule": schedule=.zero_bubble. is not one of'),
        ({"stages": 0}, None, '"pipeline.stages"=0 must be >= 1'),
        (
            {"stages": 2, "micro_batches": 4},
            2,
            '"pipeline.micro_batches"=4 and "gradient_accumulation_steps"=2 disagree',
        ),
        ({"stages": 2, "use_reentrant": True}, None, '"pipeline.use_reentrant" is a DeepSpeed key llmpar does not'),
        ({"stages": 2, "partition": "uniform"}, None, '"pipeline.partition"=.uniform. must be "parameters"'),
    ],
)
def test_bad_pipeline_config_names_the_key(block, gas, match):
    cfg = {"train_micro_batch_size_per_gpu": 1, "pipeline": block}
    if gas is not None:
        cfg["gradient_accumulation_steps"] = gas
    with pytest.raises(ValueError, match=match):
        Config.from_deepspeed(cfg, dp=1)


def test_micro_batches_is_gradient_accumulation_steps():
    c = Config.from_deepspeed(
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2}}, dp=2
    )
    assert c.gradient_accumulation_steps == c.pipeline.micro_batches == 4
    c = Config.from_deepspeed(
        {"train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2, "micro_batches": 8}}, dp=1
    )
    assert c.gradient_accumulation_steps == 8 and c.train_batch_size == 16
    with pytest.raises(ValueError, match='unknown key "tensor_parallel.sise" \\(did you mean "size"\\?\\)'):
        Config.from_deepspeed({"tensor_parallel": {"sise": 2}}, dp=1)


def _bad_engine_body():
    import llmpar

    errors = []
    for extra, stage in [
        ({"pipeline": {"stages": 2, "micro_batches": 1}}, 1),  # 1F1B needs m >= pp
        ({"pipeline": {"stages": 2, "micro_batches": 2}}, 3),  # ZeRO-3 inside stages
        ({"pipeline": {"stages": 2, "micro_batches": 2}}, 1),
    ]:  # wrong batch rows below
        try:
            engine, _, _, _ = llmpar.initialize(model=_model(False), config=_ds(stage, extra))
            x, y = _batch(0, 0, 3)
            engine.train_batch(x, y)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_bad_pipeline_engine_fails_on_every_rank():
    for errors in run_ranks(_bad_engine_body, 2, timeout=120):
        assert len(errors) == 3, errors
        assert "micro_batches=1 must be >= pp=2" in errors[0]
        assert '"zero_optimization.stage"=3 is not supported with "pipeline"' in errors[1]
        assert errors[2].startswith("ValueError: train_batch: x has 3 rows; a step takes") and "= 4 rows" in errors[2]
