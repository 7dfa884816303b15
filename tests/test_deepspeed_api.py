"""DeepSpeed's documented API as scripts call it with ``import llmpar as deepspeed`` (issue 17, items 2, 3 and 6), one
test per entry, in this process (a world of one). The 2-rank entries (sampler semantics, no_sync, comm, zero_to_fp32,
GatheredParameters) are in ``test_deepspeed_api_ranks.py``, with a DeepSpeed script run under torchrun by DeepSpeed
and by llmpar side by side."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import warnings

import pytest
import torch
from torch import nn

import llmpar
import llmpar as deepspeed


def _net(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _cfg(stage=2, **extra):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        **extra,
    }


def _x(step, dtype=torch.float64):
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(step), dtype=dtype)


def _run(engine, steps, start=0):
    for s in range(start, start + steps):
        engine.backward(engine(_x(s, next(engine.module.parameters()).dtype)).pow(2).mean())
        engine.step()


def _groups(m):
    return [
        {"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
        {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0},
    ]


# ------------------------------------------------------------------------------------------ launch and args
def test_add_config_arguments_adds_deepspeeds_flags():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json" and args.deepscale_config is None
    with pytest.raises(TypeError, match="ArgumentParser"):
        deepspeed.add_config_arguments(None)


def test_initialize_reads_args_deepspeed_config_and_local_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "")  # recorded, so monkeypatch unsets it again after the test
    monkeypatch.delenv("LOCAL_RANK")  # initialize sets it from args.local_rank below
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg(1, gradient_clipping=0.5)))
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    model = _net()
    engine, opt, loader, sched = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.gradient_clipping() == 0.5 and engine.zero_optimization_stage() == 1
    assert args.local_rank == engine.local_rank == int(os.environ.get("LOCAL_RANK", 0))
    assert loader is None and sched is None and opt is engine.optimizer
    engine2, *_ = deepspeed.initialize(args, _net(), None, None)  # DeepSpeed's positional order
    assert engine2.zero_optimization_stage() == 1
    with pytest.raises(ValueError, match="given twice"):
        deepspeed.initialize(args=args, model=_net(), config=_cfg())
    with pytest.raises(ValueError, match="needs a DeepSpeed config"):
        deepspeed.initialize(args=argparse.Namespace(deepspeed_config=None), model=_net())
    legacy = argparse.Namespace(deepscale_config=str(path))
    assert deepspeed.initialize(args=legacy, model=_net())[0].zero_optimization_stage() == 1
    assert deepspeed.initialize(model=_net(), config_params=_cfg(3))[0].zero_optimization_stage() == 3


def test_local_rank_argument_must_match_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"args.local_rank=1 but the environment has LOCAL_RANK=0"):
        deepspeed.initialize(args=argparse.Namespace(local_rank=1), model=_net(), config=_cfg())


def test_local_rank_argument_stands_in_for_a_missing_environment(monkeypatch):
    """DeepSpeed's launcher passes --local_rank; a launcher that sets no LOCAL_RANK gets it from there."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        engine, *_ = deepspeed.initialize(args=argparse.Namespace(local_rank=0), model=_net(), config=_cfg())
        assert os.environ["LOCAL_RANK"] == "0" and engine.local_rank == 0
    finally:
        os.environ.pop("LOCAL_RANK", None)


def test_initialize_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="mpu=.*dp_group=mpu.get_data_parallel_group"):
        deepspeed.initialize(model=_net(), config=_cfg(), mpu=object())
    with pytest.raises(ValueError, match="mesh_param=.*mesh="):
        deepspeed.initialize(model=_net(), config=_cfg(), mesh_param=(2, 1))
    engine, *_ = deepspeed.initialize(model=_net(), config=_cfg(), dist_init_required=False, distributed_port=1234)
    assert engine.world_size == 1


def test_init_distributed_takes_deepspeeds_arguments():
    env = deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60), verbose=False)
    assert env.world_size == deepspeed.comm.get_world_size() and env.backend == "gloo"
    assert llmpar.init_distributed(tp=1).mesh is not None  # llmpar's keywords still work
    with pytest.raises(ValueError, match="disagree"):
        deepspeed.init_distributed(dist_backend="gloo", backend="nccl")


