"""``llmpar.integrations.accelerate.Accelerator``: accelerate's Accelerator with its DeepSpeed route kept and
``llmpar.initialize`` building the engine underneath (the package docstring says what a script sees)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import os
import re
import sys
import warnings
from typing import Any, Iterator

import accelerate
import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import PartialState
from accelerate.utils import DistributedType, DynamoBackend
from accelerate.utils.constants import MODEL_NAME
from accelerate.utils.deepspeed import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
    DummyOptim,
    DummyScheduler,
)
from torch.utils.data import DataLoader

from llmpar.distributed.init import init_distributed
from llmpar.integrations.accelerate import fill
from llmpar.runtime.client import mirror_groups
from llmpar.runtime.engine_base import EngineBase
from llmpar.runtime.initialize import initialize
from llmpar.zero.gather import consolidated_state_dict

logger = logging.getLogger("llmpar")

_PRECISIONS = ("no", "fp16", "bf16")


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment variables set for the block, restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _MirroredScheduler(AcceleratedScheduler):
    """A torch LR scheduler on the client torch optimizer, stepped as accelerate steps it (at the accumulation
    boundary, ``num_processes`` times unless ``split_batches``); after each step the lrs it set are copied into the
    engine's optimizer (whose param groups are the client optimizer's, in order)."""

    def __init__(self, scheduler: Any, optimizer: Any, client: torch.optim.Optimizer, **kwargs: Any) -> None:
        super().__init__(scheduler, optimizer, **kwargs)
        self.client, self.engine_optimizer = client, optimizer.optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():  # the client optimizer is never stepped itself: torch's order warning is moot
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            super().step(*args, **kwargs)
        mirror_groups(self.client.param_groups, self.engine_optimizer.param_groups)

    def mirror_back(self) -> None:
        """After a checkpoint load: the engine optimizer's lrs into the client optimizer (chained schedulers read
        them)."""
        mirror_groups(self.engine_optimizer.param_groups, self.client.param_groups)


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose DeepSpeed route runs llmpar's engine; see the module docstring. Same
    arguments as accelerate's. Without a DeepSpeed plugin (none given, none in the environment) it is accelerate's
    Accelerator unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(accelerate.Accelerator.__init__).bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        plugin = fill.one_plugin(arguments.pop("deepspeed_plugin", None), arguments.pop("deepspeed_plugins", None))
        self._llmpar = plugin is not None
        if plugin is None:
            super().__init__(**arguments)
            return
        precision = arguments.pop("mixed_precision", None)
        precision = str(
            precision if precision is not None else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        ).lower()
        if precision not in _PRECISIONS:
            raise ValueError(
                f"mixed_precision={precision!r}: llmpar's engine runs {', '.join(_PRECISIONS)} (fp8 is not supported)"
            )
        cpu = bool(arguments.pop("cpu", False)) or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
        cpu = cpu or not torch.cuda.is_available()
        # accelerate must not start DeepSpeed: its state is built as for plain data parallelism (the process group,
        # the device, the ranks), then marked DeepSpeed, as accelerate marks it, with the plugin
        with _env(ACCELERATE_USE_DEEPSPEED="false", ACCELERATE_MIXED_PRECISION="no"):
            super().__init__(mixed_precision="no", cpu=cpu, **arguments)
        if precision == "fp16" and "fp16" not in plugin.deepspeed_config:  # accelerate would add auto_cast, which
            plugin.deepspeed_config["fp16"] = {"enabled": True}  # llmpar does not run: inputs are not cast
        plugin.set_mixed_precision(precision)
        plugin.zero3_init_flag = False  # llmpar.zero.Init builds sharded models, not deepspeed.zero.Init
        if self.state.distributed_type == DistributedType.NO:
            init_distributed()  # one process: a world of one, for gather / wait_for_everyone
        self.state.deepspeed_plugins = plugin
        self.state.distributed_type = DistributedType.DEEPSPEED
        PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
        self.deepspeed_engine_wrapped: DeepSpeedEngineWrapper | None = None

    # ---- prepare: the engine ----
    def _prepare_deepspeed(self, *args: Any) -> tuple:
        """accelerate's DeepSpeed prepare, with ``llmpar.initialize`` building the engine."""
        plugin = self.deepspeed_plugin
        result = [self._prepare_one(obj, first_pass=True) if isinstance(obj, DataLoader) else obj for obj in args]
        model = next((o for o in result if isinstance(o, torch.nn.Module)), None)
        optimizer = next((o for o in result if isinstance(o, (torch.optim.Optimizer, DummyOptim))), None)
        scheduler = next(
            (
                o
                for o in result
                if isinstance(o, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)) or fill.is_ds_schedule(o)
            ),
            None,
        )
        batch = fill.micro_batch(plugin, args, self.num_processes if self.split_batches else 1)
        plugin.fill_match(
            "gradient_accumulation_steps",
            must_match=False,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        gas = plugin.get_value("gradient_accumulation_steps")
        if gas != self.gradient_accumulation_steps:
            logger.warning(
                "gradient_accumulation_steps: the Accelerator has %s, the DeepSpeed config %s; using the config's",
                self.gradient_accumulation_steps,
                gas,
            )
            self.gradient_accumulation_steps = gas
        if model is None:
            return tuple(result)
        if self.deepspeed_engine_wrapped is not None:
            raise ValueError(
                "this Accelerator already prepared a model: llmpar's engine takes one model per "
                "Accelerator (as DeepSpeed's route); prepare the dataloaders alone, or make another run"
            )
        fill.check_objects(plugin.deepspeed_config, optimizer, scheduler)
        values: dict[str, Any] = {
            "gradient_clipping": 1.0,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
        }
        if batch is not None:
            values["train_micro_batch_size_per_gpu"] = batch
            values["train_batch_size"] = batch * gas * self.num_processes
        values.update(fill.hidden_size_autos(plugin, model))
        if isinstance(optimizer, DummyOptim):
            values.update(
                {"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay}
            )
            values.update(
                {f"optimizer.params.{k}": optimizer.kwargs[k] for k in ("betas", "eps") if k in optimizer.kwargs}
            )
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            values.update(fill.schedule_autos(scheduler, 1 if self.split_batches else self.num_processes))
        plugin.deepspeed_config_process(must_match=False, **values)
        self.deepspeed_config = plugin.deepspeed_config
        return self._build_engine(result, model, optimizer, scheduler)

    def _build_engine(self, result: list, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> tuple:
        config = copy.deepcopy(self.deepspeed_config)
        if not math.isfinite(float(config.get("steps_per_print", 1))):  # accelerate's "never print"
            config["steps_per_print"] = sys.maxsize
        kwargs: dict[str, Any] = {}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
            if fill.is_ds_schedule(scheduler):
                kwargs["lr_scheduler"] = scheduler
            elif scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
                raise ValueError(
                    f"the scheduler {type(scheduler).__name__} passed to prepare() was built on another "
                    "optimizer than the one passed with it: build it on that optimizer"
                )
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            logger.warning(
                "dynamo_backend=%s: llmpar's engine under accelerate is not compiled (the model runs eagerly)",
                self.state.dynamo_plugin.backend,
            )
        if self.device.type != "cpu" and not any(p.is_meta for p in model.parameters()):
            model.to(self.device)  # llmpar.zero.Init builds on the device already
        engine, zero_opt, _, engine_schedule = initialize(model=model, config=config, **kwargs)
        wrapped_opt = DeepSpeedOptimizerWrapper(zero_opt) if optimizer is not None else None
        wrapped_schedule: Any = None
        if scheduler is not None:
            if engine_schedule is not None:
                wrapped_schedule = DeepSpeedSchedulerWrapper(engine_schedule, wrapped_opt)
            else:  # a torch scheduler on the client optimizer: the user steps it, accelerate's way
                wrapped_schedule = _MirroredScheduler(
                    scheduler,
                    wrapped_opt,
                    optimizer,
                    step_with_optimizer=self.step_scheduler_with_optimizer,
                    split_batches=self.split_batches,
                )
        for i, obj in enumerate(result):
            if obj is model:
                result[i] = engine
            elif obj is optimizer:
                result[i] = wrapped_opt
            elif obj is scheduler:
                result[i] = wrapped_schedule
        self.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
        self._models.append(engine)
        if wrapped_opt is not None:
            self._optimizers.append(wrapped_opt)
        if wrapped_schedule is not None:
            self._schedulers.append(wrapped_schedule)
        return tuple(result)

    def _engine(self, model: Any = None) -> EngineBase | None:
        """On llmpar's route: ``model`` when it is an engine, the prepared engine when ``model`` is its module (or
        None); else None."""
        if not self._llmpar:
            return None
        if isinstance(model, EngineBase):
            return model
        engine = self.deepspeed_engine_wrapped.engine if self.deepspeed_engine_wrapped is not None else None
        return engine if model is None or (engine is not None and model is engine.module) else None

    # ---- training ----
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """accelerate's: under llmpar the engine's backward (the loss divided by gradient_accumulation_steps), and
        at the accumulation boundary (``sync_gradients``) the engine's step: clipping by the config's
        ``gradient_clipping``, the optimizer step, the engine's scheduler, zeroed gradients."""
        if self._llmpar and self.deepspeed_engine_wrapped is None:
            raise RuntimeError("accelerator.backward() before prepare(model, ...): the engine is built by prepare")
        super().backward(loss, **kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Under llmpar the engine clipped the gradients itself, at its ``gradient_clipping`` (the DeepSpeed
        config's; ``"auto"`` is the plugin's ``gradient_clipping``, else 1.0), inside ``backward`` at the
        accumulation boundary, before its optimizer step (DeepSpeed's route): this returns the global grad norm of
        that step, before clipping (a float; None before the first step). ``max_norm`` must be that value and
        ``norm_type`` 2 (anything else would not be what the engine did: ValueError)."""
        engine = self._engine()
        if engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        clip = float(engine.gradient_clipping())
        if float(norm_type) != 2.0:
            raise ValueError(
                f"clip_grad_norm_(norm_type={norm_type}): llmpar's engine clips the global 2-norm; pass norm_type=2"
            )
        if float(max_norm) != clip:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}) but the engine clips at gradient_clipping="
                f'{clip} (the DeepSpeed config\'s "gradient_clipping", 0 = off) when it steps inside '
                f'backward(): set "gradient_clipping": {max_norm} in the config (or '
                f'DeepSpeedPlugin(gradient_clipping={max_norm}) with "auto")'
            )
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    # ---- weights and checkpoints ----
    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The engine's module (under ZeRO-3 its params are this rank's shards; see :meth:`get_state_dict`)."""
        engine = self._engine(model)
        if engine is not None:
            return engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict | None:
        """The model's (the engine's or its module's) full weights, in the params' dtype, on the CPU, under the
        model's own names: on every rank at ZeRO 0-2; at ZeRO-3 gathered one unit at a time onto rank 0, None on the
        other ranks (DeepSpeed's rule, which ``save_model`` follows). Collective: call it on every rank."""
        engine = self._engine(model)
        if engine is None:
            return super().get_state_dict(model, unwrap)
        stage3 = engine.zero_optimization_stage() == 3
        state = consolidated_state_dict(engine.module, engine.optimizer, rank0_only=stage3)
        return state if state or not stage3 or self.is_main_process else None

    def save_model(self, model: Any, save_directory: str, **kwargs: Any) -> None:
        """accelerate's (safetensors shards of :meth:`get_state_dict`, written by the main process). Collective."""
        engine = self._engine(model)
        super().save_model(engine.module if engine is not None else model, save_directory, **kwargs)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str:
        """accelerate's, the engine writing its checkpoint into ``output_dir/pytorch_model``. Called between the
        micro-steps of an accumulation (a script checkpointing every N optimizer steps saves again on the micro-steps
        after step N), it saves what DeepSpeed saves there: params, optimizer, schedule and counters, not the gradients
        accumulated so far (said in the log); a run resumed from it starts that accumulation afresh."""
        engine = self._engine()
        if engine is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        optimizer = engine.optimizer
        pending = optimizer.reducer.micro_steps
        if pending and self.is_main_process:
            logger.warning(
                "save_state in the middle of a gradient accumulation (%d of %d micro-steps since the last "
                "optimizer step): saved as DeepSpeed saves there, without the accumulated gradients (they "
                "are not part of a checkpoint); a run resumed from it starts the accumulation afresh",
                pending,
                self.gradient_accumulation_steps,
            )
        with optimizer.saving_mid_accumulation():
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """accelerate's, the engine loading its checkpoint (params, optimizer, engine schedule, counters) from
        ``input_dir/pytorch_model``; a folder without it is a FileNotFoundError on every rank (DeepSpeed would warn
        and loads nothing)."""
        if self._engine() is not None:
            if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
                root = os.path.join(self.project_dir, "checkpoints")
                folders = sorted(os.listdir(root), key=lambda f: int(re.findall(r"([0-9]+)(?=[^/]*$)", f)[0]))
                input_dir = os.path.join(root, folders[-1]) if folders else root
            if input_dir is not None:
                found = os.path.join(os.path.expanduser(input_dir), MODEL_NAME)
                if not os.path.isdir(found):
                    raise FileNotFoundError(
                        f"load_state({input_dir!r}): no engine checkpoint {found!r} (written by "
                        "save_state of llmpar's Accelerator)"
                    )
        super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        for s in self._schedulers:
            if isinstance(s, _MirroredScheduler):
                s.mirror_back()

    def free_memory(self, *objects: Any) -> Any:
        """accelerate's; the engine is dropped (llmpar's engine has nothing to destroy)."""
        if self._llmpar:
            self.deepspeed_engine_wrapped = None
        return super().free_memory(*objects)
