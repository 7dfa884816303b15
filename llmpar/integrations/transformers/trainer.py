"""llmpar's ``transformers.Trainer``: the engine built at the start of ``train()`` (``llmpar.initialize``), the
Trainer's loop stepping it, its checkpoints and evaluation through the engine (the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import Any

import torch
import transformers
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from torch.utils.data import DataLoader

from llmpar.distributed.init import init_distributed
from llmpar.integrations.transformers.auto import fill_auto
from llmpar.integrations.transformers.zero3 import is_zero3
from llmpar.runtime.config import Blocks, read_config
from llmpar.runtime.initialize import initialize
from llmpar.tensor_parallel.parallelize import parallelize

logger = logging.getLogger("llmpar")


class _EngineOptimizer:
    """What the Trainer's loop steps: the engine has already stepped in ``training_step`` (at the boundary), so
    ``step`` / ``zero_grad`` do nothing; param groups (and lrs) are the engine optimizer's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.state: dict = {}
        self.defaults: dict = {}

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class _EngineScheduler:
    """The Trainer's view of the engine's schedule (which the engine steps): the last lrs."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.engine.get_lr())

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class _LoopModel:
    """The engine as the Trainer's loop sees it: its ``no_sync`` (which the loop enters for all but the last
    micro-batch of an accumulation) does nothing, since the engine accumulates by the boundary flag
    ``training_step`` sets; everything else is the engine's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` over an llmpar engine; see the module docstring."""

    def __init__(self, *args: Any, llmpar_config: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            raise ValueError(
                "these TrainingArguments started DeepSpeed: they were built before "
                "llmpar.integrations.transformers was imported (after it, TrainingArguments(deepspeed=) "
                "gives the config to llmpar): import llmpar's Trainer at the top of the script, or pass "
                "the config as Trainer(llmpar_config=...) and no deepspeed="
            )
        given = llmpar_config if llmpar_config is not None else getattr(self.args, "llmpar_config", None)
        if given is None:
            raise ValueError(
                "llmpar's Trainer needs a DeepSpeed config: TrainingArguments(deepspeed=...) from "
                "llmpar.integrations.transformers, or Trainer(llmpar_config=...)"
            )
        if self.args.n_gpu > 1:
            raise ValueError(
                f"n_gpu={self.args.n_gpu} (torch.nn.DataParallel in one process): launch one process "
                "per device with torchrun"
            )
        self.llmpar_config = read_config(given)
        parallel = Blocks.parallel_of(self.llmpar_config)  # the degrees, before fill_auto can fill the rest
        self.tp_size = parallel.tensor_parallel.size
        self.cp_size = parallel.context_parallel.size
        world = self.args.world_size
        if world % self.tp_size:
            raise ValueError(f"tensor_parallel.size={self.tp_size} does not divide the {world} processes")
        if world % (self.tp_size * self.cp_size):
            raise ValueError(
                f"context_parallel.size={self.cp_size} x tensor_parallel.size={self.tp_size} does not "
                f"divide the {world} processes"
            )
        self.engine: Any = None
        self._engine_steps = 0  # the optimizer steps the engine's schedule was built for

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        if any(p.is_meta for p in model.parameters()):
            return  # built under llmpar.zero.Init: ZeRO-3 makes each param on the device, one unit at a time
        super()._move_model_to_device(model, device)

    # ---- the engine ----
    def _build_engine(self, num_training_steps: int) -> None:
        if self.engine is not None:
            if num_training_steps != self._engine_steps:
                raise ValueError(
                    f"the engine was built for {self._engine_steps} optimizer steps (evaluate() before "
                    f"train() on a model built sharded) but train() runs {num_training_steps}: give "
                    "the TrainingArguments the same max_steps / epochs, or train() before evaluating"
                )
            return
        self._engine_steps = num_training_steps
        dp = self.args.world_size // (self.tp_size * self.cp_size)
        config = fill_auto(
            self.llmpar_config, self.args, model=self.model, num_training_steps=num_training_steps, dp=dp
        )
        mesh = None
        if self.tp_size > 1 or self.cp_size > 1:  # the Trainer's optimizer (if any) is built on the split params
            mesh = init_distributed(tp=self.tp_size, cp=self.cp_size).mesh
            if self.tp_size > 1:
                parallelize(self.model, mesh["tp"])
        optimizer = None
        if "optimizer" not in config:
            optimizer = transformers.Trainer.create_optimizer(self)  # args.optim, decay groups
        scheduler = None
        if "scheduler" not in config:
            scheduler = self._trainer_schedule(num_training_steps)
        params = None  # with the config's optimizer: weight decay on every trainable param, as DeepSpeed's path
        if optimizer is None:
            params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.engine, _, _, _ = initialize(
            model=self.model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
            mesh=mesh,
        )
        if self.cp_size > 1:  # beside the Trainer's banner, on its logger (the script's log level)
            transformers.trainer.logger.info(
                "  Context parallelism = on: cp=%d (%s), each sequence split over %d "
                "ranks; data-parallel ranks = %d (the batch size counts these)",
                self.cp_size,
                self.engine.context_parallel.mode,
                self.cp_size,
                dp,
            )
        self.optimizer = _EngineOptimizer(self.engine)
        self.lr_scheduler = _EngineScheduler(self.engine)
        if is_zero3(config) and dp * self.cp_size > 1:  # ZeRO-3 shards over dp x cp
            _synced_generate(self.model)

    def _engine_for_eval(self) -> None:
        """evaluate() / predict() before train() on a model built sharded (its params on the meta device, nothing
        to compute with): the engine is built now, for the steps train() will run, and materialises the params."""
        if self.engine is None and any(p.is_meta for p in self.model.parameters()):
            steps = max(1, self.args.max_steps)
            if self.train_dataset is not None:
                steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
            self._build_engine(steps)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """transformers' evaluate; under ZeRO-3 each unit module is gathered for its forward, as in training."""
        self._engine_for_eval()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' predict; under ZeRO-3 each unit module is gathered for its forward, as in training."""
        self._engine_for_eval()
        return super().predict(*args, **kwargs)

    def _trainer_schedule(self, num_training_steps: int) -> Any:
        args = self.args

        def build(optimizer: torch.optim.Optimizer) -> Any:
            return transformers.get_scheduler(
                args.lr_scheduler_type,
                optimizer=optimizer,
                num_warmup_steps=args.get_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps,
                scheduler_specific_kwargs=args.lr_scheduler_kwargs,
            )

        return build

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        self._build_engine(max_steps)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model: Any = None) -> Any:
        if self.engine is None:
            raise RuntimeError("llmpar's Trainer builds its optimizer with the engine, at the start of train()")
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.engine is None:
            raise RuntimeError("llmpar's Trainer builds its scheduler with the engine, at the start of train()")
        return self.lr_scheduler

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        return _LoopModel(self.engine) if training and self.engine is not None else self.model

    # ---- one micro-batch ----
    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        engine = self.engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        engine.set_gradient_accumulation_boundary(bool(self.accelerator.sync_gradients))
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: Any) -> Any:
        return self.engine.get_global_grad_norm()  # the engine clipped (gradient_clipping) when it stepped

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        norm = self.engine.get_global_grad_norm() if grad_norm is None else grad_norm
        return norm.item() if hasattr(norm, "item") else norm

    # ---- data: the ranks of one tensor- / context-parallel group read the same batches ----
    def get_train_dataloader(self) -> DataLoader:
        """The Trainer's loader, sharded over the dp ranks (rank // (cp * tp)) instead of every process when
        cp * tp > 1 (the cp x tp ranks of a data-parallel group are consecutive: llmpar's mesh is [pp, dp, cp, tp])."""
        loader = super().get_train_dataloader()
        replicas = self.tp_size * self.cp_size
        if replicas == 1:
            return loader
        dp, dp_rank = self.args.world_size // replicas, self.args.process_index // replicas
        shard = getattr(loader, "batch_sampler", None)
        if not isinstance(shard, BatchSamplerShard):
            shard = getattr(loader, "dataset", None)
            if not isinstance(shard, IterableDatasetShard):
                raise ValueError(
                    f"tensor_parallel.size={self.tp_size} x context_parallel.size={self.cp_size}: "
                    f"the Trainer built a {type(loader).__name__} "
                    "that llmpar cannot shard over dp ranks (dispatch_batches / a batch sampler of "
                    "its own); use the default loader"
                )
        shard.num_processes, shard.process_index = dp, dp_rank
        if dp == 1 and isinstance(shard, BatchSamplerShard):  # as one process: a partial last batch as it is, not
            shard.even_batches = False  # completed with the epoch's first samples (accelerate's even_batches)
        return loader

    def get_total_train_batch_size(self, args: Any) -> int:
        """Micro-batch x accumulation x the data-parallel ranks (world / (cp * tp)): the banner's batch."""
        return (
            self._train_batch_size * args.gradient_accumulation_steps * args.world_size // (self.tp_size * self.cp_size)
        )

    # ---- checkpoints ----
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.engine is None:  # before train(): the model is whole
            super().save_model(output_dir, _internal_call)
            return
        self.engine.save_hf_model(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        return None  # the engine loads params with the optimizer (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path, _ = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint={checkpoint!r} holds no llmpar checkpoint (no 'latest' "
                "file): it was not written by llmpar's Trainer"
            )

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        path, _ = self.engine.load_checkpoint(best, load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"best model checkpoint {best!r} holds no llmpar checkpoint")


def _synced_generate(model: Any) -> None:
    """ZeRO-3 over several ranks: ``model.generate`` defaults to ``synced_gpus=True`` (what transformers does under
    DeepSpeed ZeRO-3), so a rank whose sequences ended keeps running forwards, whose gathers the others wait for."""
    method = getattr(type(model), "generate", None)
    if method is None or getattr(model.__dict__.get("generate"), "_llmpar_synced", False):
        return
    ref = weakref.ref(model)  # no model -> attribute -> model cycle

    def generate(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("synced_gpus", True)
        return method(ref(), *args, **kwargs)

    generate._llmpar_synced = True  # type: ignore[attr-defined]
    generate.__doc__ = method.__doc__
    model.generate = generate


__all__ = ["Trainer"]
