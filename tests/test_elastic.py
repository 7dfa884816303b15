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
    return torch.utils.data.TensorDataset(torch.randn(n, 5, generator=g, dtype=torch.float64),
                                          torch.randn(n, 1, generator=g, dtype=torch.float64))


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.02}},
            "zero_optimization": {"stage": 1}, **extra}


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


def test_position_at_another_dp():
    """The DistributedSampler interleaves its ranks: after each of 2 ranks handed out 2 batches of 3, the first 12
    indices of the epoch's permutation are used; a 1-rank loader resumed there goes on with index 12."""
    data = _data(29)
    order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    positions = []
    for rank in (0, 1):
        loader = ResumableLoader(data, batch_size=3, sampler=torch.utils.data.DistributedSampler(
            data, num_replicas=2, rank=rank))
        it = iter(loader)
        next(it), next(it)
        positions.append(loader.position(2))
    assert positions == [{"epoch": 0, "samples": 6, "replicas": 2}] * 2
    one = ResumableLoader(data, batch_size=4, sampler=torch.utils.data.DistributedSampler(data, num_replicas=1,
                                                                                          rank=0))
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
    for value, kind, match in ((3, TypeError, r'"checkpoint.auto_resume"=3: expected a directory path'),
                               ("  ", ValueError, r'"checkpoint.auto_resume"=.*non-empty')):
        with pytest.raises(kind, match=match):
            _engine(_config(checkpoint={"auto_resume": value}))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r'"checkpoint.auto_resume"=.*file.* is not a directory'):
        _engine(_config(checkpoint={"auto_resume": str(tmp_path / "file")}))