# ------------------------------------------------------------------------------------------- the engine
def test_ranks_device_and_config_accessors():
    engine, *_ = deepspeed.initialize(
        model=_net(), config=_cfg(3, gradient_clipping=0.7, steps_per_print=5, gradient_accumulation_steps=2)
    )
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 0, 1, 1)
    assert engine.mp_world_size == 1 and engine.device == torch.device("cpu")
    assert engine.gradient_clipping() == 0.7 and engine.steps_per_print() == 5
    assert engine.zero_optimization() and engine.zero_optimization_stage() == 3
    assert engine.zero_optimization_partition_gradients() and engine.zero_optimization_partition_weights()
    assert engine.zero_offload_optimizer() is None and engine.zero_offload_param() is None
    assert not engine.zero_cpu_offload()
    assert engine.get_batch_info() == (8, 4, 2) and engine.train_batch_size() == 8
    assert not engine.bfloat16_enabled() and not engine.fp16_enabled() and not engine.amp_enabled()
    assert engine.get_data_types() == (torch.float64, torch.float64)
    assert engine.optimizer_name() == "AdamW" and engine.get_mom() == [(0.9, 0.999)]
    assert engine.monitor.enabled is False and engine.monitor.write_events([("loss", 1.0, 1)]) is None
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    stage1, *_ = deepspeed.initialize(model=_net(), config=_cfg(1))
    assert not stage1.zero_optimization_partition_gradients() and not stage1.zero_optimization_partition_weights()


def test_bf16_data_types_and_fp16_flag():
    engine, *_ = deepspeed.initialize(
        model=_net(dtype=torch.float32), config=_cfg(2, gradient_accumulation_steps=2, bf16={"enabled": True})
    )
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)  # fp32 accumulation of bf16 grads


def test_was_step_applied_and_global_grad_norm():
    model, ref = _net(), _net()
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(2, gradient_accumulation_steps=2))
    assert engine.get_global_grad_norm() is None and engine.was_step_applied() is False
    flags, norms, want = [], [], []
    for s in range(4):
        engine.backward(engine(_x(s)).pow(2).mean())
        ref_loss = ref(_x(s)).pow(2).mean() / 2
        ref_loss.backward()
        engine.step()
        flags.append(engine.was_step_applied())
        if s % 2 == 1:
            want.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item())
            norms.append(engine.get_global_grad_norm())
            ref.zero_grad()
            ref.load_state_dict(model.state_dict())
    assert flags == [False, True, False, True]
    assert norms == pytest.approx(want, rel=1e-12)
    engine.backward(engine(_x(9)).sum() * float("inf"))  # a non-finite step is skipped
    engine.step()
    engine.backward(engine(_x(9)).sum())
    engine.step()
    assert engine.was_step_applied() is False and engine.skipped_steps == 1


def test_backward_retain_graph_and_scale_wrt_gas():
    model, ref = _net(), _net()
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(1, gradient_accumulation_steps=2))
    loss = engine(_x(0)).pow(2).mean()
    assert engine.backward(loss, retain_graph=True).item() == pytest.approx(loss.item() / 2)
    engine.step()
    assert engine.backward(loss, scale_wrt_gas=False).item() == pytest.approx(loss.item())  # the same graph again
    engine.step()
    rl = ref(_x(0)).pow(2).mean()
    (rl * 1.5).backward()  # 1/2 + 1
    torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0).step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_set_gradient_accumulation_boundary(stage):
    """gas=1 in the config, the boundary set by hand: three micro-steps, one optimizer step (DeepSpeed's example)."""
    model, ref = _net(), _net()
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(stage))
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    for s, boundary in enumerate([False, False, True]):
        engine.set_gradient_accumulation_boundary(boundary)
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(_x(s)).pow(2).mean())
        engine.step()
        if not boundary:
            assert engine.was_step_applied() is False
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert seen == [False, False, True] and engine.was_step_applied() and engine.global_steps == 1
    sum(ref(_x(s)).pow(2).mean() for s in range(3)).backward()
    torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0).step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="bool"):
        engine.set_gradient_accumulation_boundary(1)


