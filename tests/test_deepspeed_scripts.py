"""DeepSpeed scripts run unchanged on llmpar: the same script (tests/data/cifar_script.py, in the shape of DeepSpeed's
cifar10 example) under DeepSpeed and under ``import llmpar as deepspeed``, 2 CPU ranks, ZeRO stages 0-3, 30 optimizer
steps each: the losses agree to 1e-5 (relative); DeepSpeed's runs of stages 0, 1 and 3 are golden files
(tests/golden/cifar/, tests/reference_runs.py), stage 2's runs live. And a script in the shape of DeepSpeedExamples'
training scripts (tests/data/ds_example_script.py), its ``deepspeed`` imports renamed to ``llmpar`` and nothing else,
runs to the end with the monitors on (one 2-rank run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from multirank import free_port
from reference_runs import References

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
STEPS = 30


def config(stage: int) -> dict:
    return {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 3e-7, "torch_adam": True},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5}},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000,
            "reduce_bucket_size": 50000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
            "stage3_param_persistence_threshold": 0,
        },
    }


def run_script(which: str, stage: int, tmp: Path, ext: Path | None = None) -> tuple[list[float], float]:
    """(losses, wall seconds) of the cifar script run by ``which`` (deepspeed | llmpar) on 2 ranks."""
    cfg = tmp / f"ds_{which}_s{stage}.json"
    csv_dir = {"enabled": True, "output_path": str(tmp / f"csv_{which}"), "job_name": f"s{stage}"}
    cfg.write_text(json.dumps({**config(stage), "csv_monitor": csv_dir}))
    out = tmp / f"{which}_s{stage}.json"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TORCH_EXTENSIONS_DIR": str(ext if ext is not None else tmp / f"ext_{which}"),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(DATA / "pipe_launch.py"),
        which,
        str(DATA / "cifar_script.py"),
        "--deepspeed",
        "--deepspeed_config",
        str(cfg),
        "--steps",
        str(STEPS),
        "--out",
        str(out),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, f"{which} stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    data = json.loads(out.read_text())
    assert data["stage"] == stage
    return data["loss"], wall


def _deepspeed_record(case: str, spec: dict, tmp: Path, ext: Path) -> dict:
    """DeepSpeed's run of the cifar script at stage ``case``: its losses and the csv monitor's files."""
    stage = int(case)
    assert spec == config(stage)
    losses, _ = run_script("deepspeed", stage, tmp, ext)
    job = tmp / "csv_deepspeed" / f"s{stage}"
    return {"loss": losses, "csv": {name: (job / name).read_text() for name in sorted(os.listdir(job))}}


def _same_losses(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(
        torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64), rtol=1e-5, atol=0
    )


def _same_record(case: str, live: dict, golden: dict) -> None:
    _same_losses(live["loss"], golden["loss"])
    assert live["csv"] == golden["csv"]


# DeepSpeed's runs at each stage: stage 2 runs live every time (and is checked against its golden file); the others
# are read from tests/golden/cifar/ (`make golden`), or run live where DeepSpeed's version is not the goldens'
REFERENCES = References(
    "cifar",
    run=_deepspeed_record,
    cases={str(stage): config(stage) for stage in range(4)},
    live={"2"},
    sources=["tests/data/cifar_script.py", "tests/data/pipe_launch.py"],
    packages=("deepspeed", "torch"),
    same=_same_record,
)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cifar_script_matches_deepspeed(stage, tmp_path, ds_ext_dir):
    theirs = REFERENCES.get(str(stage), tmp_path, ds_ext_dir)
    ours, _ = run_script("llmpar", stage, tmp_path, ds_ext_dir)
    _same_losses(ours, theirs["loss"])
    assert sum(ours[-5:]) < sum(ours[:5])  # and it trains
    # the csv monitor: the files DeepSpeed writes, with its header, sample steps and lrs
    ours_dir = tmp_path / "csv_llmpar" / f"s{stage}"
    assert set(theirs["csv"]) == {"Train_Samples_lr.csv"}  # DeepSpeed 0.19's plain engine: lr only
    assert set(os.listdir(ours_dir)) == {"Train_Samples_lr.csv", "Train_Samples_train_loss.csv"}
    assert (ours_dir / "Train_Samples_lr.csv").read_text() == theirs["csv"]["Train_Samples_lr.csv"]


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    rows = [line.split(",") for line in path.read_text().splitlines()]
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def test_example_script_renamed_runs_with_monitors(tmp_path):
    """One 2-rank run of tests/data/ds_example_script.py after the mechanical rename (get_accelerator from the top
    level, runtime.utils' set_random_seed and see_memory_usage,
    lr_schedules.WarmupDecayLR on a client optimizer, initialize, train loop, optimizer state dict, save_checkpoint,
    destroy) with the csv, tensorboard and wandb monitors on (the last two when installed; wandb offline): it exits
    0, and rank 0's monitor events are the losses and lrs the engine returned, at DeepSpeed's sample steps."""
    from test_monitors import HAVE_TB, HAVE_WANDB, read_tensorboard, read_wandb

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": 2},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
        "tensorboard": {"enabled": HAVE_TB, "output_path": str(tmp_path / "tb"), "job_name": "run"},
        "wandb": {"enabled": HAVE_WANDB, "project": "llmpar-test", "group": "ranks"},
    }
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.json"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "DS_ACCELERATOR": "cpu",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(DATA / "pipe_launch.py"),
        "llmpar",
        str(DATA / "ds_example_script.py"),
        "--deepspeed",
        "--deepspeed_config",
        str(tmp_path / "ds.json"),
        "--steps",
        "6",
        "--out",
        str(out),
        "--save_dir",
        str(tmp_path / "ckpt"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    data = json.loads(out.read_text())
    assert (data["device"], data["device_name"], data["backend"]) == ("cpu:0", "cpu", "gloo")
    assert data["peak"] > 0 and "buffers" in data["state_keys"]
    torch.manual_seed(4321)  # what deepspeed.runtime.utils.set_random_seed(4321) leaves torch's generator at
    assert data["seeded"] == torch.rand(2).tolist()
    assert "after initialize: MA" in proc.stdout + proc.stderr  # see_memory_usage(force=True), rank 0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step6"
    assert data["loss"][-1] < data["loss"][0]
    batch = data["train_batch_size"]  # 16 = 4 x 2 x dp 2
    want = {
        "Train/Samples/train_loss": [(k * batch, v) for k, v in enumerate(data["loss"])],  # before each step
        "Train/Samples/lr": [((k + 1) * batch, v) for k, v in enumerate(data["lr"])],
    }  # after it
    assert len(set(data["lr"])) >= 4  # the schedule moved
    job = tmp_path / "csv" / "run"
    got = {
        "Train/Samples/train_loss": _read_csv(job / "Train_Samples_train_loss.csv"),
        "Train/Samples/lr": _read_csv(job / "Train_Samples_lr.csv"),
    }
    assert got["Train/Samples/train_loss"][0] == ["step", "train_loss"] and got["Train/Samples/lr"][0] == ["step", "lr"]
    assert _read_csv(job / "Train_Samples_script_event.csv") == (["step", "script_event"], [(6 * batch, 1.5)])
    readers = {"csv": {k: v[1] for k, v in got.items()}}
    if HAVE_TB:
        readers["tensorboard"] = read_tensorboard(tmp_path / "tb" / "run")
    if HAVE_WANDB:
        runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(runs) == 1, runs  # rank 0 only
        readers["wandb"] = read_wandb(runs[0])
    for writer, events in readers.items():
        for tag, rows in want.items():  # rank 0 wrote each step once (rank 1 wrote nothing)
            assert [s for s, _ in events[tag]] == [s for s, _ in rows], (writer, tag)
            torch.testing.assert_close(
                torch.tensor([v for _, v in events[tag]], dtype=torch.float64),
                torch.tensor([v for _, v in rows], dtype=torch.float64),
                rtol=1e-6,
                atol=0,
                msg=f"{writer} {tag}",
            )
