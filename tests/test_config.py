"""The DeepSpeed config as llmpar reads it: batch-size arithmetic, clear errors, DeepSpeed's lr schedules exactly."""

import json
import os

import pytest
import torch

from llmpar.runtime import Blocks, Config
from llmpar.runtime.blocks import scheduler_block
from llmpar.runtime.schedules import WarmupSchedule


@pytest.mark.parametrize(
    "given, want",
    [
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), (4, 4, 32)),
        (dict(train_batch_size=32, gradient_accumulation_steps=2), (8, 2, 32)),
        (dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=5), (3, 5, 30)),
        (dict(train_batch_size=6), (3, 1, 6)),
        (dict(train_micro_batch_size_per_gpu=7), (7, 1, 14)),
        (dict(train_batch_size=12, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2), (3, 2, 12)),
    ],
)
def test_batch_sizes_are_inferred_as_deepspeed_does(given, want):
    c = Config.from_deepspeed(given, dp=2)
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.train_batch_size) == want


@pytest.mark.parametrize(
    "given, match",
    [
        (dict(train_batch_size=12, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=3), "inconsistent"),
        (dict(train_batch_size=10, train_micro_batch_size_per_gpu=3), "inconsistent"),
        (dict(gradient_accumulation_steps=2), "train_micro_batch_size_per_gpu"),
        (dict(train_batch_size=0), ">= 1"),
        (dict(train_batch_size=8, gradient_clipping=-1), "gradient_clipping"),
        (
            dict(train_batch_size=8, zero_optimization={"stage": 2, "reduce_bucket_sise": 5}),
            'did you mean "reduce_bucket_size"',
        ),
        (dict(train_batch_size=8, gradient_acumulation_steps=2), 'did you mean "gradient_accumulation_steps"'),
        (dict(train_batch_size=8, zero_optimization={"stage": 4}), "must be 0, 1, 2 or 3"),
        (
            dict(train_batch_size=8, zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}),
            "offload_optimizer.*needs stage 1, 2 or 3",
        ),
        (
            dict(train_batch_size=8, zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
            "offload_param.*needs stage 3",
        ),
        (dict(train_batch_size=8, zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}), "NVMe"),
        (
            dict(train_batch_size=8, zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}}),
            "partial offload is not supported",
        ),
        (
            dict(train_batch_size=8, zero_optimization={"stage": 3, "stage3_prefetch_bucket_siz": 5}),
            'did you mean "stage3_prefetch_bucket_size"',
        ),
        (dict(train_batch_size=8, fp16={"enabled": True}, bf16={"enabled": True}), "both true: pick one precision"),
        (dict(train_batch_size=8, fp16={"enabled": True, "auto_cast": True}), '"fp16.auto_cast"=true: not supported'),
        (dict(train_batch_size=8, prescale_gradients=True), '"prescale_gradients"=true: not supported'),
        (
            dict(train_batch_size=8, tensorboard={"enabled": True, "output_path": 3}),
            '"tensorboard.output_path"=3 must be a string',
        ),
        (
            dict(train_batch_size=8, zero_optimization={"stage": 2, "round_robin_gradients": True}),
            '"zero_optimization.round_robin_gradients"=true: not supported',
        ),
        (dict(train_batch_size=8, optimizer={"type": "Lamb", "params": {}}), "does not support"),
        (dict(train_batch_size=8, optimizer={"type": "AdamX"}), "is not known"),
        (dict(train_batch_size=8, optimizer={"type": "AdamW", "params": {"betas": [0.9, 1.5]}}), "betas"),
        (dict(train_batch_size=8, optimizer={"type": "AdamW", "params": {"lrr": 1}}), 'did you mean "lr"'),
        (
            dict(train_batch_size=8, scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}),
            "total_num_steps.*required",
        ),
        (dict(train_batch_size=8, scheduler={"type": "OneCycle"}), "does not support"),
        (dict(train_batch_size=8, scheduler={"type": "WarmupLR", "params": {"total_num_steps": 5}}), "unknown key"),
        (dict(train_batch_size=8, zero_optimization={"stage": 2, "overlap_comm": "yes"}), "true or false"),
        (dict(train_batch_size=8, zero_optimization={"stage": 1.5}), "must be an integer"),
        (
            dict(train_batch_size=8, checkpoint={"auto_resum": "/ckpt"}),
            'unknown key "checkpoint.auto_resum" \\(did you mean "auto_resume"\\?\\)',
        ),
        (dict(train_batch_size=8, checkpoint={"auto_resume_interval": 5}), '"checkpoint.auto_resume_interval"=5 needs'),
        (dict(train_batch_size=8, checkpoint={"load_universal": 1}), '"checkpoint.load_universal"=1: a bool'),
    ],
)
def test_bad_configs_name_the_key(given, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Config.from_deepspeed(given, dp=2)


def test_full_config_parses_and_defaults(tmp_path):
    raw = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 1000}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": True},
        "bf16": {"enabled": True},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    c = Config.from_deepspeed(os.fspath(path), dp=4)
    assert c.train_batch_size == 64 and c.bf16 and c.optimizer.type == "AdamW" and c.optimizer.lr == 3e-4
    assert c.zero.stage == 2 and c.zero.reduce_bucket_size == 50_000_000 and c.zero.overlap_comm
    assert c.scheduler.warmup_max_lr == 0.001  # DeepSpeed's WarmupDecayLR default, not the optimizer's lr
    d = Config.from_deepspeed({"train_batch_size": 4}, dp=1)
    assert d.optimizer.type == "AdamW" and d.optimizer.lr == 1e-3 and d.zero.stage == 0 and not d.optimizer_given


