"""DeepSpeed scripts run unchanged on llmpar: the same script (tests/data/cifar_script.py, in the shape of DeepSpeed's
cifar10 example) under DeepSpeed and under ``import llmpar as deepspeed``, 2 CPU ranks, ZeRO stages 0-3, 30 optimizer
steps each: the losses agree to 1e-5 (relative)."""
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

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
STEPS = 30


def config(stage: int) -> dict:
    return {"train_batch_size": 16, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
            "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 3e-7, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 5}},
            "fp16": {"enabled": False}, "bf16": {"enabled": False},
            "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                                  "allgather_bucket_size": 50000, "reduce_bucket_size": 50000, "overlap_comm": True,
                                  "contiguous_gradients": True, "cpu_offload": False,
                                  "stage3_param_persistence_threshold": 0}}


def run_script(which: str, stage: int, tmp: Path, ext: Path | None = None) -> tuple[list[float], float]:
    """(losses, wall seconds) of the cifar script run by ``which`` (deepspeed | llmpar) on 2 ranks."""
    cfg = tmp / f"ds_s{stage}.json"
    cfg.write_text(json.dumps(config(stage)))
    out = tmp / f"{which}_s{stage}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCH_EXTENSIONS_DIR": str(ext if ext is not None else tmp / f"ext_{which}")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(DATA / "pipe_launch.py"), which, str(DATA / "cifar_script.py"), "--deepspeed", "--deepspeed_config",
           str(cfg), "--steps", str(STEPS), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, f"{which} stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    data = json.loads(out.read_text())
    assert data["stage"] == stage
    return data["loss"], wall


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cifar_script_matches_deepspeed(stage, tmp_path, ds_ext_dir):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    theirs, _ = run_script("deepspeed", stage, tmp_path, ds_ext_dir)
    ours, _ = run_script("llmpar", stage, tmp_path, ds_ext_dir)
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64),
                               rtol=1e-5, atol=0)
    assert sum(ours[-5:]) < sum(ours[:5])  # and it trains
