"""fp16 with loss scaling: the scale schedule step for step against DeepSpeed's own ``DynamicLossScaler`` (imported
from the installed DeepSpeed: pure Python, no op build), and fp16 training through ``llmpar.initialize`` on CPU/gloo
ranks (float16 model, fp32 masters) against a float32 single-process reference, with overflows injected on one rank
skipped on every rank, the scale lowered by DeepSpeed's hysteresis rule, and the scale state carried by checkpoints.
"""

import random
import types

import pytest
import torch
import torch.distributed as dist
from zero_helpers import GPT_CFG, gpt_batch

import llmpar
from llmpar.models import GPT, GPTConfig
from llmpar.optim import FusedAdamW
from llmpar.zero.loss_scale import LossScaler

from multirank import RankFailure, run_ranks


# ----------------------------------------------------------------------------------------- the schedule itself
def _deepspeed_scaler(monkeypatch, **kw):
    from deepspeed.runtime.fp16 import loss_scaler as ds

    monkeypatch.setattr(ds, "dist", types.SimpleNamespace(get_rank=lambda: 0))  # its log lines ask for the rank
    if kw["loss_scale"]:
        return ds.LossScaler(scale=kw["loss_scale"])
    return ds.DynamicLossScaler(
        init_scale=2 ** kw["initial_scale_power"],
        scale_window=kw["loss_scale_window"],
        min_scale=kw["min_loss_scale"],
        delayed_shift=kw["hysteresis"],
        consecutive_hysteresis=kw["consecutive_hysteresis"],
    )


def _overflows(seed, n):
    """Clean stretches and bursts of overflows (seed 0 dense ... 2 sparse): the scale grows, drops and, in the dense
    runs, reaches its floor (DeepSpeed's fatal error)."""
    rng = random.Random(seed)
    clean = [[0, 1, 2, 3, 5, 8], [1, 2, 3, 5, 8, 13, 21], [3, 5, 8, 13, 21, 34, 55]][seed]
    out = []
    while len(out) < n:
        out += [False] * rng.choice(clean)
        out += [True] * rng.choice([1, 1, 1, 2, 3, 6])
    return out[:n]


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            initial_scale_power=16,
            loss_scale_window=1000,
            hysteresis=2,
            consecutive_hysteresis=False,
            min_loss_scale=1.0,
        ),  # DeepSpeed's defaults
        dict(
            initial_scale_power=6, loss_scale_window=3, hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1.0
        ),
        dict(initial_scale_power=6, loss_scale_window=3, hysteresis=2, consecutive_hysteresis=True, min_loss_scale=1.0),
        dict(
            initial_scale_power=5, loss_scale_window=1, hysteresis=1, consecutive_hysteresis=False, min_loss_scale=0.25
        ),
        dict(initial_scale_power=8, loss_scale_window=4, hysteresis=3, consecutive_hysteresis=True, min_loss_scale=3.0),
        dict(
            initial_scale_power=4, loss_scale_window=2, hysteresis=4, consecutive_hysteresis=False, min_loss_scale=1.0
        ),
        dict(loss_scale=128.0),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_schedule_matches_deepspeed_step_for_step(monkeypatch, kw, seed):
    full = {"loss_scale": 0.0, **kw}
    theirs = _deepspeed_scaler(monkeypatch, **full)
    ours = LossScaler(**full)
    for it, overflow in enumerate(_overflows(seed, 400)):
        try:
            theirs.update_scale(overflow)
            ds_error = None
        except Exception as e:  # noqa: BLE001 - DeepSpeed raises a bare Exception at the minimum
            ds_error = str(e)
        if ds_error is not None:
            with pytest.raises(RuntimeError, match="already at minimum"):
                ours.update(torch.tensor(float(overflow)))
            assert "already at minimum" in ds_error
            return  # DeepSpeed's run ends here
        ours.update(torch.tensor(float(overflow)))
        assert ours.loss_scale == theirs.cur_scale, f"iteration {it}"
        assert ours.cur_iter == theirs.cur_iter if ours.dynamic else True
        if ours.dynamic:
            assert ours.cur_hysteresis == theirs.cur_hysteresis, f"iteration {it}"
            assert ours.last_overflow_iter == theirs.last_overflow_iter, f"iteration {it}"