def test_no_sync_single_rank_and_its_errors():
    engine, *_ = deepspeed.initialize(model=_net(), config=_cfg(1))
    with engine.no_sync():
        engine.backward(engine(_x(0)).pow(2).mean())
        with pytest.raises(RuntimeError, match="inside engine.no_sync"):
            engine.step()
        with pytest.raises(RuntimeError, match="entered again"):
            with engine.no_sync():
                pass
    engine.backward(engine(_x(1)).pow(2).mean())
    engine.step()
    assert engine.was_step_applied()
    stage2, *_ = deepspeed.initialize(model=_net(), config=_cfg(2))
    with pytest.raises(RuntimeError, match="incompatible with ZeRO stage 2.*gradient_accumulation_steps"):
        with stage2.no_sync():
            pass


def test_training_dataloader_and_deepspeed_io():
    data = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    engine, _, loader, _ = deepspeed.initialize(model=_net(dtype=torch.float32), config=_cfg(), training_data=data)
    assert loader is engine.training_dataloader and len(loader) == 3
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)  # DeepSpeed's: shuffled, seed 0
    assert torch.cat([y for _, y in loader]).tolist() == list(sampler)
    assert loader.data_sampler is loader.sampler
    ordered = engine.deepspeed_io(data, batch_size=5, route="eval")
    assert [y.tolist() for _, y in ordered] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="route"):
        engine.deepspeed_io(data, route="test")


# ------------------------------------------------------------------------- client optimizer and scheduler
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_client_adamw_and_lr_scheduler_follow_torch(stage):
    model, ref = _net(), _net()
    opt = torch.optim.AdamW(_groups(model), lr=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 5)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.01, betas=(0.9, 0.95))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: (s + 1) / 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch scheduler-order warning from the engine
        engine, zero_opt, _, returned = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=_cfg(stage)
        )
        assert returned is sched and zero_opt is engine.optimizer and len(zero_opt.param_groups) == 2
        for s in range(4):
            _run(engine, 1, s)
            ref(_x(s)).pow(2).mean().backward()
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()
            assert engine.get_lr() == pytest.approx(ref_sched.get_last_lr())
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert engine.optimizer_name() == "AdamW" and engine.get_mom() == [(0.9, 0.95)] * 2


def test_client_optimizer_kinds():
    m = _net()
    e, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.02), config=_cfg())
    assert e.get_lr() == [0.02] and e.optimizer_name() == "Adam"
    m = _net()
    e, *_ = deepspeed.initialize(
        model=m,
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.03),
        model_parameters=m.parameters(),
        config=_cfg(),
    )
    assert e.get_lr() == [0.03]
    m = _net()
    e, *_ = deepspeed.initialize(
        model=m, optimizer=deepspeed.ops.adam.FusedAdam(m.parameters(), lr=0.04), config=_cfg()
    )
    assert e.get_lr() == [0.04]
    m = _net()
    offload = _cfg(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    e, *_ = deepspeed.initialize(
        model=m, optimizer=deepspeed.ops.adam.DeepSpeedCPUAdam(m.parameters(), lr=0.05), config=offload
    )
    _run(e, 1)
    assert e.get_lr() == [0.05] and e.zero_cpu_offload() and e.zero_offload_optimizer().device == "cpu"
    with pytest.raises(ValueError, match='"gradient_clipping"'):
        deepspeed.initialize(
            model=m, optimizer=llmpar.optim.FusedAdamW(m.parameters(), max_grad_norm=1.0), config=_cfg()
        )
    with pytest.raises(ValueError, match="L2 regularisation.*AdamW"):
        deepspeed.initialize(model=m, optimizer=torch.optim.Adam(m.parameters(), weight_decay=0.1), config=_cfg())
    with pytest.raises(TypeError, match="optimizer=SGD.*torch.optim.AdamW"):
        deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=_cfg())
    with pytest.raises(ValueError, match="amsgrad=True"):
        deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), amsgrad=True), config=_cfg())
    m = _net()  # not given to an engine yet: its grads stay on the params
    stepped = torch.optim.AdamW(m.parameters())
    m(_x(0)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="has state"):
        deepspeed.initialize(model=m, optimizer=stepped, config=_cfg())


