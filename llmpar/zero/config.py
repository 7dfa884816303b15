"""Configs ZeRO reads: the ``zero_optimization`` block and the optimizer block (DeepSpeed's keys and defaults).

Both are ``@dataclass(kw_only=True)``; ``from_dict`` takes DeepSpeed's JSON spelling, checks types and ranges, and turns
an unknown key into an error naming the nearest valid key (a known DeepSpeed key llmpar does not support yet is an
error saying so).
"""
from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, fields
from typing import Any

import torch

STAGE3_ISSUE = "not supported (use offload_optimizer / offload_param)"

# zero_optimization keys DeepSpeed knows that llmpar does not support -> why
_ZERO_UNSUPPORTED = {
    "cpu_offload": "the legacy spelling is not supported: use \"offload_optimizer\": {\"device\": \"cpu\"}",
    "cpu_offload_params": "the legacy spelling is not supported: use \"offload_param\": {\"device\": \"cpu\"}",
    "cpu_offload_use_pin_memory": "the legacy spelling is not supported: use \"offload_optimizer\": {\"pin_memory\": true}",
    "stage3_module_granularity_threshold": "not supported (sharding units are modules: see stage3_unit_policy)",
    "zero_hpz_partition_size": "hierarchical partitioning (ZeRO++) is not supported",
    "zero_quantized_weights": "quantized communication (ZeRO++) is not supported",
    "zero_quantized_gradients": "quantized communication (ZeRO++) is not supported",
    "mics_shard_size": "MiCS is not supported", "mics_hierarchical_params_gather": "MiCS is not supported",
    "elastic_checkpoint": "not needed: llmpar checkpoints load at any dp / tp / pp degree",
    "load_from_fp32_weights": "not supported: llmpar checkpoints restore the fp32 master when saved with one (else it is derived from the params)",
    "round_robin_gradients": "not supported", "ignore_unused_parameters": "not supported (unused params get zero grads)",
    "legacy_stage1": "not supported", "use_multi_rank_bucket_allreduce": "not supported",
    "allgather_partitions": "not supported (llmpar always all-gathers the updated partitions)",
}


def nearest(key: str, valid: list[str]) -> str:
    """' (did you mean "x"?)' for the closest valid key, or '' when nothing is close."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def check_keys(block: str, given: dict, valid: list[str], unsupported: dict[str, str] | None = None) -> None:
    if not isinstance(given, dict):
        raise TypeError(f'"{block}" must be a JSON object (dict), got {type(given).__name__}')
    for key in given:
        if unsupported and key in unsupported:
            raise ValueError(f'"{block}.{key}" is a DeepSpeed key llmpar does not support: {unsupported[key]}')
        if key not in valid:
            raise ValueError(f'unknown key "{block}.{key}"{nearest(key, valid)}; valid keys: {", ".join(sorted(valid))}')


def as_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or float(value) != int(value):
        raise TypeError(f'"{name}" must be an integer, got {value!r}')
    value = int(value)  # DeepSpeed writes bucket sizes as 5e8: accept integral floats
    if minimum is not None and value < minimum:
        raise ValueError(f'"{name}"={value} must be >= {minimum}')
    return value


def as_float(name: str, value: Any, *, minimum: float | None = None, below: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f'"{name}" must be a number, got {value!r}')
    value = float(value)
    if value != value or (minimum is not None and value < minimum) or (below is not None and value >= below):
        bounds = f">= {minimum}" if minimum is not None else ""
        bounds += (" and " if bounds and below is not None else "") + (f"< {below}" if below is not None else "")
        raise ValueError(f'"{name}"={value} must be {bounds}')
    return value


def as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f'"{name}" must be true or false, got {value!r}')
    return value


_OFFLOAD_UNSUPPORTED = {"buffer_count": "NVMe offload is not supported", "buffer_size": "NVMe offload is not supported",
                        "max_in_cpu": "NVMe offload is not supported", "nvme_path": "NVMe offload is not supported",
                        "pipeline_read": "NVMe offload is not supported", "pipeline_write": "NVMe offload is not supported",
                        "fast_init": "not supported", "ratio": "partial offload is not supported"}


@dataclass(kw_only=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``: ``device`` "cpu" keeps the tensors in host memory ("none": off)."""

    device: str = "none"
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("none", "cpu"):
            raise ValueError(f'offload "device"={self.device!r} must be "cpu" or "none"'
                             + (" (NVMe offload is not supported)" if self.device == "nvme" else ""))
        self.pin_memory = as_bool("offload.pin_memory", self.pin_memory)

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"

    @classmethod
    def from_dict(cls, block: str, d: Any) -> "OffloadConfig":
        if isinstance(d, OffloadConfig):
            return d
        if d is None:
            return cls()
        check_keys(block, d, ["device", "pin_memory"], _OFFLOAD_UNSUPPORTED)
        return cls(**d)