def test_scaler_state_round_trips_and_bad_settings_raise():
    a = LossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    for flag in (0, 1, 0, 0, 1, 1, 0):
        a.update(torch.tensor(float(flag)))
    b = LossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for flag in (0, 0, 1, 0, 0, 0):
        a.update(torch.tensor(float(flag)))
        b.update(torch.tensor(float(flag)))
        assert a.state_dict() == b.state_dict()
    x = torch.tensor(3.0, dtype=torch.float16)
    assert a.scale_loss(x).dtype == torch.float32  # the scale is never rounded to float16 (2**16 > fp16 max)
    with pytest.raises(ValueError, match="min_loss_scale"):
        LossScaler(min_loss_scale=0.0)
    with pytest.raises(ValueError, match="hysteresis"):
        LossScaler(hysteresis=0)


# ----------------------------------------------------------------------------------------- fp16 training
MICRO, STEPS = 2, 8


def _config(stage, gas=1, **fp16):
    return {
        "train_micro_batch_size_per_gpu": MICRO // gas,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 700,
            "overlap_comm": True,
            **({"offload_optimizer": {"device": "cpu"}} if stage == 2 else {}),
        },
        "fp16": {"enabled": True, **fp16},
    }


def reference(skip=(), steps=STEPS, dtype=torch.float32):
    """The GPT in one process on the whole batch, float32 or float16 params with fp32 masters (no loss scale);
    steps in ``skip`` are skipped (their batch is consumed)."""
    model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=dtype)
    params = list(model.parameters())
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1, precision="fp32" if dtype == torch.float32 else "fp32_master")
    losses = []
    for s in range(steps):
        x, y = gpt_batch(s, MICRO * 2)
        loss = model.loss(model(x), y)
        losses.append(loss.item())
        if s in skip:
            continue
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.3)
        opt.step()
        opt.zero_grad()
    return losses, torch.cat([p.detach().float().flatten() for p in params])