def test_client_optimizer_replaces_the_config_block(caplog):
    m = _net()
    cfg = _cfg(optimizer={"type": "AdamW", "params": {"lr": 0.5}}, scheduler={"type": "WarmupLR", "params": {}})
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="llmpar"):
        e, *_, sched = deepspeed.initialize(
            model=m, optimizer=opt, config=cfg, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        )
    assert 'replaces the config\'s "optimizer"' in caplog.text and 'replaces the config\'s "scheduler"' in caplog.text
    _run(e, 2)
    assert e.get_lr() == pytest.approx([0.0025])


def test_callable_scheduler_on_the_config_optimizer_and_refusals():
    m = _net()
    cfg = _cfg(optimizer={"type": "AdamW", "params": {"lr": 0.1}})
    e, *_, sched = deepspeed.initialize(
        model=m, config=cfg, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)
    )
    _run(e, 2)
    assert e.get_lr() == pytest.approx([0.001]) and sched.get_last_lr() == pytest.approx([0.001])
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        deepspeed.initialize(
            model=m, config=_cfg(), optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        )
    with pytest.raises(ValueError, match="needs optimizer="):
        deepspeed.initialize(model=m, config=_cfg(), lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    other = torch.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match="another optimizer"):
        deepspeed.initialize(
            model=m, config=_cfg(), optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1)
        )


# ----------------------------------------------------------------------------------------- checkpoints
def test_save_checkpoint_deepspeed_options(tmp_path):
    model = _net()
    model[0].bias.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(1))
    _run(engine, 1)
    engine.save_checkpoint(tmp_path, client_state={"k": 1})
    engine.save_checkpoint(tmp_path, tag="side", save_latest=False, exclude_frozen_parameters=True)
    assert (tmp_path / "latest").read_text().strip() == "global_step1"
    side = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="side")
    full = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert "0.bias" not in side and "0.bias" in full
    fresh, *_ = deepspeed.initialize(model=_net(1), config=_cfg(1))
    with pytest.raises(Exception, match="0.bias"):
        fresh.load_checkpoint(tmp_path, tag="side")
    fresh.load_checkpoint(tmp_path, tag="side", load_module_strict=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert fresh.load_checkpoint(empty) == (None, None)  # DeepSpeed's answer when there is no 'latest'
    with pytest.raises(ValueError, match="async"):
        engine.save_checkpoint(tmp_path, save_latest=False, async_save=True)


def test_load_checkpoint_deepspeed_options(tmp_path):
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}}
    engine, opt, *_ = deepspeed.initialize(model=_net(), config=_cfg(2, scheduler=sched))
    _run(engine, 2)
    engine.save_checkpoint(tmp_path, client_state={"pos": 2})
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    _run(engine, 2, 2)

    def moments():
        return [t.clone() for b in opt.buffers for k, t in sorted(b.state.items()) if k != "master"]

    now, lr, steps = moments(), engine.get_lr(), engine.global_steps
    path, client = engine.load_checkpoint(tmp_path, load_optimizer_states=False, load_lr_scheduler_states=False)
    assert client == {"pos": 2} and path.endswith("global_step2") and engine.global_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(moments(), now)) and engine.get_lr() == lr
    assert all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())
    _run(engine, 2, 4)
    now, lr, steps = moments(), engine.get_lr(), engine.global_steps
    engine.load_checkpoint(tmp_path, load_module_only=True)
    assert engine.global_steps == steps and engine.get_lr() == lr
    assert all(torch.equal(a, b) for a, b in zip(moments(), now))
    assert all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == 2 and not all(torch.equal(a, b) for a, b in zip(moments(), now))
    with pytest.raises(ValueError, match="custom_load_fn"):
        engine.load_checkpoint(tmp_path, custom_load_fn=print)