def test_the_blocks_read_after_initialize_are_typed_at_parse():
    """The blocks the engines act on later (monitors, checkpoint, optimizer params as given, which blocks were
    named) are typed once, by the parser: nothing outside runtime/config.py reads the raw dict
    (tests/test_architecture.py::test_only_the_config_reads_the_raw_json)."""
    from llmpar.runtime.blocks import ContextParallelConfig, refuse_cp_with_pipeline
    from llmpar.runtime.resume import CheckpointConfig

    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "checkpoint": {
            "load_universal": True,
            "auto_resume": "/ckpt",
            "auto_resume_interval": 3,
            "tag_validation": "Warn",
        },
        "csv_monitor": {"enabled": True, "output_path": "logs", "job_name": "run"},
        "tensor_parallel": {"size": 1},
        "pipeline": {"stages": 1, "schedule": "gpipe"},
    }
    c = Config.from_deepspeed(raw, dp=1)
    assert c.checkpoint == CheckpointConfig(load_universal=True, auto_resume="/ckpt", auto_resume_interval=3)
    assert c.monitor.enabled and (c.monitor.csv_monitor.output_path, c.monitor.csv_monitor.job_name) == ("logs", "run")
    assert not c.monitor.tensorboard.enabled and not c.monitor.wandb.enabled
    assert c.optimizer_params == {"lr": 1e-3, "torch_adam": True}  # DeepSpeed's engine.optimizer_params(): as given
    assert c.tensor_parallel_given and c.pipeline.schedule_given and c.pipeline.schedule == "gpipe"
    bare = Config.from_deepspeed({"train_batch_size": 2, "pipeline": {"stages": 1}}, dp=1)
    assert bare.checkpoint == CheckpointConfig() and not bare.monitor.enabled and bare.optimizer_params == {}
    assert not bare.tensor_parallel_given and not bare.pipeline.schedule_given
    assert c.fingerprint() == Blocks.parse(raw).fingerprint()
    # the degrees of a config whose other blocks still hold "auto" (the integrations ask before filling them)
    par = Blocks.parallel_of({**raw, "train_micro_batch_size_per_gpu": "auto", "sequence_parallel_size": 1})
    assert (par.pipeline.stages, par.tensor_parallel.size, par.context_parallel.size) == (1, 1, 1)
    with pytest.raises(ValueError, match='"context_parallel.size"=2 .* with a PipelineModule: context parallelism'):
        refuse_cp_with_pipeline(ContextParallelConfig(size=2), "a PipelineModule")


class _Opt:
    def __init__(self, lrs):
        self.param_groups = [{"lr": lr} for lr in lrs]


@pytest.mark.parametrize(
    "typ, params",
    [
        ("WarmupLR", {"warmup_num_steps": 7}),
        ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 10, "warmup_type": "linear"}),
        ("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 30}),
        (
            "WarmupDecayLR",
            {
                "warmup_min_lr": 1e-5,
                "warmup_max_lr": 2e-3,
                "warmup_num_steps": 1,
                "total_num_steps": 20,
                "warmup_type": "linear",
            },
        ),
        ("WarmupCosineLR", {"warmup_num_steps": 6, "total_num_steps": 25}),
        (
            "WarmupCosineLR",
            {
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.05,
                "warmup_num_steps": 4,
                "total_num_steps": 12,
                "warmup_type": "linear",
            },
        ),
    ],
)
def test_schedules_equal_deepspeeds(typ, params):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ds_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))], lr=3e-3)
    ds_opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "lr": 1e-3})
    ds = getattr(lr_schedules, typ)(ds_opt, **params)
    ours_opt = _Opt([3e-3, 1e-3])
    ours = WarmupSchedule(ours_opt, scheduler_block({"type": typ, "params": params}))
    for step in range(40):
        want = [g["lr"] for g in ds_opt.param_groups]
        got = [g["lr"] for g in ours_opt.param_groups]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), f"step {step}"
        ds.step()
        ours.step()


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "ds_bad.json"
    bad.write_text('{"train_batch_size": 8, "optimizer": {"type": "AdamW", ')
    with pytest.raises(ValueError, match=r"config file .*ds_bad\.json: not valid JSON"):
        Config.from_deepspeed(str(bad), dp=1)
    with pytest.raises(ValueError, match=r"config file .*nope\.json cannot be read"):
        Config.from_deepspeed(str(tmp_path / "nope.json"), dp=1)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(TypeError, match=r"list\.json must hold a JSON object"):
        Config.from_deepspeed(listed, dp=1)


