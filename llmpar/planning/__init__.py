"""Planning tools: compute-optimal sizing (Chinchilla), per-rank memory and communication estimates, and a layout
planner that ranks the (tp, pp, dp, ZeRO, offload, recompute) layouts that fit a cluster."""

from __future__ import annotations

from .chinchilla import ChinchillaResult, chinchilla, flops_per_token, time_to_train
from .comm import AxisComm, estimate_comm
from .memory import (
    PRECISION_BYTES,
    Layout,
    MemoryEstimate,
    activation_bytes_per_layer,
    estimate_memory,
    model_state_bytes,
    zero_savings,
)
from .model_spec import ModelSpec, count_params
from .planner import PlanRequest, PlanResult, PlanRow, evaluate, plan, smallest_cluster
from .presets import GPU_PRESETS, MODEL_PRESETS, Hardware, load_gpu, load_model
from .units import parse_bytes

__all__ = [
    "AxisComm",
    "ChinchillaResult",
    "GPU_PRESETS",
    "Hardware",
    "Layout",
    "MODEL_PRESETS",
    "MemoryEstimate",
    "ModelSpec",
    "PRECISION_BYTES",
    "PlanRequest",
    "PlanResult",
    "PlanRow",
    "activation_bytes_per_layer",
    "chinchilla",
    "count_params",
    "estimate_comm",
    "estimate_memory",
    "evaluate",
    "flops_per_token",
    "load_gpu",
    "load_model",
    "model_state_bytes",
    "parse_bytes",
    "plan",
    "smallest_cluster",
    "time_to_train",
    "zero_savings",
]
