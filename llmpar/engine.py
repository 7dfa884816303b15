"""``llmpar.initialize``: a DeepSpeed config in, a training engine with ZeRO (stages 0-3, CPU offload) out.

    engine, optimizer, _, scheduler = llmpar.initialize(model=model, config={...DeepSpeed JSON...})
    loss = engine(batch); engine.backward(loss); engine.step()

Engine semantics are DeepSpeed's: ``backward`` scales the loss by 1/gradient_accumulation_steps and reduces gradients
(stage 2: every micro-step into the partition; stages 0/1: at the boundary); ``step`` applies the optimizer and the
scheduler only at the accumulation boundary ((micro_steps + 1) % gas == 0) and counts micro-steps always. bf16 puts
the model in bfloat16 with fp32 master weights. ZeRO runs over ``dp_group`` (default: ``mesh["dp"]``, else the whole
job); tensor-parallel layers on ``tp_group`` (``mesh["tp"]``) compose with it.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmpar.config import Config, DeepSpeedAccessors
from llmpar.distributed.collectives import (CommCounter, Group, GroupRef, as_group,
                                          check_same_on_ranks, group_rank, group_size)
from llmpar.zero.lr_schedules import WarmupSchedule
from llmpar.zero.optimizer import ZeroOptimizer

logger = logging.getLogger("llmpar")


class Engine(DeepSpeedAccessors):
    """Wraps the model, the ZeroOptimizer and the schedule; ``engine(*args)`` runs ``module(*args)``."""

    def __init__(self, module: nn.Module, config: Config, optimizer: ZeroOptimizer,
                 scheduler: WarmupSchedule | None, *, dp_group: Group, tp_group: Group | None) -> None:
        self.module, self.config, self.optimizer, self.lr_scheduler = module, config, optimizer, scheduler
        self.dp_group = GroupRef(dp_group)  # by name: see GroupRef
        self.tp_group = GroupRef(tp_group) if tp_group is not None else None
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._skip_offset = 0  # engine.skipped_steps = optimizer's count + offset (assignable, read lazily)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

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

    def step(self) -> None:
        """At the accumulation boundary: optimizer step, scheduler step, grads dropped. Always: micro_steps += 1."""
        if self.is_gradient_accumulation_boundary():
            applied = self.optimizer.step()  # a device flag: read only when a scheduler must know
            if self.lr_scheduler is not None and applied:
                self.lr_scheduler.step()
            self.optimizer.zero_grad()
            self.global_steps += 1
            self.global_samples += self.config.train_batch_size
            if self.global_steps % self.config.steps_per_print == 0 and logger.isEnabledFor(logging.INFO):
                logger.info("step %d: lr %s, grad norm %.4g, skipped %d", self.global_steps,
                            [round(lr, 8) for lr in self.get_lr()], self.optimizer.last_grad_norm or 0.0,
                            self.skipped_steps)
        self.micro_steps += 1

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite grads (reading it syncs with the device once)."""
        return self.optimizer.skipped_steps + self._skip_offset

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skip_offset = int(value) - self.optimizer.skipped_steps

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def module_state_dict(self) -> dict:
        """The model's full state dict on dp rank 0 ({} elsewhere); stage 3 gathers it one unit at a time."""
        from llmpar.zero.gather import consolidated_state_dict

        return consolidated_state_dict(self.module, self.optimizer)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's: write the full 16-bit (the params' dtype) weights from dp rank 0. Under stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save`` (else nothing is saved and False is returned, as DeepSpeed)."""
        import os

        if self.config.zero.stage == 3 and not self.config.zero.stage3_gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: stage 3 without stage3_gather_16bit_weights_on_model_save: not saved")
            return False
        state = self.module_state_dict()
        if group_rank(self.dp_group) == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True


def _check_same_config(config: Config, groups: list[Group]) -> None:
    """The same config on every rank of each group: a mismatch is a clear error on all of them, not a hang."""
    for g in groups:
        check_same_on_ranks(config.fingerprint(), g, what="the DeepSpeed config differs between ranks",
                            hint="give every rank the same config")


def _resolve_groups(mesh: Any, dp_group: Group | None, tp_group: Group | None) -> tuple[Group, Group | None]:
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if dp_group is None and "dp" in names:
            dp_group = mesh["dp"]
        if tp_group is None and "tp" in names and mesh["tp"].size() > 1:
            tp_group = mesh["tp"]
    if dp_group is None:
        from llmpar.distributed.init import init_distributed

        init_distributed()  # adopts an existing group, or a world of one without torchrun
        dp_group = dist.group.WORLD
        if dist.get_world_size() > 1 and tp_group is not None:
            raise ValueError("tp_group given without dp_group or mesh: pass mesh=env.mesh (or dp_group=) so ZeRO "
                             "knows its data-parallel ranks")
    return as_group(dp_group), (as_group(tp_group) if tp_group is not None else None)


def initialize(*, model: nn.Module, config: dict | str | Config, model_parameters: Any = None,
               optimizer: Any = None, lr_scheduler: Any = None, training_data: Any = None, collate_fn: Any = None,
               mesh: Any = None, dp_group: Group | None = None, tp_group: Group | None = None,
               counter: CommCounter | None = None, args: Any = None, unit_policy: Any = None,
               loss_fn: Any = None, **unsupported: Any):
    """Build the engine from a DeepSpeed config. Returns ``(engine, optimizer, dataloader or None, scheduler)``.

    model_parameters: params or param-group dicts (default: all of the model's, weight decay on all, as DeepSpeed).
    mesh / dp_group / tp_group: where ZeRO and tensor parallelism run (see the module docstring).
    unit_policy: stage 3 sharding units, ``policy(name, module) -> bool`` (default: transformer blocks, embeddings,
    head; see ``llmpar.zero.stage3.unit_modules``).
    optimizer / lr_scheduler objects are not taken: describe them in the config.
    A ``"pipeline"`` block (with ``"tensor_parallel"``) returns a pp x dp x tp ``llmpar.pipeline.engine.PipelineEngine``
    instead (``engine.train_batch(x, y)``; ``loss_fn(output, target)`` defaults to ``model.loss``).
    """
    if unsupported:
        raise TypeError(f"llmpar.initialize got unsupported arguments {sorted(unsupported)}")
    from llmpar.pipeline.engine import initialize_pipeline, wants_pipeline

    if wants_pipeline(config):
        if model_parameters is not None or dp_group is not None or tp_group is not None or unit_policy is not None:
            raise ValueError("with a \"pipeline\" block llmpar.initialize splits the model itself: pass mesh= at "
                             "most, not model_parameters= / dp_group= / tp_group= / unit_policy=")
        if optimizer is not None or lr_scheduler is not None:
            raise ValueError("llmpar.initialize takes the optimizer and scheduler from the config")
        return initialize_pipeline(model=model, config=config, mesh=mesh, loss_fn=loss_fn, counter=counter,
                                   training_data=training_data, collate_fn=collate_fn)
    if loss_fn is not None:
        raise ValueError("loss_fn= is used by pipeline engines only (a config with a \"pipeline\" block)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None or lr_scheduler is not None:
        raise ValueError("llmpar.initialize takes the optimizer and scheduler from the config (\"optimizer\", "
                         "\"scheduler\" blocks); passing optimizer= / lr_scheduler= objects is not supported")
    dp_group, tp_group = _resolve_groups(mesh, dp_group, tp_group)
    dp = group_size(dp_group)
    cfg = config if isinstance(config, Config) else Config.from_deepspeed(config, dp=dp)
    if cfg.dp != dp:
        raise ValueError(f"the config was parsed for dp={cfg.dp} but dp_group has {dp} ranks")
    tp = group_size(tp_group) if tp_group is not None else 1
    if "tensor_parallel" in cfg.raw and cfg.tensor_parallel.size != tp:
        raise ValueError(f'"tensor_parallel.size"={cfg.tensor_parallel.size} but tp_group has {tp} ranks: without a '
                         '"pipeline" block, parallelize the model yourself and pass mesh= (or add "pipeline": '
                         '{"stages": 1})')
    device = next(model.parameters()).device
    if device.type == "meta":  # built under llmpar.zero.Init: stage 3 materialises it shard by shard
        from llmpar.zero.init import default_device

        if cfg.zero.stage != 3:
            raise ValueError(f"the model is on the meta device (llmpar.zero.Init) but zero_optimization.stage is "
                             f"{cfg.zero.stage}: only stage 3 materialises a meta model")
        device = default_device()
    _check_same_config(cfg, [dp_group] + ([tp_group] if tp_group is not None else []))
    if cfg.bf16:
        model.to(torch.bfloat16)
    params = model_parameters if model_parameters is not None else list(model.named_parameters())
    opt = ZeroOptimizer(params, cfg.optimizer, dp_group, stage=cfg.zero.stage, zero_config=cfg.zero,
                        tp_group=tp_group, max_grad_norm=cfg.gradient_clipping or None, counter=counter,
                        grad_accum_dtype=torch.float32 if cfg.bf16 and cfg.gradient_accumulation_steps > 1 else None,
                        module=model, unit_policy=unit_policy)
    sched = WarmupSchedule(opt, cfg.scheduler) if cfg.scheduler is not None else None
    engine = Engine(model, cfg, opt, sched, dp_group=dp_group, tp_group=tp_group)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(training_data, num_replicas=dp, rank=group_rank(dp_group), shuffle=True)
        loader = DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                            collate_fn=collate_fn)
    return engine, opt, loader, sched
