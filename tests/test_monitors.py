"""DeepSpeed's monitors (``tensorboard``, ``csv_monitor``, ``wandb`` blocks): parsed and checked with the config,
written on rank 0 with DeepSpeed's event names, files and sample steps, read back and compared with what the engine
returned. One rank here (cheap, in-process); the 2-rank run of a DeepSpeed-style script with the monitors on is in
tests/test_deepspeed_scripts.py. The tensorboard / wandb writers are checked when their packages are installed."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import os
import struct
from pathlib import Path

import pytest
import torch

import llmpar
from llmpar.runtime.config import Blocks
from llmpar.runtime.monitor import MissingPackage, monitor_config

HAVE_TB = importlib.util.find_spec("tensorboard") is not None
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_wandb(run_file: Path) -> dict[str, list[tuple[int, float]]]:
    """The history of an offline wandb run (``run-*.wandb``: LevelDB-log blocks of 32 KiB, records of protobuf
    ``Record``s split into FULL / FIRST / MIDDLE / LAST pieces) by name: [(step, value), ...]."""
    from wandb.proto import wandb_internal_pb2 as pb

    buf = run_file.read_bytes()
    assert buf[:4] == b":W&B", buf[:8]
    pos, pending, out = 7, b"", {}
    while pos + 7 <= len(buf):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _, n, kind = struct.unpack("<IHB", buf[pos : pos + 7])
        pos += 7
        if kind == 0:  # zero padding to the end of the block
            pos += room - 7
            continue
        chunk, pos = buf[pos : pos + n], pos + n
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    name = item.key or "/".join(item.nested_key)
                    if not name.startswith("_"):
                        out.setdefault(name, []).append((record.history.step.num, json.loads(item.value_json)))
    return out


# --------------------------------------------------------------------------------------------------- the config
def test_monitor_blocks_are_read_with_deepspeeds_keys_and_defaults(tmp_path):
    raw = {
        "train_batch_size": 8,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j1"},
        "tensorboard": {"enabled": False, "output_path": "x"},
        "wandb": {"enabled": False, "team": "t"},
    }
    Blocks.parse(raw)  # accepted
    cfg = monitor_config(raw)
    assert cfg.enabled and cfg.csv_monitor.job_name == "j1" and not cfg.tensorboard.enabled
    assert (cfg.wandb.project, cfg.wandb.team, cfg.wandb.group) == ("deepspeed", "t", None)
    default = monitor_config({"csv_monitor": {"enabled": True}}).csv_monitor
    assert (default.output_path, default.job_name) == ("", "DeepSpeedJobName")
    assert not monitor_config({}).enabled


@pytest.mark.parametrize(
    "raw,error,match",
    [
        ({"csv_monitor": {"enabled": True, "outputpath": "x"}}, ValueError, 'did you mean "output_path"'),
        (
            {"csv_monitor": {"enabled": True, "output_path": 3}},
            TypeError,
            '"csv_monitor.output_path"=3 must be a string',
        ),
        ({"tensorboard": {"enabled": True, "job_name": ""}}, TypeError, "tensorboard.job_name.*non-empty"),
        ({"wandb": {"enabled": True, "team": 5}}, TypeError, '"wandb.team"=5 must be a string or null'),
        ({"csv_monitor": {"enabled": "yes"}}, TypeError, "csv_monitor.enabled"),
        ({"comet": {"enabled": True}}, ValueError, '"comet.enabled"=true: not supported: the comet monitor'),
        ({"comms_logger": {"enabled": True}}, ValueError, "comms_logger.enabled.*CommCounter"),
        ({"flops_profiler": {"enabled": True}}, ValueError, "flops_profiler.enabled.*with_flops"),
    ],
)
def test_bad_monitor_blocks_name_the_key(raw, error, match):
    with pytest.raises(error, match=match):
        Blocks.parse({"train_batch_size": 8, **raw})


def test_enabled_writer_without_its_package_names_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a)
    )
    for block, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        with pytest.raises(MissingPackage, match=f"needs the '{package}' package.*pip install {package}") as info:
            Blocks.parse({"train_batch_size": 8, block: {"enabled": True}})
        assert isinstance(info.value, ImportError) and isinstance(info.value, ValueError)
    Blocks.parse({"train_batch_size": 8, "tensorboard": {"enabled": False}})  # off: nothing needed


# --------------------------------------------------------------------------------------------------- the writers
def _engine(tmp_path: Path, *, fp16: bool = False, writers: tuple[str, ...] = ("csv_monitor",)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5))
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 4e-3}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 3, "total_num_steps": 9, "warmup_max_lr": 4e-3, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": 2},
    }
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2}
    for w in writers:
        cfg[w] = (
            {"enabled": True, "project": "llmpar-test", "group": "g"}
            if w == "wandb"
            else {"enabled": True, "output_path": str(tmp_path / w), "job_name": "job"}
        )
    engine, *_ = llmpar.initialize(model=model, config=cfg)
    return engine, model


def _train(engine, model, steps: int, dtype=torch.float32) -> tuple[list[float], list[float], list[float]]:
    """Per optimizer step: the sum of the backward's returned losses (loss / gas), the lr and the loss scale after
    the step."""
    losses, lrs, scales = [], [], []
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        total = 0.0
        for _ in range(2):
            x = torch.randn(3, 13, generator=g).to(dtype)
            total += float(engine.backward(model(x).float().pow(2).mean()).detach())
            engine.step()
        losses.append(total)
        lrs.append(engine.get_lr()[0])
        scales.append(engine.optimizer.loss_scale)
    return losses, lrs, scales


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def test_monitors_write_deepspeeds_events_on_one_rank(tmp_path, wandb_offline):
    """(wandb: in the 2-rank script run, where its start-up of a few seconds is paid once.)"""
    writers = ("csv_monitor",) + (("tensorboard",) if HAVE_TB else ())
    engine, model = _engine(tmp_path, writers=writers)
    assert engine.monitor.enabled
    losses, lrs, _ = _train(engine, model, 5)
    engine.monitor.write_events([("Custom/my value", 2.5, 11)])  # a script's own event, DeepSpeed's way
    with pytest.raises(TypeError, match="must be"):
        engine.monitor.write_events([("Custom/bad", "x", 1)])
    engine.destroy()
    batch = engine.train_batch_size()  # 6: steps are samples seen
    want_loss = [(k * batch, v) for k, v in enumerate(losses)]  # before each step
    want_lr = [((k + 1) * batch, v) for k, v in enumerate(lrs)]  # after it
    job = tmp_path / "csv_monitor" / "job"
    assert sorted(os.listdir(job)) == ["Custom_my_value.csv", "Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    header, rows = read_csv(job / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"] and [s for s, _ in rows] == [s for s, _ in want_loss]
    torch.testing.assert_close(
        torch.tensor([v for _, v in rows], dtype=torch.float64),
        torch.tensor([v for _, v in want_loss], dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    header, rows = read_csv(job / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and rows == want_lr  # exact: repr of the same float
    assert len({v for _, v in rows}) >= 4  # the schedule moved
    assert read_csv(job / "Custom_my_value.csv") == (["step", "my value"], [(11, 2.5)])
    if HAVE_TB:
        tb = read_tensorboard(tmp_path / "tensorboard" / "job")
        assert set(tb) == {"Train/Samples/train_loss", "Train/Samples/lr", "Custom/my value"}
        for tag, want in (("Train/Samples/train_loss", want_loss), ("Train/Samples/lr", want_lr)):
            assert [s for s, _ in tb[tag]] == [s for s, _ in want]
            torch.testing.assert_close(
                torch.tensor([v for _, v in tb[tag]], dtype=torch.float64),
                torch.tensor([v for _, v in want], dtype=torch.float64),
                rtol=1e-6,
                atol=0,
            )
    if "wandb" in writers:  # the offline run's history: the same series (a step below the last one is dropped by wandb)
        runs = list(wandb_offline.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(runs) == 1, runs
        history = read_wandb(runs[0])
        for tag, want in (("Train/Samples/train_loss", want_loss), ("Train/Samples/lr", want_lr)):
            assert [s for s, _ in history[tag]] == [s for s, _ in want], tag
            torch.testing.assert_close(
                torch.tensor([v for _, v in history[tag]], dtype=torch.float64),
                torch.tensor([v for _, v in want], dtype=torch.float64),
                rtol=1e-6,
                atol=0,
            )


def test_fp16_loss_scale_events(tmp_path):
    engine, model = _engine(tmp_path, fp16=True)
    _, lrs, scales = _train(engine, model, 5, dtype=torch.float16)
    engine.destroy()
    header, rows = read_csv(tmp_path / "csv_monitor" / "job" / "Train_Samples_loss_scale.csv")
    assert header == ["step", "loss_scale"]
    assert rows == [((k + 1) * 6, float(s)) for k, s in enumerate(scales)]
    assert len(set(scales)) > 1  # the dynamic scale grew every 2 clean steps
    _, lr_rows = read_csv(tmp_path / "csv_monitor" / "job" / "Train_Samples_lr.csv")
    assert [v for _, v in lr_rows] == lrs


def test_no_monitor_configured_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, model = _engine(tmp_path, writers=())
    assert engine.monitor.enabled is False
    _train(engine, model, 1)
    engine.monitor.write_events([("x", 1.0, 1)])
    engine.destroy()
    assert list(tmp_path.iterdir()) == []


def _pipeline_run(tmp: str) -> tuple[list[float], list[float], str]:
    from zero_helpers import GPT_CFG, gpt_batch

    from llmpar.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "pipeline": {"stages": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
        "csv_monitor": {"enabled": True, "output_path": tmp, "job_name": "pipe"},
    }
    engine, *_ = llmpar.initialize(model=GPT(GPTConfig(**GPT_CFG)), config=cfg)
    losses, lrs = [], []
    for s in range(3):
        losses.append(float(engine.train_batch(*gpt_batch(s, 4))))
        lrs.append(engine.get_lr()[0])
    engine.destroy()
    try:
        engine.train_batch(*gpt_batch(9, 4))
        err = ""
    except RuntimeError as e:
        err = str(e)
    return losses, lrs, err


def test_pipeline_engine_writes_the_step_loss_after_the_step(tmp_path):
    """DeepSpeed's pipeline engine: train_loss is the step's mean loss, written after the step (at the samples seen
    then, as lr); destroy() then refuses train_batch."""
    from multirank import run_ranks

    (losses, lrs, err), _ = run_ranks(_pipeline_run, 2, str(tmp_path), timeout=180)
    steps = [4 * (k + 1) for k in range(3)]  # train_batch_size 4 (pp=2, dp=1)
    _, rows = read_csv(tmp_path / "pipe" / "Train_Samples_train_loss.csv")
    assert rows == list(zip(steps, losses))
    _, rows = read_csv(tmp_path / "pipe" / "Train_Samples_lr.csv")
    assert rows == list(zip(steps, lrs)) and len(set(lrs)) == 3
    assert "after engine.destroy()" in err


def test_a_writer_that_fails_mid_run_is_logged_once_and_training_goes_on(tmp_path, caplog):
    """The csv directory replaced by a file (every later open fails) and the tensorboard writer raising OSError on
    each write: ``engine.step()`` goes on, one warning per writer naming it and its path; the run's counters and lrs
    equal a run with no monitor."""
    writers = ("csv_monitor",) + (("tensorboard",) if HAVE_TB else ())
    engine, model = _engine(tmp_path, writers=writers)
    _train(engine, model, 1)
    job = tmp_path / "csv_monitor" / "job"
    for f in job.iterdir():
        f.unlink()
    job.rmdir()
    job.write_text("not a directory")
    if HAVE_TB:

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        engine.monitor.writers["tensorboard"].writer.add_scalar = full
    with caplog.at_level(logging.WARNING, logger="llmpar"):
        losses, lrs, _ = _train(engine, model, 3)
        engine.destroy()
    warnings = [r.getMessage() for r in caplog.records if r.name == "llmpar" and "monitor" in r.getMessage()]
    assert len(warnings) == len(writers), warnings
    assert any(f"monitor csv_monitor ({job}): write failed (NotADirectoryError" in w for w in warnings), warnings
    if HAVE_TB:
        assert any("monitor tensorboard (" in w and "No space left on device" in w for w in warnings), warnings
    plain, plain_model = _engine(tmp_path, writers=())
    _train(plain, plain_model, 1)
    want = _train(plain, plain_model, 3)
    assert engine.global_steps == plain.global_steps == 4
    assert (losses, lrs) == want[:2]
