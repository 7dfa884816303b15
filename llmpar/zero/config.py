"""The typed settings ZeRO reads: :class:`ZeroConfig` (stages, buckets, stage-3 prefetch, offload) and
:class:`OptimizerConfig` (the AdamW hyper-parameters), with DeepSpeed's defaults. Both are ``@dataclass(kw_only=True)``
and check their values on construction; the DeepSpeed JSON spelling of these blocks (aliases, keys llmpar does not
support) is read by ``llmpar.runtime.blocks``, which builds them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch

from llmpar.ops.adamw import check_precision
from llmpar.optim.adamw import check_eps, check_hyperparameters
from llmpar.validation import FLOAT32_MAX, as_bool, as_float, as_int


@dataclass(kw_only=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``: ``device`` "cpu" keeps the tensors in host memory ("none": off)."""

    device: str = "none"
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("none", "cpu"):
            raise ValueError(
                f'offload "device"={self.device!r} must be "cpu" or "none"'
                + (" (NVMe offload is not supported)" if self.device == "nvme" else "")
            )
        self.pin_memory = as_bool("offload.pin_memory", self.pin_memory)

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"

    @classmethod
    def of(cls, value: "OffloadConfig | dict | None") -> "OffloadConfig":
        """An OffloadConfig from itself, a ``{"device": ..., "pin_memory": ...}`` dict, or None (off)."""
        if isinstance(value, OffloadConfig):
            return value
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise TypeError(f"offload settings must be an OffloadConfig or a dict, got {type(value).__name__}")
        return cls(**value)


