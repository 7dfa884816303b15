"""The plain engine (no pipeline): the model, a ZeroOptimizer (stages 0-3, CPU offload) and the LR schedule.

    loss = engine(batch); engine.backward(loss); engine.step()

Engine semantics are DeepSpeed's: ``backward`` scales the loss by 1/gradient_accumulation_steps and reduces gradients
(stage 2: every micro-step into the partition; stages 0/1: at the boundary); ``step`` applies the optimizer and the
scheduler only at the accumulation boundary ((micro_steps + 1) % gas == 0) and counts micro-steps always. ZeRO runs
over ``dp_group``; tensor-parallel layers on ``tp_group`` compose with it.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from llmpar.checkpoint.protocol import Grid
from llmpar.distributed.collectives import Group, GroupRef, group_rank
from llmpar.runtime.config import Config
from llmpar.runtime.engine_base import EngineBase, reports_step
from llmpar.zero.gather import consolidated_state_dict

logger = logging.getLogger("llmpar")


class Engine(EngineBase):
    """Wraps the model, the ZeroOptimizer and the schedule; ``engine(*args)`` runs ``module(*args)``."""

    def __init__(self, module: nn.Module, config: Config, optimizer: Any, scheduler: Any, *, dp_group: Group,
                 tp_group: Group | None, mesh: Any = None) -> None:
        super().__init__(module, config, optimizer, scheduler)
        self.mesh = mesh  # the DeviceMesh the engine runs on, when it was given or built one
        self.dp_group = GroupRef(dp_group)  # by name: see GroupRef
        self.tp_group = GroupRef(tp_group) if tp_group is not None else None

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @reports_step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    @reports_step
    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps``; returns the scaled loss."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"engine.backward takes the scalar loss tensor, got {type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        gas = self.config.gradient_accumulation_steps
        self.optimizer.set_gradient_accumulation_boundary(self.is_gradient_accumulation_boundary())
        scaled = loss / gas if gas > 1 else loss
        scaled.backward()
        return scaled

    @reports_step
    def step(self) -> None:
        """At the accumulation boundary: optimizer step, scheduler step, grads dropped. Always: micro_steps += 1."""
        if self.is_gradient_accumulation_boundary():
            self._finish_step(self.optimizer.step())
        self.micro_steps += 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def module_state_dict(self) -> dict:
        """The model's full state dict on dp rank 0 ({} elsewhere); stage 3 gathers it one unit at a time."""
        return consolidated_state_dict(self.module, self.optimizer)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's: write the full 16-bit (the params' dtype) weights from dp rank 0. Under stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save`` (else nothing is saved and False is returned, as DeepSpeed)."""
        if self.config.zero.stage == 3 and not self.config.zero.stage3_gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: stage 3 without stage3_gather_16bit_weights_on_model_save: not saved")
            return False
        state = self.module_state_dict()
        if group_rank(self.dp_group) == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    # checkpoint protocol (the rest is EngineBase's: the module is the model, names are its own)
    def checkpoint_grid(self) -> Grid:
        """dp (the optimizer's group) x tp."""
        return Grid.of(self.optimizer.dp_group, self.tp_group, None, self.optimizer.checkpoint_device())


__all__ = ["Engine"]