def test_client_scheduler_state_travels_with_the_checkpoint(tmp_path):
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(
        model=m, config=_cfg(), optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    )
    _run(engine, 2)
    engine.save_checkpoint(tmp_path)
    m2 = _net()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    fresh, *_ = deepspeed.initialize(model=m2, config=_cfg(), optimizer=opt2, lr_scheduler=sched2)
    fresh.load_checkpoint(tmp_path)
    assert fresh.get_lr() == pytest.approx([0.025]) and sched2.last_epoch == 2
    _run(fresh, 1)
    assert fresh.get_lr() == pytest.approx([0.0125]) and opt2.param_groups[0]["lr"] == pytest.approx(0.0125)


# ---------------------------------------------------------------------------------- module-level names
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpointing_checkpoint_recomputes_with_the_same_gradients(stage):
    class Net(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.blocks = (
                nn.Linear(4, 8),
                nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)) for _ in range(2)),
            )
            self.out, self.ckpt = nn.Linear(8, 2), ckpt

        def forward(self, x):
            h = self.inp(x)  # the first checkpoint's input requires grad; the data does not
            for b in self.blocks:
                h = deepspeed.checkpointing.checkpoint(b, h) if self.ckpt else b(h)
            return self.out(h)

    results = []
    for ckpt in (False, True):
        model = Net(ckpt).double()
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}  # stage 3: every unit gathered for use
        engine, *_ = deepspeed.initialize(model=model, config=_cfg(stage, zero_optimization=zero))
        torch.manual_seed(5)  # the same dropout masks (the recompute restores the RNG state)
        _run(engine, 2)
        results.append(engine.module_state_dict())  # (a stage-3 param holds no storage outside its use)
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-12, atol=1e-14)
    x = torch.randn(3, 8, dtype=torch.float64)  # no input needs grad: the params inside still get theirs
    lin = nn.Linear(8, 8).double()
    deepspeed.checkpointing.checkpoint(lin, x).sum().backward()
    assert lin.weight.grad is not None


def test_checkpointing_configure_and_is_configured(tmp_path):
    assert deepspeed.checkpointing.is_configured()
    deepspeed.checkpointing.configure(
        None, contiguous_checkpointing=True, num_checkpoints=4, synchronize=True, profile=True
    )
    deepspeed.checkpointing.reset()
    with pytest.raises(ValueError, match='partition_activations.*"activation_checkpointing"'):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": True}}))
    with pytest.raises(ValueError, match="save_on_cpu"):
        deepspeed.checkpointing.configure(None, deepspeed_config=str(path))
    with pytest.raises(NotImplementedError, match="torch.manual_seed"):
        deepspeed.checkpointing.model_parallel_cuda_manual_seed(1)
    with pytest.raises(NotImplementedError):
        deepspeed.checkpointing.get_cuda_rng_tracker()


