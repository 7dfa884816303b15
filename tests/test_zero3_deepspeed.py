"""llmpar ZeRO-3 vs DeepSpeed ZeRO-3 (CPU accelerator, gloo): same GPT, data and config -> same losses for 20 steps
(dp=2, gradient accumulation, clipping, WarmupDecayLR, params sharded: persistence threshold 0); and ZeRO-1 with
offload_optimizer, which DeepSpeed accepts too."""

import pytest
import torch

from multirank import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

import test_engine_deepspeed as base  # noqa: E402


def stage3_body(offload):
    cfg = base._config(3)
    cfg["zero_optimization"] = {
        **cfg["zero_optimization"],
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 5000,
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    orig = base._config
    base._config = lambda stage, bf16=False: cfg
    try:
        return base.both_body(3, False)
    finally:
        base._config = orig


@pytest.mark.parametrize("offload", [False, True])
def test_stage3_matches_deepspeed_stage3(offload):
    ours, theirs = run_ranks(stage3_body, 2, offload, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-5)
    assert ours[-1] < 0.8 * ours[0]


def offload_body(stage):
    cfg = base._config(stage)
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "offload_optimizer": {"device": "cpu"}}
    orig = base._config
    base._config = lambda stage, bf16=False: cfg
    try:
        return base.both_body(stage, False)
    finally:
        base._config = orig


def test_stage1_offload_optimizer_matches_deepspeed():
    ours, theirs = run_ranks(offload_body, 2, 1, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-5)
    assert ours[-1] < 0.8 * ours[0]
