"""Restarts that resume exactly: the engine's data loader resumes mid-pass from a checkpoint (runtime/resume.py),
``"checkpoint": {"auto_resume": DIR}`` loads DIR's latest in initialize, and a job launched with
``llmpar launch --num_gpus 2 --max_restarts 1`` whose rank 1 is killed mid-run comes back and trains on to the
same losses, bit for bit, as an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import llmpar
from llmpar.runtime.resume import ResumableLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(n: int = 37) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)
    )


def _config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.02}},
        "zero_optimization": {"stage": 1},
        **extra,
    }


def _engine(config: dict):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(5, 11), nn.GELU(), nn.Dropout(0.2), nn.Linear(11, 1)).double()
    engine, *_ = llmpar.initialize(model=model, config=config, training_data=_data())
    return engine


def _train(engine, steps: int, save_at: tuple[int, ...] = (), ckpt: str | None = None) -> dict[int, str]:
    """The loop of module docstring: passes over engine.training_dataloader, a new epoch after each full pass."""
    losses = {}
    while engine.global_steps < steps:
        for x, y in engine.training_dataloader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses[engine.global_steps] = loss.item().hex()
            if engine.global_steps in save_at:
                engine.save_checkpoint(ckpt)
            if engine.global_steps >= steps:
                break
        else:
            sampler = engine.training_dataloader.data_sampler
            sampler.set_epoch(sampler.epoch + 1)
    return losses


def test_loader_resumes_mid_pass_after_load(tmp_path):
    """One rank: 37 samples in batches of 3 are 13 batches a pass; checkpoints mid-pass (step 5) and at a pass's end
    (step 13) both resume to the uninterrupted losses (the same data order, epoch, dropout RNG and LR)."""
    ckpt = str(tmp_path / "ckpt")
    ref = _train(_engine(_config()), 18, save_at=(5, 13), ckpt=ckpt)
    for tag in ("global_step5", "global_step13"):
        engine = _engine(_config())
        engine.load_checkpoint(ckpt, tag=tag)
        start, position = engine.global_steps, engine.dataloader_position
        assert _train(engine, 18) == {s: ref[s] for s in range(start + 1, 19)}, tag
        assert position == {"epoch": (start - 1) // 13, "samples": min(start * 3, 37), "replicas": 1}


def test_pipeline_engine_loader_resumes(tmp_path):
    """The pipeline engine's loader (``train_batch()`` pulls it): 23 samples, micro-batches of 2 (12 a pass), 2 a
    step; from a checkpoint mid-pass (step 4) the losses go on, across the pass's end, as without the restart."""
    from llmpar.pipe import PipelineModule

    data = _data(23)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }

    def engine():
        torch.manual_seed(3)
        net = PipelineModule(
            layers=[nn.Linear(5, 7), nn.Dropout(0.3), nn.Tanh(), nn.Linear(7, 1)], num_stages=1, loss_fn=nn.MSELoss()
        ).double()
        return llmpar.initialize(model=net, config=config, training_data=data)[0]

    ckpt, first = str(tmp_path / "pipe"), engine()
    ref = []
    for step in range(1, 9):
        ref.append(float(first.train_batch()).hex())
        if step == 4:
            first.save_checkpoint(ckpt)
    again = engine()
    again.load_checkpoint(ckpt)
    assert [float(again.train_batch()).hex() for _ in range(4, 8)] == ref[4:]  # steps 5-8: into the next pass


def test_progress_line_leaves_the_random_stream_alone():
    """The first steps_per_print line measures the CPU's matmul peak once per process (for MFU); drawing its
    matrices from torch's global RNG shifted the dropout stream of a restarted process, which measures again at
    another step, so its losses left the uninterrupted run's."""
    from llmpar.runtime.mfu import cpu_matmul_tflops

    state = torch.get_rng_state()
    cpu_matmul_tflops.__wrapped__(n=8, repeats=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_position_at_another_dp():
    """The DistributedSampler interleaves its ranks: after each of 2 ranks handed out 2 batches of 3, the first 12
    indices of the epoch's permutation are used; a 1-rank loader resumed there goes on with index 12."""
    data = _data(29)
    order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    positions = []
    for rank in (0, 1):
        loader = ResumableLoader(
            data, batch_size=3, sampler=torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank)
        )
        it = iter(loader)
        next(it), next(it)
        positions.append(loader.position(2))
    assert positions == [{"epoch": 0, "samples": 6, "replicas": 2}] * 2
    one = ResumableLoader(data, batch_size=4, sampler=torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0))
    one.resume(positions[0], 1)
    rest = torch.cat([x[:, 0] for x, _ in one])
    assert torch.equal(rest, data.tensors[0][order[12:], 0])
    assert len(one) == 8 and len(list(one)) == 8  # the skip applied to that one pass only