def test_ops_adam_fused_adam_and_cpu_adam_are_adamw():
    from llmpar.ops.adam import DeepSpeedCPUAdam, FusedAdam

    for cls in (FusedAdam, DeepSpeedCPUAdam):
        ours, ref = _net(dtype=torch.float32), _net(dtype=torch.float32)
        opt = cls(ours.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
        for s in range(3):
            for m, o in ((ours, opt), (ref, ref_opt)):
                m(_x(s, torch.float32)).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        for a, b in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert FusedAdam(_net().parameters(), adam_w_mode=False).param_groups[0]["weight_decay"] == 0.0  # same math
    with pytest.raises(ValueError, match="L2 mode"):
        FusedAdam(_net().parameters(), adam_w_mode=False, weight_decay=0.1)
    with pytest.raises(ValueError, match="bias_correction"):
        DeepSpeedCPUAdam(_net().parameters(), bias_correction=False)
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam(_net().parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="fp32_optimizer_states"):
        DeepSpeedCPUAdam(_net(dtype=torch.bfloat16).parameters(), fp32_optimizer_states=False)


def test_ops_adam_is_an_attribute_after_initialize():
    import importlib
    import sys

    code = (
        "import llmpar as deepspeed, torch\n"
        "deepspeed.initialize(model=torch.nn.Linear(2, 2), config={'train_micro_batch_size_per_gpu': 1})\n"
        "print(deepspeed.ops.adam.FusedAdam.__name__, deepspeed.ops.adam.DeepSpeedCPUAdam.__name__)\n"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("FusedAdam DeepSpeedCPUAdam")
    assert importlib.import_module("llmpar.ops.adam").FusedAdam is deepspeed.ops.adam.FusedAdam


def test_utils_log_dist(caplog):
    with caplog.at_level(logging.INFO, logger="llmpar"):
        deepspeed.utils.log_dist("hello", ranks=[0])
        deepspeed.utils.log_dist("not me", ranks=[1])
        deepspeed.utils.log_dist("everyone", ranks=[-1], level=logging.WARNING)
    assert "[Rank 0] hello" in caplog.text and "not me" not in caplog.text
    assert any(r.levelno == logging.WARNING and "[Rank 0] everyone" in r.message for r in caplog.records)
    assert deepspeed.utils.logger is logging.getLogger("llmpar")
    with pytest.raises(NotImplementedError, match="GatheredParameters"):
        deepspeed.utils.safe_get_full_fp32_param(torch.zeros(1))


def test_zero_init_takes_deepspeeds_arguments():
    with deepspeed.zero.Init(config_dict_or_path=_cfg(3), remote_device="cpu", pin_memory=True, dtype=torch.float32):
        meta = nn.Linear(3, 3)
    with deepspeed.zero.Init(enabled=False):
        real = nn.Linear(3, 3)
    assert meta.weight.is_meta and not real.weight.is_meta
    engine, *_ = deepspeed.initialize(model=meta, config=_cfg(3))
    assert not meta.weight.is_meta and engine.zero_optimization_partition_weights()
    with pytest.raises(ValueError, match='module=.*"zero_optimization.stage": 3'):
        deepspeed.zero.Init(module=real)
    with pytest.raises(ValueError, match="dp_group= / mesh="):
        deepspeed.zero.Init(data_parallel_group=object())
    with pytest.raises(ValueError, match="NVMe|CPU offload"):
        deepspeed.zero.Init(remote_device="nvme")


def test_gathered_parameters_without_the_optimizer():
    plain = _net()
    w = plain[0].weight
    with deepspeed.zero.GatheredParameters(w, modifier_rank=0):  # no engine holds it: a no-op (DeepSpeed's rule)
        w.data.mul_(2)
    with deepspeed.zero.Init():
        meta = _net()
    with pytest.raises(ValueError, match="meta device"):
        with deepspeed.zero.GatheredParameters(meta[0].weight, modifier_rank=0):
            pass
    engine, *_ = deepspeed.initialize(model=meta, config=_cfg(3))
    with deepspeed.zero.GatheredParameters(list(meta.parameters()), modifier_rank=0):
        meta[0].weight.fill_(0.5)
    state = engine.module_state_dict()
    assert torch.all(state["0.weight"] == 0.5)
    with deepspeed.zero.GatheredParameters(meta[0].weight, engine.optimizer):  # llmpar's form still works
        assert meta[0].weight.shape == (8, 4)
    with pytest.raises(ValueError, match="fwd_module"):
        with deepspeed.zero.GatheredParameters(meta[0].weight, modifier_rank=0, fwd_module=meta):
            pass
    with pytest.raises(NotImplementedError, match="tie it"):
        deepspeed.zero.register_external_parameter(meta, meta[0].weight)


def test_save_16bit_model(tmp_path):
    model = _net()
    model[2].bias.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(2))
    assert engine.save_16bit_model(tmp_path, "all.bin")
    assert engine.save_fp16_model(tmp_path, "some.bin", exclude_frozen_parameters=True)
    full, some = torch.load(tmp_path / "all.bin"), torch.load(tmp_path / "some.bin")
    assert set(full) - set(some) == {"2.bias"} and torch.equal(full["0.weight"], model[0].weight)
    stage3, *_ = deepspeed.initialize(model=_net(), config=_cfg(3))
    assert stage3.save_16bit_model(tmp_path) is False  # DeepSpeed's answer without the stage-3 gather flag
