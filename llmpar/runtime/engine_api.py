"""DeepSpeed's engine API as scripts call it, for both engines (``EngineBase`` derives from :class:`DeepSpeedAPI`):
ranks and device, the config accessors, the step flags and ``deepspeed_io`` (``engine.monitor``: ``monitor.py``).

    engine.global_rank, engine.local_rank, engine.world_size, engine.dp_world_size, engine.device
    engine.gradient_clipping(), engine.steps_per_print(), engine.zero_optimization_stage(), engine.get_data_types()
    engine.was_step_applied()          # the last step() applied an optimizer step (read on the host when asked)
    engine.compile(backend="inductor", compile_kwargs=None)   # torch.compile the model (``compile.py``)
    loader = engine.deepspeed_io(dataset)   # DeepSpeed's loader: DistributedSampler over dp, shuffled, micro batches

Every accessor reads the typed config (``engine.config``) or the optimizer; nothing here changes training.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.collectives import collective_device, group_rank, group_size
from llmpar.distributed.discovery import local_rank
from llmpar.runtime.resume import ResumableLoader, resumable
from llmpar.zero.config import OffloadConfig


class DeepSpeedLoader(ResumableLoader):
    """A ``torch.utils.data.DataLoader`` with DeepSpeed's ``data_sampler`` name for its sampler, which knows where its
    current pass stands (engine checkpoints save it and a load resumes there: ``resume.py``)."""

    @property
    def data_sampler(self) -> Any:
        return self.sampler


class DeepSpeedAPI:
    """DeepSpeed's engine accessors over ``self.config`` (a :class:`llmpar.runtime.Config`), ``self.optimizer`` (a
    ZeroOptimizer) and ``self.module``."""

    config: Any
    optimizer: Any
    module: nn.Module
    lr_scheduler: Any
    collate_fn: Callable | None
    _step_applied: Any
    checkpoint_modules: Callable[[], list[nn.Module]]  # this rank's modules (EngineBase; a pipeline's stages)

    # the module's tensors (DeepSpeed's engine is the module's nn.Module wrapper: code that walks it finds them)
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse)

    # ranks and device
    @property
    def global_rank(self) -> int:
        """This process's rank in the job."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK`` (torchrun / DeepSpeed's launcher; the global rank on a single node without one)."""
        return local_rank(self.global_rank)

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (DeepSpeed's name)."""
        return group_size(self.optimizer.dp_group)

    @property
    def dataloader_position(self) -> dict | None:
        """Where ``training_dataloader``'s current pass stands (saved with the engine counters; None without a
        loader of ``deepspeed_io``); assigning one (a checkpoint load) makes its next pass start there."""
        loader = resumable(getattr(self, "training_dataloader", None))
        return loader.position(self.dp_world_size) if loader is not None else None

    @dataloader_position.setter
    def dataloader_position(self, value: dict | None) -> None:
        loader = resumable(getattr(self, "training_dataloader", None))
        if value is not None and loader is not None:
            loader.resume(value, self.dp_world_size)

    @property
    def dp_rank(self) -> int:
        """This rank's place in its data-parallel group."""
        return group_rank(self.optimizer.dp_group)

    @property
    def mp_world_size(self) -> int:
        """Tensor-parallel ranks (DeepSpeed's model-parallel world size; 1 without tensor parallelism)."""
        tp = getattr(self.optimizer, "tp_group", None)
        return group_size(tp) if tp is not None else 1

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_tensor_parallel_rank(self) -> int:
        tp = getattr(self.optimizer, "tp_group", None)
        return group_rank(tp) if tp is not None else 0

    get_model_parallel_rank = get_tensor_parallel_rank

    @property
    def device(self) -> torch.device:
        """Where the model's params live (the collective device when every param is on the meta device)."""
        for m in self.checkpoint_modules():  # this rank's modules (a pipeline engine's stages)
            for p in m.parameters():
                if p.device.type != "meta":
                    return p.device
        return collective_device(self.optimizer.dp_group)

    # config accessors (DeepSpeed's names)
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def gradient_clipping(self) -> float:
        """The max global grad norm (0.0: no clipping)."""
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16

    def fp16_enabled(self) -> bool:
        return bool(getattr(getattr(self.config, "fp16", None), "enabled", False))

    def amp_enabled(self) -> bool:
        """Apex AMP: never (llmpar runs bf16 / fp16 itself)."""
        return False

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype) as the engine runs them."""
        buffers = getattr(self.optimizer, "buffers", [])
        model = buffers[0].flat.dtype if buffers else next(self.module.parameters()).dtype
        return model, (buffers[0].grad.dtype if buffers else model)

    def zero_optimization(self) -> bool:
        """ZeRO is on (stage > 0)."""
        return self.config.zero.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def zero_optimization_partition_gradients(self) -> bool:
        """Gradients are partitioned over dp (stage 2 or 3)."""
        return self.config.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Params are partitioned over dp (stage 3)."""
        return self.config.zero.stage == 3

    def zero_offload_optimizer(self) -> OffloadConfig | None:
        """The ``offload_optimizer`` settings when optimizer offload is on, else None."""
        off = self.config.zero.offload_optimizer
        return off if off.enabled else None

    def zero_offload_param(self) -> OffloadConfig | None:
        """The ``offload_param`` settings when param offload is on, else None."""
        off = self.config.zero.offload_param
        return off if off.enabled else None

    def zero_cpu_offload(self) -> bool:
        return self.config.zero.offload_optimizer.enabled

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return self.config.zero.overlap_comm

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    def optimizer_name(self) -> str:
        """The optimizer's name: the config's ``optimizer.type`` or the client optimizer's class."""
        return getattr(self, "client_optimizer_name", None) or self.config.optimizer.type

    def optimizer_params(self) -> dict:
        """The config's ``optimizer.params`` as given (DeepSpeed's)."""
        return dict(self.config.optimizer_params)

    def scheduler_name(self) -> str | None:
        sched = self.config.scheduler
        return sched.type if sched is not None else None

    def wall_clock_breakdown(self) -> bool:
        return False

    def memory_breakdown(self) -> bool:
        return False

    # the step
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list[tuple[float, float]]:
        """Each param group's AdamW betas (DeepSpeed's momentum of Adam-type optimizers)."""
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global grad norm of the last optimizer step (None before the first; reading it syncs once)."""
        return self.optimizer.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` / ``train_batch()`` updated the params: False between accumulation boundaries
        and for a step skipped for non-finite gradients (reading it syncs with the device once)."""
        return bool(self._step_applied)

    # torch.compile (``compile.py``)
    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: dict | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """DeepSpeed's: compile the model with ``torch.compile(backend=backend, **compile_kwargs)`` (ZeRO 0-2: the
        whole model, ZeRO's reductions outside the graph; stage 3: each unit a region); ``compiled_autograd_enabled``:
        ``backward`` compiles the backward too. ``schedule`` (DeepCompile's passes) is accepted without effect. A
        second call does nothing. See ``llmpar.runtime.compile``."""
        from llmpar.runtime.compile import compile_engine

        compile_engine(self, backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran."""
        return getattr(self, "_compiled", None) is not None

    def is_deepcompile_enabled(self) -> bool:
        """DeepSpeed's: the ``"compile"`` block's ``deepcompile`` flag (accepted; its passes never run here)."""
        return bool(self.config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        """DeepSpeed's: whether DeepCompile's graph passes run: never in llmpar (ZeRO works around the graphs)."""
        return False

    def get_compile_time(self) -> dict[str, float]:
        """DeepSpeed's (there: its DeepCompile passes' times): the seconds ``torch.compile`` spent in this process
        by phase (dynamo's timed phases, summed over every graph), e.g. ``"_compile.compile_inner"`` for the total."""
        from llmpar.runtime.compile import compile_times

        return compile_times()

    # data
    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable | None = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedLoader:
        """DeepSpeed's loader of ``dataset``: micro-batches of ``batch_size`` (default
        train_micro_batch_size_per_gpu) from a ``DistributedSampler`` over the dp ranks (this rank's 1/dp of the
        samples; shuffled with seed 0 for ``route="train"``, in order for "eval" / "predict"; no drop_last; the same
        order every epoch unless you call ``loader.data_sampler.set_epoch(e)``), or your ``data_sampler``."""
        from torch.utils.data import Dataset, DistributedSampler, IterableDataset

        if route not in ("train", "eval", "predict"):
            raise ValueError(f'route={route!r} must be "train", "eval" or "predict"')
        if data_sampler is None and isinstance(dataset, IterableDataset):
            raise TypeError(
                "an IterableDataset has no indices for DeepSpeed's DistributedSampler: shard it over the "
                "dp ranks yourself (engine.dp_rank, engine.dp_world_size) and build a DataLoader"
            )
        if not isinstance(dataset, Dataset) and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(
                f"training data must be a torch Dataset (or have __getitem__ and __len__), got {type(dataset).__name__}"
            )
        if data_sampler is None:
            data_sampler = DistributedSampler(
                dataset, num_replicas=self.dp_world_size, rank=self.dp_rank, shuffle=route == "train"
            )
        return DeepSpeedLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            sampler=data_sampler,
            collate_fn=collate_fn or getattr(self, "collate_fn", None),
            pin_memory=pin_memory and torch.cuda.is_available(),
            num_workers=num_local_io_workers or 0,
        )


__all__ = ["DeepSpeedAPI", "DeepSpeedLoader"]