@dataclass(kw_only=True)
class ZeroConfig:
    """``zero_optimization``. Bucket sizes are in elements, as in DeepSpeed (default 5e8).

    Stage 3 (parameter sharding, ``stage3.py``): ``stage3_prefetch_bucket_size`` elements gathered ahead of use,
    ``stage3_max_live_parameters`` caps gathered elements held by prefetch, units of at most
    ``stage3_param_persistence_threshold`` elements stay gathered; ``stage3_gather_16bit_weights_on_model_save``
    lets ``engine.save_16bit_model`` gather full weights. ``stage3_max_reuse_distance`` and ``sub_group_size`` are
    accepted and have no effect (units are freed after use; the step runs per flat buffer).
    Offload (``offload.py``): ``offload_optimizer`` (stage 2 or 3) keeps the fp32 master, moments and gradient
    partition on the host and steps there; ``offload_param`` (stage 3) keeps the parameter shards there.
    """

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OffloadConfig | dict | None = None
    offload_param: OffloadConfig | dict | None = None

    def __post_init__(self) -> None:
        self.stage = as_int("zero_optimization.stage", self.stage, minimum=0)
        if self.stage > 3:
            raise ValueError(f'"zero_optimization.stage"={self.stage} must be 0, 1, 2 or 3')
        for name in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size"):
            setattr(self, name, as_int(f"zero_optimization.{name}", getattr(self, name), minimum=0))
        self.stage3_gather_16bit_weights_on_model_save = as_bool(
            "zero_optimization.stage3_gather_16bit_weights_on_model_save", self.stage3_gather_16bit_weights_on_model_save)
        self.offload_optimizer = OffloadConfig.from_dict("zero_optimization.offload_optimizer", self.offload_optimizer)
        self.offload_param = OffloadConfig.from_dict("zero_optimization.offload_param", self.offload_param)
        if self.offload_optimizer.enabled and self.stage < 2:
            raise ValueError(f'"zero_optimization.offload_optimizer" needs stage 2 or 3, got stage {self.stage}')
        if self.offload_param.enabled and self.stage != 3:
            raise ValueError(f'"zero_optimization.offload_param" needs stage 3, got stage {self.stage}')
        self.reduce_bucket_size = as_int("zero_optimization.reduce_bucket_size", self.reduce_bucket_size, minimum=1)
        self.allgather_bucket_size = as_int("zero_optimization.allgather_bucket_size", self.allgather_bucket_size,
                                            minimum=1)
        for name in ("overlap_comm", "contiguous_gradients", "reduce_scatter"):
            setattr(self, name, as_bool(f"zero_optimization.{name}", getattr(self, name)))

    @classmethod
    def from_dict(cls, d: dict) -> "ZeroConfig":
        d = dict(d) if isinstance(d, dict) else d
        if isinstance(d, dict) and "stage3_gather_fp16_weights_on_model_save" in d:  # DeepSpeed's older alias
            if "stage3_gather_16bit_weights_on_model_save" in d:
                raise ValueError('give "stage3_gather_16bit_weights_on_model_save" or its alias '
                                 '"stage3_gather_fp16_weights_on_model_save", not both')
            d["stage3_gather_16bit_weights_on_model_save"] = d.pop("stage3_gather_fp16_weights_on_model_save")
        check_keys("zero_optimization", d, [f.name for f in fields(cls)], _ZERO_UNSUPPORTED)
        return cls(**d)


_OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam"}
_UNSUPPORTED_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Lion", "Adagrad", "Muon", "SGD")


