"""Step statistics kept on the device: ZeroOptimizer.step() never reads them on the host.

The global grad norm and the found-inf flag of each step stay device tensors; the skipped-step count is a device
counter. The host sees them (one sync) only when someone reads ``last_grad_norm`` / ``skipped_steps`` (the engine's
log line every ``steps_per_print`` steps, a checkpoint) or asks a step's :class:`StepApplied` for its truth value.
Both can be assigned (checkpoint loading), which replaces the device values. A skipped step is still logged at once
on the CPU; on CUDA the counter is copied to the host without blocking and the warning comes at a later step (or
read) once that copy has landed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("llmpar")


class StepApplied:
    """What ``ZeroOptimizer.step()`` returns: true when the step was applied (finite grads). ``bool()`` syncs."""

    __slots__ = ("found_inf",)

    def __init__(self, found_inf: torch.Tensor | None) -> None:
        self.found_inf = found_inf

    def __bool__(self) -> bool:
        return self.found_inf is not None and float(self.found_inf) == 0

    def __repr__(self) -> str:
        return f"StepApplied({bool(self)})"


class NormStats:
    """The last grad norm and the skipped-step count of one optimizer, on the device until read. (Not the pipeline's
    per-step timing stats, ``llmpar.pipeline.StepStats``.)"""

    def __init__(self) -> None:
        self._norm: torch.Tensor | float | None = None
        self._base = 0  # skipped steps assigned from the host
        self._skips: torch.Tensor | None = None  # skipped steps since, on the device
        self._reported = 0
        self._seen: tuple[torch.Tensor, object] | None = None  # CUDA: (pinned copy of the count, its event)
        self._found: torch.Tensor | None = None  # the last step's found-inf flag

    @property
    def overflow(self) -> bool:
        """The last step was skipped for non-finite grads (DeepSpeed's ``optimizer.overflow``; reading syncs)."""
        return self._found is not None and bool(self._found != 0)

    def record(self, norm: torch.Tensor, found_inf: torch.Tensor) -> None:
        self._norm = norm.detach()
        self._found = found_inf.detach()
        hit = (found_inf.detach() != 0).to(torch.int64)
        self._skips = hit if self._skips is None else self._skips.to(hit.device).add_(hit)
        if self._skips.device.type != "cuda":  # host memory already: read it now (numpy: not a device read)
            self._warn(self._base + int(self._skips.numpy()))
            return
        if self._seen is not None and self._seen[1].query():  # type: ignore[attr-defined]
            self._warn(self._base + int(self._seen[0].numpy()))
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(self._skips, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._seen = (host, event)

    def _warn(self, n: int) -> None:
        if n > self._reported:
            logger.warning(
                "ZeroOptimizer: %d step(s) skipped on every rank for a non-finite gradient norm (%d so far)",
                n - self._reported,
                n,
            )
            self._reported = n

    @property
    def last_grad_norm(self) -> float | None:
        return None if self._norm is None else float(self._norm)

    @last_grad_norm.setter
    def last_grad_norm(self, value: float | torch.Tensor | None) -> None:
        self._norm = value

    @property
    def skipped_steps(self) -> int:
        n = self._base + (int(self._skips) if self._skips is not None else 0)
        self._warn(n)
        return n

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"skipped_steps must be a non-negative int, got {value!r}")
        self._base, self._skips, self._reported, self._seen = value, None, value, None


class StepStatsView:
    """Mixin for ``ZeroOptimizer``: its step statistics under DeepSpeed's names, read from ``self.stats`` (a
    :class:`NormStats`) and ``self.loss_scaler``."""

    stats: NormStats
    loss_scaler: Any

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite grads (reading it syncs with the device once)."""
        return self.stats.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.stats.skipped_steps = value

    @property
    def last_grad_norm(self) -> float | None:
        """The global grad norm of the last step (reading it syncs with the device once)."""
        return self.stats.last_grad_norm

    @last_grad_norm.setter
    def last_grad_norm(self, value: float | None) -> None:
        self.stats.last_grad_norm = value

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (DeepSpeed's ``loss_scale`` / ``cur_scale``; 1.0 without a scaler; reading syncs)."""
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    cur_scale = loss_scale

    @property
    def overflow(self) -> bool:
        """The last step was skipped for non-finite grads (DeepSpeed's name; reading it syncs)."""
        return self.stats.overflow