def test_auto_resume_in_initialize(tmp_path):
    """``"checkpoint": {"auto_resume": DIR}``: a first run starts fresh; an engine built again loads DIR's latest
    (weights, step, loader position) and trains on to the uninterrupted losses; bad values name the key."""
    ckpt = str(tmp_path / "auto")
    ref = _train(_engine(_config()), 9)
    first = _engine(_config(checkpoint={"auto_resume": ckpt}))
    assert first.resumed_from is None and first.global_steps == 0
    _train(first, 4, save_at=(4,), ckpt=ckpt)
    again = _engine(_config(checkpoint={"auto_resume": ckpt}))
    assert again.resumed_from == os.path.join(ckpt, "global_step4") and again.global_steps == 4
    assert again.resumed_client_state is None
    assert _train(again, 9) == {s: ref[s] for s in range(5, 10)}
    every = str(tmp_path / "every")  # "auto_resume_interval": the engine saves there itself
    _train(_engine(_config(checkpoint={"auto_resume": every, "auto_resume_interval": 2})), 5)
    assert sorted(os.listdir(every)) == ["global_step2", "global_step4", "latest"]
    again = _engine(_config(checkpoint={"auto_resume": every, "auto_resume_interval": 2}))
    assert again.global_steps == 4 and _train(again, 9) == {s: ref[s] for s in range(5, 10)}
    for block, kind, match in (
        ({"auto_resume": 3}, TypeError, r'"checkpoint.auto_resume"=3: expected a directory path'),
        ({"auto_resume": "  "}, ValueError, r'"checkpoint.auto_resume"=.*non-empty'),
        (
            {"auto_resume": ckpt, "auto_resume_interval": 0},
            ValueError,
            r'"checkpoint.auto_resume_interval"=0: expected a positive integer',
        ),
        (
            {"auto_resume_interval": 5},
            ValueError,
            r'"checkpoint.auto_resume_interval"=5 needs '
            r'"checkpoint.auto_resume"',
        ),
    ):
        with pytest.raises(kind, match=match):
            _engine(_config(checkpoint=block))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r'"checkpoint.auto_resume"=.*file.* is not a directory'):
        _engine(_config(checkpoint={"auto_resume": str(tmp_path / "file")}))


# ------------------------------------------------------------------------------- a killed rank, restarted
JOB = r"""
import json, os, signal, sys
import torch
from torch import nn
import llmpar

import argparse  # DeepSpeed-shaped: llmpar launch passes --local_rank=N right after the script, as DeepSpeed's
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("rest", nargs=4)
cli = parser.parse_args()
assert cli.local_rank == int(os.environ["LOCAL_RANK"]), (cli.local_rank, os.environ["LOCAL_RANK"])
out, steps, kill_at, every = cli.rest[0], int(cli.rest[1]), int(cli.rest[2]), int(cli.rest[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.set_num_threads(1)
g = torch.Generator().manual_seed(123)
data = torch.utils.data.TensorDataset(torch.randn(37, 5, generator=g), torch.randn(37, 1, generator=g))
config = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.02}},
          "zero_optimization": {"stage": 1}, "steps_per_print": 4,  # progress lines at 4, 8, 12
          "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}}


def run(name, extra):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(5, 11), nn.GELU(), nn.Dropout(0.2), nn.Linear(11, 1))
    engine, _, loader, _ = llmpar.initialize(model=model, config={**config, **extra}, training_data=data)
    log = open(os.path.join(out, f"{name}{rank}.jsonl"), "a")
    log.write(json.dumps({"attempt": attempt, "world": world, "resumed_from": getattr(engine, "resumed_from", None),
                          "start": engine.global_steps}) + "\n")
    while engine.global_steps < steps:
        for x, y in engine.training_dataloader:
            loss = nn.functional.mse_loss(engine(x.half()).float(), y)
            engine.backward(loss)
            engine.step()
            s = engine.global_steps
            log.write(json.dumps({"step": s, "loss": loss.item().hex(), "attempt": attempt,
                                  "scale": engine.optimizer.loss_scaler.cur_scale}) + "\n")
            log.flush()
            if extra and s % every == 0:
                engine.save_checkpoint(os.path.join(out, "ckpt"))
            if extra and attempt == 0 and s == kill_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a rank dies; the agent restarts every rank
            if s >= steps:
                break
        else:
            sampler = engine.training_dataloader.data_sampler
            sampler.set_epoch(sampler.epoch + 1)


if attempt == 0:  # the uninterrupted reference, in the same processes
    run("ref", {})
run("run", {"checkpoint": {"auto_resume": os.path.join(out, "ckpt")}})
"""


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_exactly(tmp_path):
    """``python -m llmpar.launch --num_gpus 2 --max_restarts 1`` (``llmpar launch``): rank 1 is SIGKILLed after step
    8 (checkpoints every 3 steps, auto_resume); the agent restarts both ranks, which load step 6 and train on to
    step 12 with the losses (and fp16 loss scales) of an uninterrupted run, bit for bit, on both ranks."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmpar.launch",
            "--num_gpus",
            "2",
            "--max_restarts",
            "1",
            str(script),
            str(tmp_path),
            "12",
            "8",
            "3",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        ref = [json.loads(line) for line in (tmp_path / f"ref{rank}.jsonl").read_text().splitlines()]
        run = [json.loads(line) for line in (tmp_path / f"run{rank}.jsonl").read_text().splitlines()]
        headers = [r for r in run if "start" in r]
        assert [(h["attempt"], h["world"], h["start"]) for h in headers] == [(0, 2, 0), (1, 2, 6)]
        assert headers[0]["resumed_from"] is None and headers[1]["resumed_from"].endswith("global_step6")
        first = [r["step"] for r in run if "step" in r and r["attempt"] == 0]
        assert first == list(range(1, 9)) if rank == 1 else first[:8] == list(range(1, 9))
        final = {r["step"]: (r["loss"], r["scale"]) for r in run if "step" in r}  # the restart's overwrite
        assert [r["step"] for r in run if "step" in r and r["attempt"] == 1] == list(range(7, 13))
        assert final == {r["step"]: (r["loss"], r["scale"]) for r in ref if "step" in r}, rank
        assert len({r["scale"] for r in ref if "step" in r}) > 1  # the loss scale moved (and was restored)
