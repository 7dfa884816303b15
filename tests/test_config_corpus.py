"""A corpus of DeepSpeed configs in the shapes DeepSpeed's examples and docs use (tests/data/ds_configs/, written for
these tests): every one parses, or fails with a precise error naming the key and what is not supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpar.runtime import Config

CORPUS = Path(__file__).parent / "data" / "ds_configs"
EXPECTED: dict[str, str] = json.loads((CORPUS / "expected.json").read_text())


def test_the_corpus_is_complete():
    files = sorted(p.name for p in CORPUS.glob("*.json") if p.name != "expected.json")
    assert files == sorted(EXPECTED) and len(files) >= 60


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_config(name):
    expect = EXPECTED[name]
    if expect == "ok":
        cfg = Config.from_deepspeed(CORPUS / name, dp=2)
        assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * 2
        return
    with pytest.raises((ValueError, TypeError)) as info:
        Config.from_deepspeed(CORPUS / name, dp=2)
    msg = str(info.value)
    assert expect in msg, msg
    assert any(k in msg for k in ("not supported", "does not support", "did you mean", "must be", "needs stage")), msg


def test_inert_keys_change_nothing():
    """A config with every accepted default / disabled key types exactly like the same config without them."""
    lean = {
        "train_batch_size": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    noisy = {
        **lean,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "gradient_predivide_factor": 1.0,
        "tensorboard": {"enabled": False, "output_path": "x"},
        "fp16": {"enabled": False},
        "amp": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"tag_validation": "Fail"},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": True}},
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "cpu_offload": False,
            "ignore_unused_parameters": True,
            "round_robin_gradients": False,
        },
    }
    a, b = Config.from_deepspeed(lean, dp=2), Config.from_deepspeed(noisy, dp=2)
    for field in ("train_batch_size", "optimizer", "zero", "bf16", "fp16", "scheduler", "gradient_clipping"):
        assert getattr(a, field) == getattr(b, field), field


def test_legacy_cpu_offload_spelling_means_offload_optimizer():
    cfg = Config.from_deepspeed(
        {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True},
        },
        dp=2,
    )
    assert cfg.zero.offload_optimizer.enabled and cfg.zero.offload_optimizer.pin_memory
    with pytest.raises(ValueError, match="disagree"):
        Config.from_deepspeed(
            {
                "train_batch_size": 16,
                "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}},
            },
            dp=2,
        )
