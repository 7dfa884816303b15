"""`llmpar train`: the DeepSpeed config its flags build, `--config`, clear errors for bad flags, and short runs through
the real command path (``llmpar.cli.main`` on gloo ranks, and torchrun) for dp=2, tp=2 and pp=2 x tp=2 (ZeRO-1),
checked against one process training on the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmpar.train import TrainOptions, build_config, check_layout, resolve, train

from multirank import run_ranks

# a tiny GPT that learns within 30 steps
SMALL = [
    "--steps",
    "30",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--d-model",
    "32",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "5",
    "--log-every",
    "10",
]
SMALL_OPTS = dict(
    steps=30, batch_size=8, seq_len=32, n_layer=2, n_head=2, d_model=32, lr=1e-2, warmup_steps=5, log_every=10
)

DEMO_CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 100,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {
            "warmup_type": "linear",
            "warmup_num_steps": 20,
            "total_num_steps": 300,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.1,
        },
    },
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": False},
}


# ----------------------------------------------------------------- the config the flags build (no ranks)


def test_default_flags_build_the_demo_config():
    opts, config = resolve({})
    assert config == DEMO_CONFIG
    assert opts.steps == 300 and opts.zero == 2


def test_flag_combinations_build_config():
    cfg = build_config(TrainOptions(pp=2, tp=2))
    assert cfg["zero_optimization"] == {"stage": 1}  # pipelines default to ZeRO-1
    assert cfg["pipeline"] == {"stages": 2, "schedule": "1f1b", "micro_batches": 2}
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["tensor_parallel"] == {"size": 2}

    cfg = build_config(TrainOptions(pp=4, n_layer=4, grad_accum=8, schedule="gpipe", zero=2, offload=True))
    assert cfg["pipeline"] == {"stages": 4, "schedule": "gpipe", "micro_batches": 8}
    assert cfg["gradient_accumulation_steps"] == 8
    assert cfg["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}

    cfg = build_config(
        TrainOptions(
            tp=2,
            grad_accum=4,
            zero=3,
            bf16=True,
            batch_size=2,
            lr=1e-4,
            grad_clip=0.0,
            steps=50,
            warmup_steps=0,
            print_every=5,
        )
    )
    assert "pipeline" not in cfg and cfg["tensor_parallel"] == {"size": 2}
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["bf16"] == {"enabled": True}
    assert cfg["optimizer"]["params"]["lr"] == 1e-4 and cfg["gradient_clipping"] == 0.0
    assert cfg["scheduler"]["params"]["total_num_steps"] == 50
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 1  # DeepSpeed needs >= 1 (it warms up over 2 anyway)
    assert cfg["steps_per_print"] == 5
    assert build_config(TrainOptions(dtype="bfloat16"))["bf16"] == {"enabled": True}
    assert TrainOptions(dtype="bfloat16").model_dtype == "float32"  # initialize casts it, keeping fp32 masters
    assert "tensor_parallel" not in build_config(TrainOptions()) and "pipeline" not in build_config(TrainOptions())


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(pp=2, zero=3), "--zero 3 with --pp 2: pipelines run ZeRO stages 0, 1 or 2"),
        (dict(offload=True, zero=0), "--offload needs --zero 1, 2 or 3"),
        (dict(bf16=True, dtype="float64"), "--bf16 and --dtype float64 contradict"),
        (dict(schedule="gpipe"), "--schedule=gpipe is a pipeline schedule: it needs --pp > 1"),
        (dict(zero=4), "--zero=4 must be 0, 1, 2 or 3"),
        (dict(tp=0), "--tp=0 must be a positive integer"),
        (dict(batch_size=0), "--batch-size=0 must be a positive integer"),
        (dict(grad_accum=0), "--grad-accum=0 must be a positive integer"),
        (dict(lr=0.0), "--lr=0.0 must be positive"),
        (dict(dtype="float16"), "--dtype='float16' is not one of"),
    ],
)
def test_bad_flags_fail_clearly(flags, match):
    with pytest.raises(ValueError, match=match):
        resolve(flags)


def test_layouts_that_do_not_fit_fail_clearly(capsys, monkeypatch):
    for key in list(os.environ):  # this command is not a rank of a launched job, whatever earlier tests left set
        if key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") or key.startswith(
            ("SLURM_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_", "MPI_LOCAL")
        ):
            monkeypatch.delenv(key)
    with pytest.raises(ValueError, match="--n-head=4 is not divisible by --tp=8"):
        check_layout(TrainOptions(), pp=1, tp=8, world=8)
    with pytest.raises(ValueError, match="--n-layer=2 blocks cannot fill --pp=4 pipeline stages"):
        check_layout(TrainOptions(), pp=4, tp=1, world=4)
    with pytest.raises(ValueError, match="pipeline.stages=2 x tensor_parallel.size=2 does not divide the 6 ranks"):
        check_layout(TrainOptions(), pp=2, tp=2, world=6, from_config=True)
    from llmpar.cli import main  # the command checks before launching any rank

    assert main(["train", "--nproc", "3", "--tp", "2"]) == 2
    assert "--tp=2 does not divide the 3 ranks" in capsys.readouterr().err
    assert main(["train", "--nproc", "4", "--pp", "2", "--zero", "3"]) == 2
    assert "pipelines run ZeRO stages 0, 1 or 2" in capsys.readouterr().err


# ----------------------------------------------------------------- --config


def _write(path: Path, config: dict) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def test_config_file_is_the_config(tmp_path, capsys):
    user = {
        "train_batch_size": 32,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1},
        "pipeline": {"stages": 2},
        "tensor_parallel": {"size": 2},
    }
    path = _write(tmp_path / "ds.json", user)
    opts, config = resolve({"steps": 7, "n_layer": 4, "dtype": "float64"}, path)
    assert config == user and opts.steps == 7 and opts.n_layer == 4 and opts.model_dtype == "float64"
    from llmpar.cli import main
    from llmpar.train import degrees

    assert degrees(config) == (2, 2)
    assert main(["train", "--config", path, "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out) == user


def test_config_file_and_training_flags_do_not_mix(tmp_path, capsys):
    path = _write(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(
        ValueError,
        match=r"--lr \(config key optimizer.params.lr\), --zero \(config key "
        r"zero_optimization.stage\) cannot be given with it",
    ):
        resolve({"lr": 1e-3, "zero": 1, "steps": 3}, path)
    with pytest.raises(ValueError, match=r"--dtype \(config key bf16.enabled\)"):
        resolve({"dtype": "bfloat16"}, path)
    with pytest.raises(ValueError, match=r"--tp \(config key tensor_parallel.size\)"):
        resolve({"tp": 2}, path)
    with pytest.raises(ValueError, match="missing.json cannot be read"):
        resolve({}, tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve({}, tmp_path / "bad.json")
    from llmpar.cli import main

    assert main(["train", "--config", path, "--pp", "2"]) == 2
    assert "--pp (config key pipeline.stages) cannot be given with it" in capsys.readouterr().err


# ----------------------------------------------------------------- runs through llmpar.initialize


TINY = dict(
    steps=6,
    batch_size=3,
    seq_len=16,
    n_layer=2,
    n_head=2,
    d_model=16,
    lr=1e-2,
    warmup_steps=2,
    log_every=2,
    dtype="float64",
    grad_accum=2,
)


def _flat_params(engine):
    return torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])


def _dp_body(kw):
    engine, result = train(TrainOptions(**kw))
    return _flat_params(engine), result.losses, result.mem_mb, result.engine


def test_dp_equals_single_process_on_concatenated_batch():
    """N ranks with batch B train exactly like one process with batch N*B (ZeRO-2 through initialize, 2 micro
    steps of accumulation each)."""
    (p0, losses0, mem0, kind), (p1, losses1, _, _) = run_ranks(_dp_body, 2, TINY, timeout=120)
    assert kind == "Engine" and torch.equal(p0, p1), "dp ranks drifted apart"
    assert losses0 == losses1 and len(mem0) == 2 and all(m > 0 for m in mem0)
    engine, single = train(TrainOptions(**dict(TINY, batch_size=2 * TINY["batch_size"])))
    torch.testing.assert_close(p0, _flat_params(engine), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.tensor(losses0), torch.tensor(single.losses), rtol=1e-10, atol=1e-12)
    init = _flat_params(train(TrainOptions(**dict(TINY, steps=1)))[0])  # step 1 runs at lr 0 (WarmupCosineLR)
    assert not torch.allclose(p0, init)  # the parameters did move


def _cli_body(argv):
    from llmpar.cli import main

    return main(["train", *argv])


@pytest.mark.parametrize(
    "world, flags, single",
    [
        (2, [], dict(batch_size=16)),  # dp=2, ZeRO-2, fp32
        (2, ["--tp", "2", "--dtype", "float64"], dict(dtype="float64")),  # tp=2, ZeRO-2 over dp=1
        (
            4,
            ["--pp", "2", "--tp", "2", "--zero", "1", "--dtype", "float64"],
            dict(dtype="float64", grad_accum=2),
        ),  # pipeline engine, same param groups (decay on matrices only)
    ],
    ids=["dp2", "tp2", "pp2xtp2-zero1"],
)
def test_command_trains_through_initialize(world, flags, single, tmp_path):
    """``llmpar train`` on gloo ranks: the loss falls, and the curve is the one process's on the whole batch."""
    summary = tmp_path / "summary.json"
    codes = run_ranks(_cli_body, world, [*SMALL, "--sample", "20", "--json", str(summary), *flags], timeout=300)
    assert codes == [0] * world
    data = json.loads(summary.read_text())
    assert data["fell"] and data["final_loss"] < 0.8 * data["first_loss"] and len(data["losses"]) == 30
    assert len(data["mem_mb"]) == world and all(m > 0 for m in data["mem_mb"])
    pipeline = "--pp" in flags
    assert data["engine"] == ("PipelineEngine" if pipeline else "Engine")
    assert data["zero_stage"] == (1 if pipeline else 2) and bool(data["sample"]) != pipeline
    _, ref = train(TrainOptions(**dict(SMALL_OPTS, **single)))
    tol = dict(rtol=1e-4, atol=1e-5) if data["dtype"] == "float32" else dict(rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(torch.tensor(data["losses"]), torch.tensor(ref.losses), **tol)


def test_command_with_config_under_torchrun(tmp_path):
    """``llmpar train --config ds.json`` re-launches itself under torchrun and trains the user's config (bf16, ZeRO-2
    with CPU offload, accumulation, WarmupLR)."""
    path = _write(
        tmp_path / "ds.json",
        {
            "train_batch_size": 32,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_type": "linear"}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "bf16": {"enabled": True},
        },
    )
    summary = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmpar.cli",
            "train",
            "--nproc",
            "2",
            "--config",
            path,
            "--steps",
            "30",
            "--seq-len",
            "32",
            "--d-model",
            "32",
            "--n-head",
            "2",
            "--sample",
            "0",
            "--json",
            str(summary),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PASS: loss fell" in out.stdout and "ZeRO-2 + offload, bfloat16" in out.stdout
    assert "micro batch 8 x accumulation 2 x dp 2 = 32 sequences/step" in out.stdout and "rank 1:" in out.stdout
    data = json.loads(summary.read_text())
    assert data["dp"] == 2 and data["config"]["deepspeed"]["train_batch_size"] == 32 and data["fell"] is True


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    """A key the runtime rejects: exit status 2 and its message, once, before any rank is launched; not a traceback."""
    path = _write(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 1}})
    from llmpar.cli import main

    assert main(["train", "--nproc", "1", "--config", path, "--steps", "2"]) == 2
    err = capsys.readouterr().err
    # checked by the runtime's own parser before any rank starts
    assert err.count("llmpar train: error:") == 1 and 'did you mean "zero_optimization"' in err


def test_a_ranks_config_error_exits_2_through_the_relaunch(tmp_path):
    """A config the ranks reject (batch sizes that need dp, known only on the ranks) under ``--nproc 2``: the
    command exits 2 as documented, not torchrun's 1 for a failed child."""
    path = _write(
        tmp_path / "ds.json",
        {
            "train_batch_size": 7,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, "-m", "llmpar.cli", "train", "--nproc", "2", "--config", path, "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "llmpar train: error: llmpar.initialize rejected the config: batch sizes are inconsistent" in out.stderr


def test_ranks_status_precedence(tmp_path):
    from llmpar.train.command import _ranks_status

    def status(*codes):
        folder = tmp_path / "_".join(map(str, codes))
        folder.mkdir()
        for r, c in enumerate(codes):
            if c is not None:
                (folder / f"rank{r}").write_text(str(c))
        return str(folder)

    assert _ranks_status(status(2, 3), 2, 1) == 2 and _ranks_status(status(3, 0), 2, 1) == 3
    assert _ranks_status(status(0, 0), 2, 0) == 0
    assert _ranks_status(status(2, None), 2, 1) == 1  # a rank that crashed: the launcher's status
