"""The ``"fp16"`` block turned into what the engine runs: the model in float16 (fp32 masters in the optimizer, the
``fp32_master`` mode of the fused AdamW) and a :class:`llmpar.zero.loss_scale.LossScaler` handed to the
ZeroOptimizer, which unscales inside its step; ``Engine.backward`` multiplies the loss by the scale.

    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "consecutive_hysteresis": false, "min_loss_scale": 1}

``loss_scale`` 0 is dynamic scaling (DeepSpeed's ``DynamicLossScaler``), > 0 a fixed scale. The scaler's state
travels with checkpoints in the engine's counters (``Engine.checkpoint_counters``).
"""

from __future__ import annotations

import torch

from llmpar.runtime.blocks import Fp16Config
from llmpar.zero.loss_scale import LossScaler


def model_dtype(bf16: bool, fp16: Fp16Config) -> torch.dtype | None:
    """The dtype the model's params are put in (None: as given); ``Blocks.parse`` refuses bf16 and fp16 together."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16.enabled else None


def build_loss_scaler(fp16: Fp16Config) -> LossScaler | None:
    """The scaler of an enabled ``"fp16"`` block (None when fp16 is off)."""
    if not fp16.enabled:
        return None
    return LossScaler(
        loss_scale=fp16.loss_scale,
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_loss_scale=fp16.min_loss_scale,
    )


__all__ = ["build_loss_scaler", "model_dtype"]
