"""Training parity of the low-precision modes: a small GPT (2 layers, d=64, byte vocabulary, Shakespeare) trained
300 steps with bf16 params ends within 0.01 nats of fp32 AdamW's held-out loss with FusedAdamW "fp32_master",
"bf16_sr" and "bf16_kahan", while plain bf16 AdamW (torch fused, round to nearest) drifts at least 0.02 nats away
and at least 3x further than the worst of them (measured here: ~+0.0003 / +0.0009 / +0.0002 vs +0.034)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from llmpar.models import GPT, GPTConfig, lm_loss
from llmpar.optim import FusedAdamW

STEPS, B, T, LR = 300, 8, 64, 1e-3
TOL = 0.01


def _data():
    text = (Path(__file__).resolve().parents[1] / "llmpar" / "data" / "shakespeare.txt").read_bytes()
    data = torch.tensor(list(text), dtype=torch.int64)
    starts = torch.randint(0, len(data) - T - 1, (STEPS, B), generator=torch.Generator().manual_seed(0))
    held_out = torch.randint(0, len(data) - T - 1, (16,), generator=torch.Generator().manual_seed(1))
    batch = lambda s: (torch.stack([data[i : i + T] for i in s]), torch.stack([data[i + 1 : i + T + 1] for i in s]))
    return [batch(s) for s in starts], batch(held_out)


def _train(kind, batches, held_out):
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=T)
    model = GPT(cfg, seed=0, dtype=torch.float32 if kind == "fp32" else torch.bfloat16)
    if kind in ("fp32", "bf16_rn"):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    else:
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.1, precision=kind, seed=0)
    for x, y in batches:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return lm_loss(model(held_out[0]), held_out[1]).item()


def _train_modes(kinds, out=None):
    """{mode: held-out loss} of the trainings of ``kinds``, one thread (the machine is shared; one thread keeps each
    ~4 s and deterministic); into queue ``out`` when given (a second process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches, held_out = _data()
        losses = {k: _train(k, batches, held_out) for k in kinds}
    finally:
        torch.set_num_threads(threads)
    if out is not None:
        out.put(losses)
    return losses


@pytest.mark.slow(
    reason="five 300-step trainings of a small GPT: round-to-nearest bf16 drifts from fp32 only over a few hundred "
    "steps, and that drift is what the precision modes are checked against"
)
def test_low_precision_modes_match_fp32_where_bf16_rounding_drifts():
    # two of the five trainings in a second process (from the forkserver, as the rank pools start it), three here:
    # independent single-thread runs, so the losses are the same as five in a row, on both cores
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    queue = ctx.Queue()
    child = ctx.Process(target=_train_modes, args=(("bf16_sr", "bf16_kahan"), queue), daemon=True)
    child.start()
    try:
        losses = _train_modes(("fp32", "fp32_master", "bf16_rn"))
        losses.update(queue.get(timeout=300))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    losses = {k: losses[k] for k in ("fp32", "fp32_master", "bf16_sr", "bf16_kahan", "bf16_rn")}
    gaps = {k: abs(v - losses["fp32"]) for k, v in losses.items() if k != "fp32"}
    report = ", ".join(f"{k} {v:.4f} ({v - losses['fp32']:+.4f})" for k, v in losses.items())
    assert losses["fp32"] < 3.0, f"the model did not learn: {report}"
    for mode in ("fp32_master", "bf16_sr", "bf16_kahan"):
        assert gaps[mode] <= TOL, f"{mode} ends {gaps[mode]:.4f} nats from fp32 (> {TOL}): {report}"
    worst = max(gaps[m] for m in ("fp32_master", "bf16_sr", "bf16_kahan"))
    assert gaps["bf16_rn"] >= max(2 * TOL, 3 * worst), f"plain bf16 AdamW should drift further: {report}"
