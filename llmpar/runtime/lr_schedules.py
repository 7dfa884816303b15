"""``deepspeed.runtime.lr_schedules`` for DeepSpeed scripts: DeepSpeed's schedule classes with its constructor
signatures, over llmpar's one implementation (:class:`~llmpar.runtime.schedules.WarmupSchedule`, the formulas of the
config's ``"scheduler"`` block).

    from llmpar.runtime.lr_schedules import WarmupLR        # was: from deepspeed.runtime.lr_schedules import WarmupLR
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = WarmupDecayLR(opt, total_num_steps=1000, warmup_max_lr=3e-4, warmup_num_steps=100)
    engine, *_ = llmpar.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)

``optimizer``: anything with ``param_groups`` (a torch optimizer, ``engine.optimizer``). ``warmup_min_lr`` /
``warmup_max_lr`` / ``warmup_min_ratio`` take one value or one per param group, as DeepSpeed's. An unknown
``warmup_type`` is an error (DeepSpeed warns and uses "log"). ``LRRangeTest`` and ``OneCycle`` are DeepSpeed schedules
llmpar does not implement: constructing one raises ``NotImplementedError`` saying so.
"""

from __future__ import annotations

from typing import Any

from llmpar.runtime.schedules import SchedulerConfig, WarmupSchedule

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = (LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR)
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _per_group(optimizer: Any, value: Any, name: str) -> list[float]:
    """``value`` for every param group (a list / tuple must have one per group, as DeepSpeed's ``_format_param``)."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}={list(value)} has {len(value)} values but the optimizer has {n} param groups")
        return [float(v) for v in value]
    return [float(value)] * n


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(getattr(optimizer, "param_groups", None), list) or not optimizer.param_groups:
        raise TypeError(
            f"optimizer must have a non-empty param_groups list (a torch optimizer or engine.optimizer), "
            f"got {type(optimizer).__name__}"
        )


class WarmupLR(WarmupSchedule):
    """lr from ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr) over ``warmup_num_steps``, then
    constant."""

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list = 0.0,
        warmup_max_lr: float | list | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        self._setup(
            optimizer,
            WARMUP_LR,
            warmup_min_lr,
            warmup_max_lr,
            last_batch_iteration,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
        )

    def _setup(
        self, optimizer: Any, typ: str, min_lr: Any, max_lr: Any, last_batch_iteration: int, **params: Any
    ) -> None:
        cfg = SchedulerConfig(type=typ, **params)
        mins = _per_group(optimizer, min_lr, "warmup_min_lr")
        maxs = (
            [g["lr"] for g in optimizer.param_groups]
            if max_lr is None
            else _per_group(optimizer, max_lr, "warmup_max_lr")
        )
        for name, values in (("warmup_min_lr", mins), ("warmup_max_lr", maxs)):
            if any(v < 0 for v in values):
                raise ValueError(f"{name}={values} must be >= 0")
        super().__init__(optimizer, cfg, last_batch_iteration)
        self.min_lrs, self.max_lrs = mins, [float(v) for v in maxs]
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps, self.warmup_type = self.warmup, cfg.warmup_type
        self._last_lr = self._apply()


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to ``warmup_min_lr`` at ``total_num_steps`` (``warmup_max_lr``
    defaults to 0.001, as DeepSpeed's)."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list = 0.0,
        warmup_max_lr: float | list = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        self._setup(
            optimizer,
            WARMUP_DECAY_LR,
            warmup_min_lr,
            warmup_max_lr,
            last_batch_iteration,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
            total_num_steps=total_num_steps,
        )
        self.total_num_steps = self.config.total_num_steps


class WarmupCosineLR(WarmupSchedule):
    """Each group's lr times a ratio: from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then a cosine down to
    ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        cfg = SchedulerConfig(
            type=WARMUP_COSINE_LR,
            total_num_steps=total_num_steps,
            warmup_min_ratio=warmup_min_ratio,
            warmup_num_steps=warmup_num_steps,
            cos_min_ratio=cos_min_ratio,
            warmup_type=warmup_type,
        )
        super().__init__(optimizer, cfg, last_batch_iteration)
        self.total_num_steps, self.warmup_num_steps = cfg.total_num_steps, self.warmup
        self.warmup_min_ratio, self.cos_min_ratio, self.warmup_type = (
            cfg.warmup_min_ratio,
            cfg.cos_min_ratio,
            cfg.warmup_type,
        )
        self.org_lrs = list(self.base_lrs)


class _NotImplemented:
    """A DeepSpeed schedule llmpar does not implement: constructing it raises with what to use instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"deepspeed.runtime.lr_schedules.{type(self).__name__} is not implemented by llmpar: "
            f"use {', '.join((WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR))} from "
            "llmpar.runtime.lr_schedules, or a torch LR scheduler (torch.optim.lr_scheduler."
            "OneCycleLR / LambdaLR) passed as initialize(lr_scheduler=)"
        )


class LRRangeTest(_NotImplemented):
    """DeepSpeed's LR range test: not implemented (constructing it raises ``NotImplementedError``)."""


class OneCycle(_NotImplemented):
    """DeepSpeed's 1-cycle schedule: not implemented (constructing it raises ``NotImplementedError``)."""


def get_torch_optimizer(optimizer: Any) -> Any:
    """The object holding the param groups (DeepSpeed's helper): ``optimizer`` itself, or its ``.optimizer``."""
    if isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(getattr(inner, "param_groups", None), list):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups (nor an .optimizer with them)")


__all__ = [
    "LRRangeTest",
    "OneCycle",
    "VALID_LR_SCHEDULES",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "get_torch_optimizer",
]
