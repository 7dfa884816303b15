"""What llmpar's two engines share: DeepSpeed's accessors, the step counters, the end of an optimizer step
(scheduler, zero_grad, counters, logging) and the checkpoint methods. ``Engine`` (plain / ZeRO 0-3) and
``PipelineEngine`` (pp x dp x tp) derive from it; ``llmpar.checkpoint`` sees both through its protocol
(``llmpar.checkpoint.protocol.Checkpointable``): the counters and the module targets are implemented here, the grid,
the checkpoint names and the tied duplicates by each engine.

Counters (DeepSpeed's meaning): ``micro_steps`` forward/backward passes, ``global_steps`` optimizer steps taken
(applied or skipped), ``global_samples`` samples seen, ``skipped_steps`` optimizer steps skipped for non-finite
gradients (the optimizer's device counter, read only when asked; assignable, e.g. by a checkpoint load).
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from llmpar.distributed.collectives import group_rank, group_size
from llmpar.distributed.errors import CollectiveError
from llmpar.runtime.config import Config

if TYPE_CHECKING:
    from llmpar.checkpoint.protocol import Grid, PendingSave

logger = logging.getLogger("llmpar")


def reports_step(method: Callable[..., Any]) -> Callable[..., Any]:
    """A collective failing inside ``method`` (a dead or stuck peer) reports the engine's step with its operation."""
    @functools.wraps(method)
    def wrapper(self: "EngineBase", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CollectiveError as err:
            raise err.add_context(f"in engine.{method.__name__}() at optimizer step {self.global_steps}, micro step "
                                  f"{self.micro_steps}") from err.__cause__

    return wrapper


class EngineBase:
    """State and accessors common to the plain and the pipeline engine."""

    def __init__(self, module: nn.Module, config: Config, optimizer: Any, scheduler: Any) -> None:
        self.module, self.config, self.optimizer, self.lr_scheduler = module, config, optimizer, scheduler
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._skip_offset = 0  # skipped_steps = the optimizer's count + offset
        self.checkpoint_pending: PendingSave | None = None  # this engine's async save, published at the next wait

    # DeepSpeed's accessors
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (DeepSpeed's name)."""
        return group_size(self.optimizer.dp_group)

    @property
    def dp_rank(self) -> int:
        """This rank's place in its data-parallel group."""
        return group_rank(self.optimizer.dp_group)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite grads (reading it syncs with the device once)."""
        return self.optimizer.skipped_steps + self._skip_offset

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skip_offset = int(value) - self.optimizer.skipped_steps

    def _finish_step(self, applied: torch.Tensor | bool, loss: float | None = None) -> None:
        """After ``optimizer.step()`` returned ``applied`` (a device flag: read only when a scheduler must know,
        as DeepSpeed does not step the scheduler on a skipped step): scheduler, zero_grad, counters, log."""
        if self.lr_scheduler is not None and applied:
            self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        if self.global_steps % self.config.steps_per_print == 0 and logger.isEnabledFor(logging.INFO):
            logger.info("step %d:%s lr %s, grad norm %.4g, skipped %d", self.global_steps,
                        "" if loss is None else f" loss {loss:.4f},", [round(lr, 8) for lr in self.get_lr()],
                        self.optimizer.last_grad_norm or 0.0, self.skipped_steps)

    # checkpoints (llmpar.checkpoint): every rank writes its own shards, one metadata.json for the run; params are
    # named as in the unsplit model, so a checkpoint loads at another dp / tp / pp degree, ZeRO stage or engine kind
    @reports_step
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        async_save: bool = False) -> str:
        """Sharded, atomic checkpoint ``save_dir/tag`` (default ``global_step{N}``), collective over the engine's
        ranks (every rank must pass the same tag); see ``llmpar.checkpoint``. ``async_save``: written by a thread from
        a host copy, published at the next ``wait_checkpoint`` / ``save_checkpoint`` / ``load_checkpoint``; one still
        pending when the engine is collected or the interpreter exits is finished then, with a warning."""
        from llmpar.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, async_save=async_save)

    @reports_step
    def wait_checkpoint(self) -> str | None:
        """Publish the pending async save (collective); its path, or None if none was pending."""
        from llmpar.checkpoint import wait_checkpoint

        return wait_checkpoint(self)

    @reports_step
    def load_checkpoint(self, load_dir: str, tag: str | None = None, *, strict: bool = True
                        ) -> tuple[str, dict | None]:
        """Load ``load_dir/tag`` (default: ``latest``), saved at any dp / tp / pp degree, ZeRO stage or offload;
        returns (path, client_state). Every rank must load the same checkpoint. ``strict``: a param or buffer the
        model has and the checkpoint lacks, or the other way round, is an error naming it (False: the model's keep
        their values, the checkpoint's are ignored, with a warning)."""
        from llmpar.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag, strict=strict)

    # the engine's side of the checkpoint protocol (llmpar.checkpoint.protocol.Checkpointable); each engine adds
    # checkpoint_grid() and checkpoint_modules(), and overrides the naming when its modules are not the model
    _COUNTERS = ("micro_steps", "global_steps", "global_samples", "skipped_steps")

    def checkpoint_grid(self) -> Grid:
        """This rank's place in the dp x tp (x pp) grid."""
        raise NotImplementedError(f"{type(self).__name__} does not say where it sits (checkpoint_grid)")

    def checkpoint_modules(self) -> list[nn.Module]:
        """The modules this rank holds."""
        return [self.module]

    def checkpoint_named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        """(optimizer-style name, tensor) of this rank's module params (``kind="named_parameters"``) or buffers
        (``"named_buffers"``), a shared one under every name."""
        return [item for m in self.checkpoint_modules() for item in getattr(m, kind)(remove_duplicate=False)]

    def checkpoint_names(self) -> dict[str, str]:
        """{optimizer / module name: checkpoint name} where they differ (none: the module is the model)."""
        return {}

    def checkpoint_duplicates(self) -> set[str]:
        """Optimizer param names not written (tied copies another pipeline stage writes): none."""
        return set()

    def checkpoint_targets(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """{checkpoint name: (live tensor, is_param)} of this rank's modules (the first holder of a shared one)."""
        names = self.checkpoint_names()
        out: dict[str, tuple[torch.Tensor, bool]] = {}
        for kind, is_param in (("named_parameters", True), ("named_buffers", False)):
            for name, t in self.checkpoint_named(kind):
                if t is not None:
                    out.setdefault(names.get(name, name), (t, is_param))
        return out

    def checkpoint_counters(self) -> dict[str, int]:
        """The run counters a checkpoint saves."""
        return {k: getattr(self, k) for k in self._COUNTERS}

    def restore_counters(self, counters: dict[str, int]) -> None:
        """Take saved counters back (``skipped_steps`` through its setter)."""
        for k in self._COUNTERS:
            if k in counters:
                setattr(self, k, counters[k])


__all__ = ["EngineBase"]