@pytest.mark.parametrize(
    "block, match",
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, "optimizer.params.lr.*finite"),
        ({"optimizer": {"type": "AdamW", "params": {"eps": float("nan")}}}, "optimizer.params.eps.*finite"),
        ({"gradient_clipping": float("inf")}, "gradient_clipping.*finite"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("inf")}}}, "warmup_max_lr.*finite"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": float("inf")}}, "reduce_bucket_size.*integer"),
    ],
)
def test_non_finite_hyperparameters_are_refused(block, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Config.from_deepspeed({"train_batch_size": 8, **block}, dp=2)


def test_a_file_is_read_once_and_gives_the_same_config_as_the_dict(tmp_path, monkeypatch):
    from llmpar.runtime import Blocks, read_config
    from llmpar.runtime import config as runtime_config

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "pipeline": {"stages": 2, "micro_batches": 4},
        "tensor_parallel": {"size": 2},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e4},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    opened = []
    real_open = open
    monkeypatch.setattr(
        runtime_config, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k), raising=False
    )
    raw = read_config(path)
    assert opened == [os.fspath(path)]
    blocks = Blocks.parse(raw)
    assert blocks.degrees == (2, 2)
    a, b = Config.from_blocks(blocks, dp=3), Config.from_deepspeed(cfg, dp=3)
    assert a == b and len(opened) == 1
    assert (a.gradient_accumulation_steps, a.train_batch_size, a.bf16, a.zero.reduce_bucket_size) == (
        4,
        24,
        True,
        50000,
    )
    assert a.pipeline.stages == 2 and a.tensor_parallel.size == 2


@pytest.mark.parametrize(
    "zero, want",
    [
        ({"gather_16bit_weights_on_model_save": True}, True),  # DeepSpeed's field name
        ({"stage3_gather_16bit_weights_on_model_save": True}, True),  # its alias
        ({"stage3_gather_fp16_weights_on_model_save": True}, True),  # the older alias
        ({"gather_16bit_weights_on_model_save": False}, False),
    ],
)
def test_gather_16bit_weights_under_each_of_deepspeeds_names(zero, want):
    c = Config.from_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 3, **zero}}, dp=2)
    assert c.zero.stage3_gather_16bit_weights_on_model_save is want


def test_gather_16bit_weights_given_twice_is_refused():
    with pytest.raises(
        ValueError,
        match="'stage3_gather_16bit_weights_on_model_save' and 'gather_16bit_weights_on_model_save' are one setting",
    ):
        Config.from_deepspeed(
            {
                "train_batch_size": 8,
                "zero_optimization": {
                    "stage": 3,
                    "gather_16bit_weights_on_model_save": True,
                    "stage3_gather_16bit_weights_on_model_save": True,
                },
            },
            dp=2,
        )


@pytest.mark.parametrize(
    "block, tp", [({"autotp_size": 0}, 1), ({"autotp_size": 1}, 1), ({"autotp_size": 2}, 2), ({"size": 2}, 2), ({}, 1)]
)
def test_tensor_parallel_autotp_size_zero_is_off(block, tp):
    """DeepSpeed's default ``"autotp_size": 0`` means no tensor parallelism."""
    assert Config.from_deepspeed({"train_batch_size": 8, "tensor_parallel": block}, dp=2).tensor_parallel.size == tp


@pytest.mark.parametrize(
    "block, match",
    [
        ({"autotp_size": -1}, '"tensor_parallel.autotp_size"=-1 must be >= 0'),
        ({"size": 0}, '"tensor_parallel.size"=0 must be >= 1'),
        ({"autotp_size": 2, "size": 2}, "not both"),
    ],
)
def test_tensor_parallel_errors_name_the_key_given(block, match):
    with pytest.raises(ValueError, match=match):
        Config.from_deepspeed({"train_batch_size": 8, "tensor_parallel": block}, dp=2)


@pytest.mark.parametrize("typ", ["AdamW", "Adam", "AdamW8bit", "AdamW4bit"])
def test_deepspeed_implementation_switches_are_taken_by_every_adam_type(typ):
    """``torch_adam`` / ``fused`` pick DeepSpeed's implementation of the same math: accepted for every Adam type."""
    c = Config.from_deepspeed(
        {"train_batch_size": 8, "optimizer": {"type": typ, "params": {"lr": 2e-3, "torch_adam": True, "fused": False}}},
        dp=2,
    )
    assert c.optimizer.type == typ and c.optimizer.lr == 2e-3