def fp16_body(stage, inject=(), steps=STEPS, gas=1, **fp16):
    """fp16 engine training (``gas`` micro-steps of MICRO / gas rows per rank); at the steps in ``inject`` rank 1's
    loss is blown up (its fp16 grads overflow)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(GPTConfig(**GPT_CFG), seed=1)
    engine, opt, _, _ = llmpar.initialize(model=model, config=_config(stage, gas, **fp16))
    assert next(model.parameters()).dtype == torch.float16 and engine.fp16_enabled()
    losses, seen, micro = [], [], MICRO // gas
    for s in range(steps):
        x, y = gpt_batch(s, MICRO * world)
        before = torch.cat([p.detach().float().flatten() for p in model.parameters()]) if s in inject else None
        t = torch.zeros(1)
        for m in range(gas):
            rows = slice(rank * MICRO + m * micro, rank * MICRO + (m + 1) * micro)
            loss = model.loss(engine(x[rows]), y[rows])
            engine.backward(loss * 1e30 if s in inject and rank == 1 else loss)
            engine.step()
            t += loss.detach().float() / gas
        dist.all_reduce(t)
        losses.append(t.item() / world)
        if before is not None:
            after = torch.cat([p.detach().float().flatten() for p in model.parameters()])
            seen.append((s, torch.equal(before, after), opt.loss_scale, opt.loss_scaler.cur_hysteresis, opt.overflow))
    params = torch.cat([p.detach().float().flatten() for p in model.parameters()]) if stage != 3 else None
    return losses, params, seen, engine.skipped_steps, opt.loss_scale, engine.global_steps


def _drift(params, ref_params):
    """|params - ref| over |ref - init|: how far from the reference the run's total update went (a norm: Adam moves
    an element whose gradient is ~0 by ~lr whatever its sign, so single elements of any two precisions differ)."""
    init = torch.cat([p.detach().flatten() for p in GPT(GPTConfig(**GPT_CFG), seed=1).parameters()])
    return float((params - ref_params).norm() / (ref_params - init).norm())


@pytest.mark.parametrize("stage, gas", [(0, 1), (1, 2), (2, 1), (3, 2)])  # stage 2 with offload_optimizer
def test_fp16_training_matches_fp32_reference(stage, gas):
    """2 ranks of fp16 (loss scale 2**16, fp32 masters) against one float32 process: losses to fp16 accuracy, and the
    params as close as one float16 process with fp32 masters and no loss scale gets (4.4% of the update here)."""
    ref_losses, ref_params = reference()
    _, fp16_params = reference(dtype=torch.float16)
    outs = run_ranks(fp16_body, 2, stage, gas=gas, timeout=120)
    for rank, (losses, params, _, skipped, scale, steps) in enumerate(outs):
        assert skipped == 0 and scale == 2.0**16 and steps == STEPS
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=2e-3, msg=lambda m: f"rank {rank}: {m}"
        )
        if params is not None:
            assert _drift(params, ref_params) < max(0.05, 1.5 * _drift(fp16_params, ref_params))
            assert torch.equal(params, outs[0][1])


def test_overflow_on_one_rank_skips_the_step_everywhere_and_lowers_the_scale():
    """Overflows at steps 2 and 3 on rank 1: both steps skipped on both ranks; hysteresis 2 lets the first keep the
    scale (hysteresis -> 1), the second halves it. The rest of the run equals the reference without those steps."""
    ref_losses, ref_params = reference(skip=(2, 3))
    outs = run_ranks(fp16_body, 2, 1, inject=(2, 3), timeout=120)
    for rank, (losses, params, seen, skipped, scale, steps) in enumerate(outs):
        assert seen == [(2, True, 2.0**16, 1, True), (3, True, 2.0**15, 1, True)], f"rank {rank}"
        assert skipped == 2 and scale == 2.0**15 and steps == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=2e-3)
        assert _drift(params, ref_params) < 0.05


def test_static_loss_scale_stays_and_overflow_still_skips():
    ref_losses, _ = reference(skip=(1,), steps=4)
    outs = run_ranks(fp16_body, 2, 1, inject=(1,), steps=4, loss_scale=512, timeout=120)
    for losses, _, seen, skipped, scale, _ in outs:
        assert seen == [(1, True, 512.0, 2, True)] and skipped == 1 and scale == 512.0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=2e-3)


def at_minimum_body():
    model = GPT(GPTConfig(**GPT_CFG), seed=1)
    engine, _, _, _ = llmpar.initialize(
        model=model, config=_config(1, initial_scale_power=0, hysteresis=1, min_loss_scale=1)
    )
    x, y = gpt_batch(0, MICRO)
    engine.backward(model.loss(engine(x), y) * (1e30 if dist.get_rank() == 0 else 1.0))
    engine.step()


def test_overflow_at_the_minimum_scale_is_deepspeeds_error_on_every_rank():
    with pytest.raises(RankFailure, match="already at minimum") as info:
        run_ranks(at_minimum_body, 2, timeout=60)
    assert "rank 0 traceback" in str(info.value) and "rank 1 traceback" in str(info.value)


def checkpoint_body(root):
    model = GPT(GPTConfig(**GPT_CFG), seed=1)
    cfg = _config(1, initial_scale_power=10, loss_scale_window=2)
    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg)
    rank = dist.get_rank()
    for s in range(5):
        x, y = gpt_batch(s, MICRO * 2)
        loss = model.loss(engine(x[rank * MICRO : (rank + 1) * MICRO]), y[rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss * (1e30 if s == 1 and rank == 0 else 1.0))
        engine.step()
    saved = opt.loss_scaler.state_dict()
    engine.save_checkpoint(root)
    fresh, fresh_opt, _, _ = llmpar.initialize(model=GPT(GPTConfig(**GPT_CFG), seed=2), config=cfg)
    fresh.load_checkpoint(root)
    return saved, fresh_opt.loss_scaler.state_dict(), fresh_opt.skipped_steps


def test_loss_scale_state_is_saved_and_loaded_with_checkpoints(tmp_path):
    for saved, loaded, skipped in run_ranks(checkpoint_body, 2, str(tmp_path), timeout=120):
        assert saved == loaded and skipped == 1
        assert saved["cur_scale"] == 2.0**11 and saved["cur_iter"] == 5 and saved["last_overflow_iter"] == 1
