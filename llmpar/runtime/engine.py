"""The plain engine (no pipeline): the model, a ZeroOptimizer (stages 0-3, CPU offload) and the LR schedule.

    loss = engine(batch); engine.backward(loss); engine.step()

Engine semantics are DeepSpeed's: ``backward`` scales the loss by 1/gradient_accumulation_steps and reduces gradients
(stage 2: every micro-step into the partition; stages 0/1: at the boundary); ``step`` applies the optimizer and the
scheduler only at the accumulation boundary ((micro_steps + 1) % gas == 0) and counts micro-steps always. ZeRO runs
over ``dp_group``; tensor-parallel layers on ``tp_group`` compose with it.

A rank whose ``step()`` comes without a ``backward()`` since the last one (a script skipping a batch on one rank)
would run none of the micro-step's gradient reductions that the other ranks run, and every later reduction would mix
different steps. Such a ``step()`` first runs the skipped backward from the output of the engine's last training
forward with non-finite (NaN) output gradients: the same gradient reductions as the other ranks, and the non-finite
gradients reach every rank, so the optimizer step of that accumulation is skipped on every rank (DeepSpeed's found-inf
path: ``skipped_steps`` + 1 everywhere, params, optimizer state and scheduler untouched; under fp16 the loss scale is
lowered as for an overflow); the rank says so in a warning. Without such a forward (nothing to run backward from) the
optimizer has nothing to step: the step is neither taken nor counted.

Context parallelism (``context_parallel``, a ``llmpar.context_parallel.ContextParallel``, with the model's
``adapter``): ``engine(...)`` takes the full batch (the same on every cp rank of a data-parallel group: agreed first,
``llmpar.context_parallel.batch_check``, one small all-gather per cp group, else a ValueError on every cp rank naming
each rank's shapes), runs the model on this rank's slice of each sequence (``adapter.shard_call``) and returns the
full-sequence loss, the same on every cp rank. ZeRO then runs over the dp x cp group (its state sharded over dp * cp)
while ``dp_group``, ``dp_world_size`` / ``dp_rank`` and the data loader stay the data-parallel ones.

Mixture of experts (``moe``, ``experts.py``): ``backward(loss)`` adds the MoE layers' weighted aux losses of the last
training forward (``"expert_parallel": {"add_aux_loss": true}``, the default), each optimizer step moves the
aux-loss-free expert biases, and the progress lines show each layer's max / mean tokens per expert.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

import torch
from torch import nn

from llmpar.checkpoint.formats.hf.files import save_safetensors
from llmpar.checkpoint.protocol import Grid
from llmpar.context_parallel.batch_check import agree_batch
from llmpar.distributed.collectives import Group, GroupRef, group_rank, group_size
from llmpar.runtime import engine_ckpt
from llmpar.runtime.compile import backward_context
from llmpar.runtime.config import Config
from llmpar.runtime.engine_base import EngineBase, reports_step
from llmpar.zero.gather import consolidated_state_dict

logger = logging.getLogger("llmpar")


class Engine(EngineBase):
    """Wraps the model, the ZeroOptimizer and the schedule; ``engine(*args)`` runs ``module(*args)``."""

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        optimizer: Any,
        scheduler: Any,
        *,
        dp_group: Group,
        tp_group: Group | None,
        mesh: Any = None,
        context_parallel: Any = None,
        adapter: Any = None,
        moe: Any = None,
    ) -> None:
        super().__init__(module, config, optimizer, scheduler)
        self.moe = moe  # the model's MoE layers (runtime/experts.py: aux losses, bias updates, tokens per expert)
        if (context_parallel is None) != (adapter is None):
            raise ValueError("context_parallel= and adapter= go together (llmpar.context_parallel.adapters)")
        self.context_parallel = context_parallel  # None: every rank runs whole sequences
        self.adapter = adapter
        self.mesh = mesh  # the DeviceMesh the engine runs on, when it was given or built one
        self.dp_group = GroupRef(dp_group)  # by name: see GroupRef
        self.tp_group = GroupRef(tp_group) if tp_group is not None else None
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._in_no_sync = False
        self._backward_done = False  # an engine.backward() since the last step()
        self._backwards_then = 0  # the optimizer's count of backwards (its reducer's) after the last step(): one
        # that ran loss.backward() directly counts too
        self._last_output: Any = None  # the last training forward's output until its backward (a skipped one's replay)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step ends a gradient accumulation: ``(micro_steps + 1) % gas == 0``, unless
        :meth:`set_gradient_accumulation_boundary` said otherwise."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual boundary: from now on the next backward reduces (True) or accumulates (False) the
        gradients and the next ``step()`` applies the optimizer (True) or only counts the micro-step (False), until
        called again; set it before each micro-step's backward."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be a bool, got {type(is_boundary).__name__}")
        self._boundary = is_boundary
        self.optimizer.set_gradient_accumulation_boundary(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's: backward inside the block accumulates gradients on this rank without reducing them (ZeRO
        stages 0 and 1, which reduce at the boundary); the first backward outside at the boundary reduces all of
        them. ``step()`` inside is an error; so is the block under stages 2 / 3, which reduce gradients into their
        partitions as backward runs (use gradient_accumulation_steps there)."""
        if self.zero_optimization_partition_gradients():
            raise RuntimeError(
                f"no_sync() is incompatible with ZeRO stage {self.config.zero.stage}, which reduces "
                "gradients into partitions as backward runs: use gradient_accumulation_steps (or "
                "set_gradient_accumulation_boundary) instead, or stage 0 / 1"
            )
        if self._in_no_sync:
            raise RuntimeError("no_sync() cannot be entered again inside itself")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (under context parallelism: not the cp ranks ZeRO also reduces over)."""
        return group_size(self.dp_group.get()) if self.context_parallel is not None else super().dp_world_size

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp_group.get()) if self.context_parallel is not None else super().dp_rank

    @reports_step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``; under context parallelism the adapter's sharded call, returning the loss
        (llmpar GPT: ``engine(idx, targets, attention_mask=None)``; transformers: ``engine(input_ids=, labels=,
        attention_mask=, position_ids=)``, the output with its loss)."""
        if self.context_parallel is None:
            return self._keep(self.module(*args, **kwargs))
        agree_batch(self.context_parallel, args, kwargs, dp_size=self.dp_world_size, dp_rank=self.dp_rank)
        args, kwargs, finish = self.adapter.shard_call(self.context_parallel, args, kwargs)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            closer = getattr(finish, "close", None)  # leave cp.batch (llmpar.context_parallel.adapters.Finish)
            if callable(closer):
                closer()
            raise
        return self._keep(finish(output))

    forward = __call__

    def _keep(self, output: Any) -> Any:
        """Hold a training forward's output until its backward (no memory beyond what the caller holds anyway)."""
        if torch.is_grad_enabled() and getattr(self.module, "training", True):
            self._last_output = output
            if self.moe is not None:
                self.moe.after_forward()
        return output

    @reports_step
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (``scale_wrt_gas=False``: of ``loss``; times the loss
        scale under fp16); returns that loss. ``retain_graph`` as in ``torch.Tensor.backward`` (ZeRO still reduces
        each gradient once per accumulation)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"engine.backward takes the scalar loss tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        if self.moe is not None:  # the MoE layers' weighted aux losses of the last forward ("add_aux_loss")
            loss = self.moe.loss_with_aux(loss)
        gas = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
        self.optimizer.set_gradient_accumulation_boundary(
            self.is_gradient_accumulation_boundary() and not self._in_no_sync
        )
        scaled = loss / gas if gas > 1 else loss
        scaler = getattr(self.optimizer, "loss_scaler", None)  # fp16: the step divides by the scale again
        self._last_output, self._backward_done = None, True
        with backward_context(self):  # compiled autograd after engine.compile(compiled_autograd_enabled=True)
            (scaled if scaler is None else scaler.scale_loss(scaled)).backward(retain_graph=retain_graph)
        self._monitor_loss(scaled, self.is_gradient_accumulation_boundary())
        return scaled

    @reports_step
    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the accumulation boundary: optimizer step, scheduler step (``lr_kwargs`` passed to it), grads dropped.
        Always: micro_steps += 1."""
        if self._in_no_sync:
            raise RuntimeError(
                "engine.step() inside engine.no_sync(): leave the block first (its gradients are "
                "reduced by the next backward outside it)"
            )
        seen = self._backwards_seen()
        if not self._backward_done and (seen is None or seen == self._backwards_then):
            self._replay_skipped_backward()
        self._backward_done = False
        if self.is_gradient_accumulation_boundary():
            applied = self.optimizer.step()
            if getattr(applied, "found_inf", False) is None:  # no backward in the whole accumulation: nothing stepped
                logger.warning(
                    "engine.step() on global rank %d at optimizer step %d: no backward since the last "
                    "step, nothing to step; the step is not counted",
                    self.global_rank,
                    self.global_steps,
                )
                self._step_applied = False
            else:
                self._finish_step(applied, lr_kwargs=lr_kwargs)
                if self.moe is not None:
                    self.moe.update_biases(self.optimizer.dp_group.get())  # aux-loss-free balancing
                    if self.global_steps % self.config.steps_per_print == 0:
                        self.moe.reset_tokens()
        else:
            self._step_applied = False
        self.micro_steps += 1
        self._backwards_then = self._backwards_seen() or 0

    def _log_extra(self) -> str:
        """The MoE layers' max / mean tokens per expert for the ``steps_per_print`` line."""
        return self.moe.log_suffix() if self.moe is not None else ""

    def _backwards_seen(self) -> int | None:
        """Backwards that reached the optimizer's gradient hooks since its last step (``loss.backward()`` called
        directly included); None for an optimizer without a reducer."""
        return getattr(getattr(self.optimizer, "reducer", None), "micro_steps", None)

    def _replay_skipped_backward(self) -> None:
        """``step()`` without ``backward()``: run the backward of the last training forward's output with NaN output
        gradients (the other ranks' reductions, and a found-inf skip of this accumulation's step everywhere); see the
        module docstring."""
        output, self._last_output = self._last_output, None
        tensors = _grad_outputs(output)
        if not tensors:
            return
        logger.warning(
            "engine.step() on global rank %d without engine.backward() since the last step (optimizer "
            "step %d, micro step %d): running that backward with non-finite gradients so that every rank "
            "runs the same reductions and skips this optimizer step (counted in skipped_steps); call "
            "engine.backward() on every rank, or skip a batch on every rank",
            self.global_rank,
            self.global_steps,
            self.micro_steps,
        )
        self.optimizer.set_gradient_accumulation_boundary(
            self.is_gradient_accumulation_boundary() and not self._in_no_sync
        )
        torch.autograd.backward(tensors, [torch.full_like(t, float("nan")) for t in tensors])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self._backwards_then = self._backwards_seen() or 0

    def module_state_dict(self) -> dict:
        """The model's full state dict on dp rank 0 ({} elsewhere); stage 3 gathers it one unit at a time; experts
        spread over expert-parallel ranks are gathered whole (global expert order), swapped transformers MoE blocks'
        params under transformers' names."""
        return engine_ckpt.hf_named(self.module, consolidated_state_dict(self.module, self.optimizer))

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's: write the full 16-bit (the params' dtype) weights from dp rank 0 (frozen params left out with
        ``exclude_frozen_parameters``): ``torch.save`` of the state dict, or a safetensors file (tied weights once)
        when ``save_filename`` ends with ``.safetensors``. Under stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save`` (else nothing is saved and False is returned, as DeepSpeed).
        For a directory ``from_pretrained`` loads (config.json, shards), use :meth:`save_hf_model`."""
        if self.config.zero.stage == 3 and not self.config.zero.stage3_gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: stage 3 without stage3_gather_16bit_weights_on_model_save: not saved")
            return False
        state = self.module_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if group_rank(self.optimizer.dp_group) == 0:  # the rank the state dict was gathered on (dp x cp under cp)
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                save_safetensors(path, state)
            else:
                torch.save(state, path)
        return True

    @reports_step
    def save_hf_model(self, save_dir: str, *, dtype: Any = None, max_shard_size: Any = "5GB") -> bool:
        """The model as ``save_pretrained`` writes it, so that ``AutoModelForCausalLM.from_pretrained(save_dir)``
        loads it: ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards of at most
        ``max_shard_size`` + ``model.safetensors.index.json``) under the model's own names, tied weights once,
        non-persistent buffers left out, and ``config.json`` (+ ``generation_config.json``) for a HuggingFace model.
        ``dtype``: bf16 / fp16 / fp32 (or a torch dtype); None writes the params' dtype (as ``save_pretrained``).
        Collective over the engine's ranks (call it on every rank): stage 3 gathers the params one unit at a time,
        tensor-parallel params are all-gathered over tp and unpadded; rank 0 of the grid writes. Returns True;
        raises on every rank when the write failed."""
        return engine_ckpt.save_hf(self, save_dir, dtype, max_shard_size)

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    # checkpoint protocol (the rest is EngineBase's: the module is the model, names are its own)
    def checkpoint_names(self) -> dict[str, str]:
        """{optimizer name: the model's name} for params the optimizer names otherwise (a param given to
        ``initialize`` under another name, or as a bare tensor): a param of the model is saved under its first name
        in ``module.named_parameters()``, whatever ``model_parameters`` was."""
        first: dict[int, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), name)
        return {
            name: first[id(p)]
            for buf in self.optimizer.checkpoint_params()
            for name, p in buf
            if first.get(id(p), name) != name
        }

    def checkpoint_grid(self) -> Grid:
        """dp (the optimizer's group) x tp."""
        return Grid.of(self.optimizer.dp_group, self.tp_group, None, self.optimizer.checkpoint_device())

    def checkpoint_counters(self) -> dict:
        """EngineBase's counters, plus the fp16 loss scaler's state (``"loss_scaler"``) when there is one."""
        out = super().checkpoint_counters()
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is not None:
            out["loss_scaler"] = scaler.state_dict()
        return out

    def restore_counters(self, counters: dict) -> None:
        super().restore_counters(counters)
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is not None and isinstance(counters.get("loss_scaler"), dict):
            scaler.load_state_dict(counters["loss_scaler"])


def _grad_outputs(output: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output to run its backward from: its ``loss`` when it has one (a transformers
    output, a dict), else every floating-point tensor needing a gradient in it (a tensor, a tuple / list)."""
    if isinstance(output, dict) or hasattr(output, "keys"):
        loss = output.get("loss") if hasattr(output, "get") else None
        items = [loss] if isinstance(loss, torch.Tensor) and loss.requires_grad else list(output.values())
    elif isinstance(output, (tuple, list)):
        items = list(output)
    else:
        items = [output]
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


DeepSpeedEngine = EngineBase  # deepspeed.runtime.engine.DeepSpeedEngine: the base of both engines (isinstance checks)

__all__ = ["DeepSpeedEngine", "Engine"]