@dataclass(kw_only=True)
class ZeroConfig:
    """``zero_optimization``. Bucket sizes are in elements, as in DeepSpeed (default 5e8).

    Stage 3 (parameter sharding, ``stage3.py``): ``stage3_prefetch_bucket_size`` elements gathered ahead of use,
    ``stage3_max_live_parameters`` caps gathered elements held by prefetch, units of at most
    ``stage3_param_persistence_threshold`` elements stay gathered; ``stage3_gather_16bit_weights_on_model_save``
    lets ``engine.save_16bit_model`` gather full weights; a unit fewer than ``stage3_max_reuse_distance`` gathered
    elements from its next use stays gathered (DeepSpeed's rule and default, 1e9: models that small are gathered once
    per step, forward to backward; 0: every unit is gathered again for backward except those backward starts with).
    ``sub_group_size`` is accepted and has no effect (the step runs per flat buffer).
    Offload (``offload.py``): ``offload_optimizer`` (stage 1, 2 or 3) keeps the fp32 master, moments and gradient
    partition on the host and steps there (stage 1: the gradient accumulator stays on the device, its reduced
    partition is copied out at the accumulation boundary); ``offload_param`` (stage 3) keeps the parameter shards
    there.
    ``overlap_param_gather`` (llmpar's, off by default; ``param_gather.py``): stages 1-2 launch the all-gather of the
    updated params at the end of ``step()`` and wait for each unit at the next forward, overlapping it; read params
    directly between the two only after ``optimizer.wait_params()``.
    Compressed communication (ZeRO++'s keys; ``llmpar/distributed/compressed.py``): ``zero_quantized_weights``
    (stage 3) all-gathers the params as blockwise int8 codes + fp32 scales, every rank computing with the dequantized
    values; ``zero_hpz_partition_size`` k (stage 3, dividing dp) keeps after forward a secondary shard of each unit
    over the k dp ranks of a node, from which backward gathers inside the node; ``zero_quantized_gradients`` (stages
    2-3) reduce-scatters int4 codes through all-to-alls, summed inside the node first when the dp ranks span several
    nodes (``zero_hpz_partition_size`` or torchrun's ``LOCAL_WORLD_SIZE`` says which). llmpar's own:
    ``zero_quantized_gradients_error_feedback`` carries each rank's compression error (x - dequant) to its next
    reduction, so the error does not accumulate over steps (costs a float32 copy of the gradients per rank, + 1/k of
    it with two levels; not saved in checkpoints: a resumed run restarts it from zero);
    ``zero_quantization_block_size`` values per scale; ``zero_quantized_weights_bits`` /
    ``zero_quantized_gradients_bits`` (8 or 4).
    """

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    overlap_param_gather: bool = False  # llmpar (Megatron's name): stage 1/2 param all-gather waited at next forward
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    sub_group_size: int = 1_000_000_000
    # each given as an OffloadConfig, its JSON dict or None (off); __post_init__ makes it an OffloadConfig, which is
    # what the field holds from then on (the cast only tells the type checker so: the default stays None)
    offload_optimizer: OffloadConfig = cast(OffloadConfig, None)
    offload_param: OffloadConfig = cast(OffloadConfig, None)
    zero_quantized_weights: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_gradients: bool = False
    zero_quantized_gradients_error_feedback: bool = False  # llmpar
    zero_quantization_block_size: int = 256  # llmpar
    zero_quantized_weights_bits: int = 8  # llmpar
    zero_quantized_gradients_bits: int = 4  # llmpar

    def __post_init__(self) -> None:
        self.stage = as_int("zero_optimization.stage", self.stage, minimum=0)
        if self.stage > 3:
            raise ValueError(f'"zero_optimization.stage"={self.stage} must be 0, 1, 2 or 3')
        for name in (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "sub_group_size",
        ):
            setattr(self, name, as_int(f"zero_optimization.{name}", getattr(self, name), minimum=0))
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            setattr(self, name, as_int(f"zero_optimization.{name}", getattr(self, name), minimum=1))
        for name in (
            "overlap_comm",
            "contiguous_gradients",
            "reduce_scatter",
            "stage3_gather_16bit_weights_on_model_save",
        ):
            setattr(self, name, as_bool(f"zero_optimization.{name}", getattr(self, name)))
        self.offload_optimizer = OffloadConfig.of(self.offload_optimizer)
        self.offload_param = OffloadConfig.of(self.offload_param)
        if self.offload_optimizer.enabled and self.stage < 1:
            raise ValueError(f'"zero_optimization.offload_optimizer" needs stage 1, 2 or 3, got stage {self.stage}')
        if self.offload_param.enabled and self.stage != 3:
            raise ValueError(f'"zero_optimization.offload_param" needs stage 3, got stage {self.stage}')
        self._check_compression()

    @classmethod
    def resolve(
        cls, stage: int | None, zero_config: "ZeroConfig | None", *, default_stage: int, where: str = "ZeroOptimizer"
    ) -> "ZeroConfig":
        """The one source of a ZeRO stage: ``zero_config`` (its ``.stage``), or ``stage=`` as the shorthand for
        ``ZeroConfig(stage=stage)`` when no config is given (``default_stage`` when neither is). Both given: the
        config decides; an equal ``stage=`` is accepted with a FutureWarning (it used to be required alongside the
        config), a different one is an error naming both."""
        if zero_config is None:
            return cls(stage=default_stage if stage is None else stage)
        if not isinstance(zero_config, ZeroConfig):
            raise TypeError(f"{where}: zero_config must be a ZeroConfig or None, got {type(zero_config).__name__}")
        if stage is not None:
            if stage != zero_config.stage:
                raise ValueError(
                    f"{where}: stage={stage} disagrees with zero_config.stage={zero_config.stage}; "
                    "pass one of them (zero_config carries the stage)"
                )
            warnings.warn(
                f"{where}: stage= next to zero_config= is redundant (zero_config.stage is the stage); "
                "pass zero_config alone",
                FutureWarning,
                stacklevel=3,
            )
        return zero_config

    def check_dp(self, dp: int) -> None:
        """What can only be checked once the data-parallel degree is known (the runtime config and the optimizer
        both ask): ``zero_hpz_partition_size`` divides it."""
        hpz = self.zero_hpz_partition_size
        if dp % hpz:
            raise ValueError(
                f'"zero_optimization.zero_hpz_partition_size"={hpz} must be a divisor of the '
                f"data-parallel degree dp={dp} (the dp ranks of one node)"
            )

    def _check_compression(self) -> None:
        for name in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_gradients_error_feedback"):
            setattr(self, name, as_bool(f"zero_optimization.{name}", getattr(self, name)))
        self.zero_hpz_partition_size = as_int(
            "zero_optimization.zero_hpz_partition_size", self.zero_hpz_partition_size, minimum=1
        )
        block = as_int("zero_optimization.zero_quantization_block_size", self.zero_quantization_block_size, minimum=1)
        if block & (block - 1) or not 16 <= block <= 4096:
            raise ValueError(
                f'"zero_optimization.zero_quantization_block_size"={block} must be a power of two in [16, 4096]'
            )
        self.zero_quantization_block_size = block
        for name in ("zero_quantized_weights_bits", "zero_quantized_gradients_bits"):
            bits = as_int(f"zero_optimization.{name}", getattr(self, name), minimum=1)
            if bits not in (4, 8):
                raise ValueError(f'"zero_optimization.{name}"={bits} must be 8 or 4')
            setattr(self, name, bits)
        if (self.zero_quantized_weights or self.zero_hpz_partition_size > 1) and self.stage != 3:
            key = "zero_quantized_weights" if self.zero_quantized_weights else "zero_hpz_partition_size"
            raise ValueError(
                f'"zero_optimization.{key}" applies to the stage-3 parameter all-gather: needs stage 3, '
                f"got stage {self.stage}"
            )
        if self.zero_quantized_gradients and self.stage not in (2, 3):
            raise ValueError(
                '"zero_optimization.zero_quantized_gradients" applies to the per-micro-step gradient '
                f"reduce-scatter of stages 2 and 3, got stage {self.stage}"
            )
        if self.zero_quantized_gradients_error_feedback and not self.zero_quantized_gradients:
            raise ValueError(
                '"zero_optimization.zero_quantized_gradients_error_feedback" needs "zero_quantized_gradients": true'
            )
        if self.offload_param.enabled and (self.zero_quantized_weights or self.zero_hpz_partition_size > 1):
            raise ValueError(
                '"zero_optimization.offload_param" cannot be combined with zero_quantized_weights / '
                "zero_hpz_partition_size (the host shards are gathered as they are)"
            )


OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
LOWBIT_TYPES = {"AdamW8bit": "int8", "AdamW4bit": "int4"}  # type -> state_precision (``llmpar.ops.lowbit``)


@dataclass(kw_only=True)
class OptimizerConfig:
    """The AdamW hyper-parameters (decoupled weight decay) run by the fused AdamW step.

    ``type`` "Adam" is AdamW too (DeepSpeed's default ``adam_w_mode``); Adam's L2 mode is not supported.
    ``precision``: a FusedAdamW mode ("auto": fp32 for fp32 params, fp32_master for bf16 ones).
    ``type`` "AdamW8bit" / "AdamW4bit": AdamW with block-quantized 8- / 4-bit moments (``llmpar.ops.lowbit``), i.e.
    ``state_precision`` "int8" / "int4" (which may also be given directly, with type AdamW); float32 params step in
    place, bf16 params keep a float32 master. ``stochastic_rounding`` (low-bit states only): the codes are rounded
    stochastically (unbiased; the torch path), reproducibly from ``seed``, the step count and each element's place in
    its ZeRO unit (``lowbit_state.sr_salt`` / ``sr_offset``): the same codes at any dp degree, and bitwise on a rerun.
    """

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    precision: str = "auto"
    state_precision: str | None = None
    stochastic_rounding: bool = False
    seed: int = 0  # of the stochastic rounding (low-bit codes, and the bf16_sr / bf16 states' rounding)

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or self.type.lower() not in OPTIMIZER_TYPES:
            raise ValueError(f'"optimizer.type"={self.type!r} is not known; use {", ".join(OPTIMIZER_TYPES.values())}')
        self.type = OPTIMIZER_TYPES[self.type.lower()]
        if self.state_precision is not None and self.state_precision not in ("fp32", "int8", "int4"):
            raise ValueError(
                f'"optimizer.params.state_precision"={self.state_precision!r} is not known; use "fp32", '
                '"int8" or "int4" (or the types AdamW8bit / AdamW4bit)'
            )
        implied = LOWBIT_TYPES.get(self.type)
        if implied is not None:
            if self.state_precision not in (None, implied):
                raise ValueError(
                    f'"optimizer.type"={self.type!r} keeps {implied} states but '
                    f'"optimizer.params.state_precision" is {self.state_precision!r}'
                )
            self.state_precision = implied
        if self.state_precision == "fp32":
            self.state_precision = None
        if self.state_precision is not None and self.precision != "auto":
            raise ValueError(
                f'"optimizer.params.precision"={self.precision!r} cannot be combined with '
                f'{self.state_precision} states (type {self.type}): leave precision "auto" (float32 '
                "params step in place, bf16 ones keep a float32 master)"
            )
        self.stochastic_rounding = as_bool("optimizer.params.stochastic_rounding", self.stochastic_rounding)
        if self.stochastic_rounding and self.state_precision is None:
            raise ValueError(
                '"optimizer.params.stochastic_rounding"=true applies to the 8- / 4-bit states (types '
                f"AdamW8bit / AdamW4bit), not to type {self.type!r} with fp32 states (bf16 params and "
                'moments with stochastic rounding: "precision": "bf16_sr")'
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise TypeError(f'"optimizer.params.seed"={self.seed!r} must be an integer in [0, 2^63)')
        self.lr = as_float("optimizer.params.lr", self.lr, minimum=0.0, maximum=FLOAT32_MAX)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise ValueError(f'"optimizer.params.betas"={self.betas!r} must be two numbers in [0, 1)')
        beta1, beta2 = (as_float("optimizer.params.betas", b, minimum=0.0, below=1.0) for b in self.betas)
        self.betas = (beta1, beta2)
        self.eps = check_eps('"optimizer.params.eps"', as_float("optimizer.params.eps", self.eps))
        self.weight_decay = as_float(
            "optimizer.params.weight_decay", self.weight_decay, minimum=0.0, maximum=FLOAT32_MAX
        )
        try:
            check_precision(self.precision, allow_auto=True)
        except ValueError as e:
            raise ValueError(f'"optimizer.params.precision": {e}') from None


__all__ = ["LOWBIT_TYPES", "OPTIMIZER_TYPES", "OffloadConfig", "OptimizerConfig", "ZeroConfig", "param_groups"]


_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def param_groups(params: Any, cfg: OptimizerConfig) -> list[dict]:
    """Normalise params / (name, param) pairs / param-group dicts into groups with names and hyper-parameters."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of parameters, (name, parameter) pairs or param-group dicts, "
            "got a single tensor"
        )
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
            raise ValueError(
                f"param group {gi} has unknown keys {sorted(unknown)}; allowed: params, {', '.join(_GROUP_KEYS)}"
            )
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
        check_hyperparameters(
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            where=f"param group {gi}: ",
        )  # overrides too
        groups.append(group)
    return groups
