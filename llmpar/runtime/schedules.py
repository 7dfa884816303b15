"""DeepSpeed's learning-rate schedules (``scheduler`` block), with DeepSpeed 0.19's formulas, step for step.

t = last_batch_iteration (-1 before the first ``step()``; the constructor already writes the lr for t = -1, i.e. the
lr of the first optimizer step), W = max(2, warmup_num_steps), T = total_num_steps:

    warm(t)  = log(t + 1) / log(W)   (warmup_type "log", the default)   or   t / W   ("linear"),  for 0 <= t < W
    WarmupLR:        lr = min_lr + (max_lr - min_lr) * (warm(t) if t < W else 1);   t = -1: min_lr
    WarmupDecayLR:   as WarmupLR while t < W, then  (max_lr - min_lr) * max(0, (T - t) / max(1, T - W)) + min_lr
    WarmupCosineLR:  lr = base_lr * ratio;  t < W: ratio = min_ratio + warm(t) (1 - min_ratio);
                     else p = min(1, (t - W + 1) / max(1, T - W)),
                          ratio = max(0, cos_min + (1 - cos_min)(1+cos(pi p))/2);
                     t = -1: 0
Defaults as DeepSpeed's: WarmupLR max_lr = the optimizer's lr; WarmupDecayLR max_lr = 0.001 (not the optimizer's lr).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmpar.validation import as_float, as_int, nearest

SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_UNSUPPORTED = ("LRRangeTest", "OneCycle", "WarmupCosineDecayLR")


@dataclass(kw_only=True)
class SchedulerConfig:
    """The ``scheduler`` block. ``None`` fields take the schedule's DeepSpeed default."""

    type: str
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    total_num_steps: int | None = None
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 0.0001

    def __post_init__(self) -> None:
        if self.type not in SCHEDULES:
            if self.type in _UNSUPPORTED:
                raise ValueError(
                    f'"scheduler.type"={self.type!r} is a DeepSpeed schedule llmpar does not support; '
                    f"use one of {', '.join(SCHEDULES)}"
                )
            raise ValueError(
                f'"scheduler.type"={self.type!r} is not known{nearest(str(self.type), list(SCHEDULES))}; '
                f"use one of {', '.join(SCHEDULES)}"
            )
        self.warmup_num_steps = as_int("scheduler.params.warmup_num_steps", self.warmup_num_steps, minimum=1)
        self.warmup_min_lr = as_float("scheduler.params.warmup_min_lr", self.warmup_min_lr, minimum=0.0)
        if self.warmup_max_lr is not None:
            self.warmup_max_lr = as_float("scheduler.params.warmup_max_lr", self.warmup_max_lr, minimum=0.0)
        elif self.type == "WarmupDecayLR":
            self.warmup_max_lr = 0.001
        if self.warmup_type not in ("log", "linear"):
            raise ValueError(f'"scheduler.params.warmup_type"={self.warmup_type!r} must be "log" or "linear"')
        if self.type in ("WarmupDecayLR", "WarmupCosineLR"):
            if self.total_num_steps is None:
                raise ValueError(f'"scheduler.params.total_num_steps" is required by {self.type}')
            self.total_num_steps = as_int("scheduler.params.total_num_steps", self.total_num_steps, minimum=1)
        self.warmup_min_ratio = as_float("scheduler.params.warmup_min_ratio", self.warmup_min_ratio, minimum=0.0)
        self.cos_min_ratio = as_float("scheduler.params.cos_min_ratio", self.cos_min_ratio, minimum=0.0)


class WarmupSchedule:
    """Sets ``optimizer.param_groups[i]["lr"]`` (any object with such a list) following a :class:`SchedulerConfig`."""

    def __init__(self, optimizer: Any, config: SchedulerConfig, last_batch_iteration: int = -1) -> None:
        self.optimizer, self.config = optimizer, config
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        max_lr = config.warmup_max_lr
        self.max_lrs = list(self.base_lrs) if max_lr is None else [max_lr] * len(self.base_lrs)
        self.min_lrs = [config.warmup_min_lr] * len(self.base_lrs)
        self.warmup = max(2, config.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def _warm(self, t: int) -> float:
        if self.config.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup)
        return t / self.warmup

    def _gamma(self, t: int) -> float:
        if t < self.warmup:
            return self._warm(t)
        if self.config.type == "WarmupDecayLR":
            total = self.config.total_num_steps
            return max(0.0, float(total - t) / float(max(1.0, total - self.warmup)))
        return 1.0

    def _cosine_ratio(self, t: int) -> float:
        c = self.config
        if t < self.warmup:
            return c.warmup_min_ratio + self._warm(t) * (1.0 - c.warmup_min_ratio)
        progress = min(1.0, (t - self.warmup + 1) / max(1, c.total_num_steps - self.warmup))
        return max(0.0, c.cos_min_ratio + (1.0 - c.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[float]:
        t = self.last_batch_iteration
        if self.config.type == "WarmupCosineLR":
            ratio = 0.0 if t < 0 else self._cosine_ratio(t)
            return [lr * ratio for lr in self.base_lrs]
        if t < 0:
            return list(self.min_lrs)
        gamma = self._gamma(t)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._last_lr = self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._last_lr = self._apply()


__all__ = ["SCHEDULES", "SchedulerConfig", "WarmupSchedule"]