@dataclass(kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` block: AdamW (decoupled weight decay) run by the fused AdamW step.

    ``type`` "Adam" with ``adam_w_mode`` true (DeepSpeed's default) is AdamW too; Adam's L2 mode is not supported.
    ``precision``: a FusedAdamW mode ("auto": fp32 for fp32 params, fp32_master for bf16 ones).
    """

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    precision: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or self.type.lower() not in _OPTIMIZER_TYPES:
            hint = nearest(str(self.type), list(_OPTIMIZER_TYPES.values()))
            if isinstance(self.type, str) and self.type.lower() in {t.lower() for t in _UNSUPPORTED_OPTIMIZERS}:
                raise ValueError(f'"optimizer.type"={self.type!r} is a DeepSpeed optimizer llmpar does not support; '
                                 "use AdamW or Adam")
            raise ValueError(f'"optimizer.type"={self.type!r} is not known{hint}; use AdamW or Adam')
        self.type = _OPTIMIZER_TYPES[self.type.lower()]
        self.lr = as_float("optimizer.params.lr", self.lr, minimum=0.0)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise ValueError(f'"optimizer.params.betas"={self.betas!r} must be two numbers in [0, 1)')
        self.betas = tuple(as_float("optimizer.params.betas", b, minimum=0.0, below=1.0) for b in self.betas)
        self.eps = as_float("optimizer.params.eps", self.eps, minimum=0.0)
        self.weight_decay = as_float("optimizer.params.weight_decay", self.weight_decay, minimum=0.0)
        from llmpar.ops.adamw import PRECISIONS

        if self.precision != "auto" and self.precision not in PRECISIONS:
            raise ValueError(f'"optimizer.params.precision"={self.precision!r} is not a mode; use auto or one of '
                             f"{', '.join(PRECISIONS)}")

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerConfig":
        check_keys("optimizer", d, ["type", "params"])
        if "type" not in d:
            raise ValueError('"optimizer" needs a "type" (AdamW or Adam)')
        params = dict(d.get("params", {}))
        check_keys("optimizer.params", params,
                   ["lr", "betas", "eps", "weight_decay", "precision", "adam_w_mode", "torch_adam", "fused", "bias_correction"],
                   {"amsgrad": "AMSGrad is not supported"})
        if params.pop("adam_w_mode", True) is not True:
            raise ValueError('"optimizer.params.adam_w_mode"=false (Adam with L2 regularisation) is not supported; '
                             "llmpar runs AdamW (decoupled weight decay)")
        if params.pop("bias_correction", True) is not True:
            raise ValueError('"optimizer.params.bias_correction"=false is not supported')
        params.pop("torch_adam", None)  # DeepSpeed implementation switches: llmpar always runs its fused step
        params.pop("fused", None)
        return cls(type=d["type"], **params)


def optimizer_field_names() -> list[str]:
    return [f.name for f in fields(OptimizerConfig)]


__all__ = ["OffloadConfig", "OptimizerConfig", "ZeroConfig", "STAGE3_ISSUE", "check_keys", "nearest", "as_int", "as_float",
           "as_bool", "param_groups"]


_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def param_groups(params: Any, cfg: OptimizerConfig) -> list[dict]:
    """Normalise params / (name, param) pairs / param-group dicts into groups with names and hyper-parameters."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of parameters, (name, parameter) pairs or param-group dicts, "
                        "got a single tensor")
    items = list(params)
    if not items:
        raise ValueError("params is empty: ZeroOptimizer needs at least one parameter")
    raw = items if isinstance(items[0], dict) else [{"params": items}]
    groups, seen = [], set()
    for gi, g in enumerate(raw):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param group {gi} must be a dict with a 'params' entry")
        unknown = set(g) - {"params", *_GROUP_KEYS}
        if unknown:
            raise ValueError(f"param group {gi} has unknown keys {sorted(unknown)}; allowed: params, "
                             f"{', '.join(_GROUP_KEYS)}")
        named = []
        for k, item in enumerate(g["params"]):
            name, p = item if isinstance(item, tuple) else (f"group{gi}.param{k}", item)
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {gi} item {k} is a {type(p).__name__}, not a tensor")
            if id(p) in seen:
                continue  # tied weights: one entry
            seen.add(id(p))
            named.append((name, p))
        group = {"params": [p for _, p in named], "names": [n for n, _ in named]}
        for key in _GROUP_KEYS:
            group[key] = g.get(key, getattr(cfg, key))
        groups.append(group)
    return groups
