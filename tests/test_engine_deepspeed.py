"""llmpar.initialize vs deepspeed.initialize: the same GPT, data and DeepSpeed config give the same losses for 20 steps
(ZeRO stages 1 and 2, dp=2, gradient accumulation, clipping, WarmupDecayLR) on CPU/gloo ranks.

DeepSpeed runs with its CPU accelerator, on the gloo group the harness already made, with ``torch_adam`` (no C++ op
build) and its shared-memory comm op switched off (it would be JIT-compiled).
"""

import os

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

STEPS = 20
GAS = 2
MICRO = 2
SEQ = 16


def _config(stage, bf16=False):
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 5, "total_num_steps": STEPS, "warmup_max_lr": 1e-2, "warmup_type": "linear"},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 20000,
            "allgather_bucket_size": 20000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
        },
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
    }


def _model():
    from llmpar.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=24, seq_len=SEQ), seed=3)


def _batch(step, micro, rank):
    """Learnable sequences: x[t+1] = (5 x[t] + 3) mod 61 from a random start."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.empty(MICRO, SEQ + 1, dtype=torch.int64)
    x[:, 0] = torch.randint(0, 61, (MICRO,), generator=g)
    for t in range(SEQ):
        x[:, t + 1] = (5 * x[:, t] + 3) % 61
    return x[:, :-1], x[:, 1:]


def _train(engine, rank):
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            x, y = _batch(step, micro, rank)
            loss = engine.module.loss(engine(x), y).float()
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def both_body(stage, bf16):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    import llmpar

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's CPU comm op
    rank = dist.get_rank()
    cfg = _config(stage, bf16)
    engine, _, _, _ = llmpar.initialize(model=_model(), config=cfg)
    ours = _train(engine, rank)
    ds_cfg = {**cfg, "optimizer": {**cfg["optimizer"], "params": {**cfg["optimizer"]["params"], "torch_adam": True}}}
    ds_engine, _, _, _ = deepspeed.initialize(model=_model(), model_parameters=None, config=ds_cfg)
    theirs = _train(ds_engine, rank)
    return ours, theirs


@pytest.mark.parametrize("stage", [1, 2])
def test_matches_deepspeed_losses_fp32(stage):
    ours, theirs = run_ranks(both_body, 2, stage, False, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-5)
    assert ours[-1] < 0.8 * ours[0]


def test_matches_deepspeed_losses_bf16_stage2():
    """bf16 params, fp32 master weights: the two reduce in bf16 with different orders: bf16-level agreement."""
    ours, theirs = run_ranks(both_body, 2, 2, True, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-2, atol=1e-2)
    assert ours[-1] < 0.8 * ours[0]
