"""The pipeline engine, which ``llmpar.initialize`` returns for a config with a ``"pipeline"`` block (pp x dp x tp).

    engine, optimizer, _, scheduler = llmpar.initialize(model=GPT(cfg), config={
        "train_micro_batch_size_per_gpu": 2,
        "pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 8},
        "tensor_parallel": {"size": 2},
        "zero_optimization": {"stage": 1}, "optimizer": {...}, "gradient_clipping": 1.0})
    loss = engine.train_batch(x, y)          # x, y: [micro * micro_batches, T], this dp rank's rows of the step

What it does: ``llmpar.init_distributed(pp=stages, tp=size)`` builds the ``[pp, dp, tp]`` mesh (dp = the rest of the
world; or pass ``mesh=``), ``llmpar.pipeline.split`` cuts the model into stages with tensor-parallel layers inside,
a :class:`PipelineRunner` drives the schedule, and a ZeroOptimizer (stage 0, 1 or 2) per pp rank shards that rank's
stage params over dp (``llmpar.pipeline.zero``); the clipping norm is the whole model's.

Semantics follow DeepSpeed's PipelineEngine: ``pipeline.micro_batches`` *is* ``gradient_accumulation_steps``, and
``train_batch`` runs one whole optimizer step (all micro-batches, ZeRO step, scheduler step) and returns the step's
mean loss (averaged over dp). With equal micro-batches this is exactly the plain engine's
``gas x (engine(x_i); engine.backward(loss_i); engine.step())``: mean over the batch, one optimizer step.
``train_batch`` takes the step's whole batch ``(x, y)`` of ``train_micro_batch_size_per_gpu x micro_batches`` rows,
or ``data_iter`` (DeepSpeed's form, positional or by name), an iterator of ``(x, y)`` micro-batches of which it pulls
``micro_batches`` and which it keeps for the next calls, or nothing: then it pulls from ``training_dataloader``, the
loader ``initialize(training_data=...)`` built as DeepSpeed's PipelineEngine does (this dp rank's share in order, no
shuffling, restarting at the end: :class:`RepeatingLoader`). As in DeepSpeed only the first and the last stage pull
(the inputs and the labels), and ``train_batch`` puts the stages in train mode. ``eval_batch(data_iter)`` pulls
``micro_batches`` the same way and returns their mean loss, forward only (no gradients, stages left in eval mode).
Pulling ends with one small agreement over the engine's ranks (every rank, the stages between too), so that an
iterator running out on one rank (:class:`DataExhaustedError`, a StopIteration naming the rank, the step and the
micro-batches pulled and expected) or failing there raises on every rank before the step starts, instead of that rank
failing while the others wait in the schedule; the engine stays usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from llmpar.checkpoint.protocol import Grid
from llmpar.distributed.agree import raise_if_any_failed
from llmpar.distributed.collectives import Group, group_rank, group_size
from llmpar.runtime.config import Config
from llmpar.runtime.engine_base import EngineBase, reports_step
from llmpar.runtime.params import unsplit_names
from llmpar.runtime.resume import ResumableLoader

if TYPE_CHECKING:  # the runner module loads torch.distributed.pipelining
    from llmpar.pipeline.runner import PipelineRunner, StepStats


class DataExhaustedError(StopIteration):
    """A pipeline engine's data iterator ran out before giving a step's micro-batches. A StopIteration, so that a
    DeepSpeed loop ending on ``except StopIteration`` still ends, on every rank; the message names the rank, the step,
    and how many micro-batches were pulled of how many expected."""


class PipelineEngine(EngineBase):
    """One optimizer step per :meth:`train_batch` over this rank's pipeline stages (module docstring)."""

    def __init__(
        self, module: nn.Module, config: Config, runner: PipelineRunner, optimizer: Any, scheduler: Any, mesh: Any
    ) -> None:
        super().__init__(module, config, optimizer, scheduler)
        self.runner, self.mesh = runner, mesh
        self.training_dataloader: Any = None  # DeepSpeed's names: the loader train_batch() pulls from, its iterator
        self.data_iterator: Iterator | None = None

    def is_pipe_parallel(self) -> bool:
        return self.runner.split.pp > 1

    # DeepSpeed's PipelineEngine accessors
    @property
    def num_stages(self) -> int:
        return self.runner.num_stages

    @property
    def stage_id(self) -> int:
        """This rank's (first) stage."""
        return self.runner.split.stage_indices[0]

    @property
    def micro_batches(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_first_stage(self) -> bool:
        return self.runner.has_first

    def is_last_stage(self) -> bool:
        return self.runner.has_last

    def set_dataloader(self, loader: Any) -> None:
        """``train_batch()`` pulls from ``loader`` from now on (from its start)."""
        self.training_dataloader, self.data_iterator = loader, iter(loader)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """``train_batch()`` pulls from ``iterator`` from now on."""
        self.training_dataloader, self.data_iterator = None, iterator

    @property
    def stages(self) -> list[nn.Module]:
        """This rank's stage modules."""
        return list(self.runner.split.modules)

    def train(self, mode: bool = True) -> "PipelineEngine":
        """This rank's stages (and the module, as DeepSpeed's ``module.train()``) in train or eval mode."""
        self.module.train(mode)
        for m in self.runner.split.modules:
            m.train(mode)
        return self

    def eval(self) -> "PipelineEngine":
        return self.train(False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a pipeline engine runs whole steps: use engine.train_batch(x, y) (or data_iter=) instead "
            "of engine(x) / engine.backward / engine.step"
        )

    forward = backward = step = __call__

    # the step
    @reports_step
    def train_batch(
        self,
        x: Any = None,
        y: torch.Tensor | None = None,
        *,
        data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Forward + backward of all ``micro_batches``, the ZeRO step and the scheduler step; returns the step's mean
        loss (a float64 scalar, the same on every rank). ``train_batch(data_iter)``, as DeepSpeed's, takes the
        iterator positionally too; see the module docstring for where the data comes from."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_batch() needs gradients enabled (it runs under torch.no_grad()); use "
                "eval_batch() for the loss alone"
            )
        if x is not None and y is None and data_iter is None and not isinstance(x, (torch.Tensor, list, tuple)):
            x, data_iter = None, x  # DeepSpeed's train_batch(data_iter)
        if data_iter is not None:
            if x is not None or y is not None:
                raise TypeError("train_batch takes (x, y) or data_iter, not both")
            self.set_dataiterator(data_iter)
        if x is None and y is None:
            if self.data_iterator is None:
                raise TypeError("train_batch needs (x, y), a data_iter, or training_data= given to llmpar.initialize")
            x, y = self._pull(self.data_iterator, "train_batch")
        rows = self.runner.batch_rows
        for what, t in (("x", x), ("y", y)):  # up front, so that the pipeline stays usable (the runner checks too)
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != rows):
                raise ValueError(
                    f"train_batch: {what} has {t.shape[0] if t.dim() else 0} rows; a step takes "
                    f"train_micro_batch_size_per_gpu x gradient_accumulation_steps = {rows} rows per "
                    "dp rank"
                )
        self.train()
        loss = self.runner.step(x, y)
        self.micro_steps += self.config.gradient_accumulation_steps
        self._finish_step(self.optimizer.step(), loss)
        self._update_expert_biases()
        return torch.tensor(loss, dtype=torch.float64)

    def _update_expert_biases(self) -> None:
        """The aux-loss-free bias step of this rank's MoE layers with an expert bias (the load summed over the
        stage's dp ranks), after each optimizer step as the plain engine does."""
        from llmpar.moe.block import MoEBlock

        for sm in self.runner.split.modules:
            for b in sm.modules():
                r = getattr(b, "router", None)
                if isinstance(b, MoEBlock) and r.expert_bias is not None and r.config.bias_update_rate:
                    b.update_expert_bias(self.optimizer.dp_group.get())

    @reports_step
    def eval_batch(
        self,
        data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> torch.Tensor:
        """The mean loss of ``micro_batches`` micro-batches pulled from ``data_iter`` (averaged over dp, the same on
        every rank), forward only: no gradients, no optimizer step, the training iterator untouched. DeepSpeed's
        signature; logits, ``compute_loss=False``, other reductions and another micro-batch count are not
        supported (``bcast_loss`` is accepted: the loss is on every rank)."""
        m = self.config.gradient_accumulation_steps
        if return_logits or not compute_loss or reduce_output != "avg":
            raise ValueError(
                f"eval_batch(return_logits={return_logits}, compute_loss={compute_loss}, reduce_output="
                f"{reduce_output!r}) is not supported: only the mean loss (the defaults)"
            )
        if num_micro_batches is not None and num_micro_batches != m:
            raise ValueError(
                f"eval_batch(num_micro_batches={num_micro_batches}): the pipeline runs "
                f"gradient_accumulation_steps = {m} micro-batches per batch"
            )
        if data_iter is None or not hasattr(data_iter, "__next__"):
            raise TypeError(
                f"eval_batch needs an iterator of (inputs, labels) micro-batches, got {type(data_iter).__name__}"
            )
        x, y = self._pull(data_iter, "eval_batch")
        self.eval()
        return torch.tensor(self.runner.evaluate(x, y), dtype=torch.float64)

    def _pull(self, data_iter: Iterator, what: str) -> tuple[list | None, list | None]:
        """``micro_batches`` (inputs, labels) pairs from ``data_iter``, pulled on the first and the last stage only
        (as DeepSpeed): (inputs, labels) lists there, (None, None) on the stages between. Then every rank of the
        engine agrees that every rank pulled its data (one 1-element all-reduce over the mesh): a rank whose iterator
        ran out or failed re-raises its error, the others raise the same type naming it."""
        pairs: list | None = None
        error: BaseException | None = None
        if self.runner.has_first or self.runner.has_last:
            try:
                pairs = self._pairs(data_iter, what)
            except Exception as err:  # noqa: BLE001 - reported to every rank below
                error = err
        groups = [self.mesh.get_group(a) for a in ("pp", "dp", "tp") if self.mesh[a].size() > 1]
        if dist.is_initialized() and self.mesh.size() == dist.get_world_size():
            groups = [dist.group.WORLD]  # the mesh is the job: one all-reduce over it
        if groups:
            raise_if_any_failed(error, groups, what=what, types=(DataExhaustedError,))
        elif error is not None:
            raise error
        if pairs is None:
            return None, None
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _pairs(self, data_iter: Iterator, what: str) -> list:
        m = self.config.gradient_accumulation_steps
        pairs = []
        for _ in range(m):
            try:
                pairs.append(next(data_iter))
            except StopIteration:
                stage = ", ".join(map(str, self.runner.split.stage_indices))
                raise DataExhaustedError(
                    f"{what}: the data iterator ran out on global rank {self.global_rank} (pp stage {stage}) in "
                    f"optimizer step {self.global_steps + 1} after {len(pairs)} of the {m} micro-batches {what} "
                    f"pulls (gradient_accumulation_steps = pipeline micro_batches = {m}): give every step {m} "
                    "(inputs, labels) pairs on the first and the last stage, or repeat the data (initialize("
                    "training_data=...) builds a repeating loader)"
                ) from None
        bad = next((p for p in pairs if not isinstance(p, (tuple, list)) or len(p) != 2), None)
        if bad is not None:
            raise TypeError(f"{what}: the data must yield (inputs, labels) pairs, got {type(bad).__name__}")
        return pairs

    # bubble accounting
    def bubble_fraction(self) -> float:
        """The schedule's idle fraction, (p - 1) / (m + p - 1) for GPipe and 1F1B (``schedules.py``)."""
        return self.runner.bubble_formula()

    def last_stats(self) -> StepStats:
        """This rank's measured numbers for the last step (wall, busy, measured ``bubble``, in-flight micro-batches)."""
        if self.runner.last_stats is None:
            raise RuntimeError("last_stats() needs a train_batch() first")
        return self.runner.last_stats

    def pipeline_stats(self) -> list[StepStats]:
        """Every pp rank's :class:`StepStats` of the last step (a collective over pp: call it on every rank)."""
        return self.runner.gather_stats()

    # checkpoint protocol: the optimizer names a param ``stage{s}.{name in the stage module}``
    # (``stage1.blocks_3.attn.qkv.weight``); the checkpoint records the unsplit model's name
    # (``blocks.3.attn.qkv.weight``): the blocks of ``to_blocks`` hold the model's own submodules, so each stage-local
    # name maps through the block's tensor to its name in the model. A weight tied between stages maps to one name
    # (the model's first) and is written once, by the lowest stage holding it.
    def checkpoint_grid(self) -> Grid:
        """dp (the optimizer's group) x tp x pp (pp only when > 1)."""
        split = self.runner.split
        return Grid.of(
            self.optimizer.dp_group,
            split.tp_group,
            split.pp_group if split.pp > 1 else None,
            self.optimizer.checkpoint_device(),
        )

    def checkpoint_modules(self) -> list[nn.Module]:
        """This rank's stage modules."""
        return list(self.runner.split.modules)

    def checkpoint_named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        """(``stage{s}.{local name}``, tensor) of this rank's stage params / buffers, tied ones under every name."""
        split = self.runner.split
        return [
            (f"stage{s}.{n}", t)
            for m, s in zip(split.modules, split.stage_indices)
            for n, t in getattr(m, kind)(remove_duplicate=False)
        ]

    def checkpoint_names(self) -> dict[str, str]:
        """{``stage{s}.{local name}``: name in the unsplit model} of this rank's params and buffers."""
        return unsplit_names(
            self.module, self.checkpoint_named("named_parameters") + self.checkpoint_named("named_buffers")
        )

    def checkpoint_duplicates(self) -> set[str]:
        """Optimizer names of this rank's tied copies that a lower stage holds too (that stage writes them)."""
        dup = {id(p) for p in self.runner.tied_duplicates}
        return {name for buf in self.optimizer.checkpoint_params() for name, p in buf if id(p) in dup}


class RepeatingLoader:
    """DeepSpeed's ``RepeatingLoader``: iterates ``loader`` forever, starting it again when it ends."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)

    def position(self, replicas: int) -> dict[str, Any]:
        """Where the pass in progress stands (``ResumableLoader.position``; a checkpoint saves it)."""
        return self.loader.position(replicas)

    def resume(self, position: dict[str, Any], replicas: int) -> None:
        """Go on from ``position`` (a checkpoint load): the pass in progress is replaced by one starting there."""
        self.loader.resume(position, replicas)
        self.data_iter = iter(self.loader)


def pipeline_loader(
    training_data: Any, collate_fn: Callable | None, micro_batch: int, dp_group: Group
) -> RepeatingLoader:
    """DeepSpeed's PipelineEngine loader: this dp rank's share of ``training_data`` (a ``DistributedSampler``
    without shuffling: samples ``rank, rank + dp, ...``), ``micro_batch`` samples a batch, repeated forever."""
    from torch.utils.data import DistributedSampler

    if not hasattr(training_data, "__getitem__") or not hasattr(training_data, "__len__"):
        raise TypeError(
            f"training_data must be a map-style dataset (__getitem__ and __len__), got {type(training_data).__name__}"
        )
    sampler = DistributedSampler(
        training_data, num_replicas=group_size(dp_group), rank=group_rank(dp_group), shuffle=False
    )
    return RepeatingLoader(
        ResumableLoader(training_data, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn)
    )


def is_pipeline_module(model: Any) -> bool:
    """Whether ``model`` is a :class:`llmpar.pipeline.module.PipelineModule` (which always means a pipeline engine)."""
    from llmpar.pipeline.module import PipelineModule

    return isinstance(model, PipelineModule)


__all__ = ["PipelineEngine", "RepeatingLoader", "is_pipeline_module", "pipeline_loader"]
