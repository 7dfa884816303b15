"""``PipelineRunner``: one training step of a split model over a ``torch.distributed.pipelining`` schedule.

    parts = llmpar.pipeline.split(model, env.mesh, virtual_stages=1)
    runner = PipelineRunner(parts, GPT.loss, schedule="1f1b", micro_batches=8, dp_group=env.mesh["dp"])
    opt = torch.optim.AdamW(runner.parameters(), ...)
    for x, y in batches:                       # x: [B, T] ids, y: [B, T] targets; the same on every pp rank
        opt.zero_grad()
        loss = runner.step(x, y)               # forward + backward of all micro-batches; returns the global loss
        runner.clip_grad_norm_(1.0)            # norm of the whole (unsplit) model, same on every rank
        opt.step()

Semantics, identical to plain training on the same batch: ``loss_fn(output, target)`` must return the *mean* over
its micro-batch. The batch ``B`` is cut into ``m`` micro-batches of sizes ``torch.tensor_split`` gives (they need
not divide evenly); micro-batch i's loss is weighted by ``numel(target_i) / numel(target)``, so the losses sum to
the mean over the whole batch and the gradients equal those of ``loss_fn(model(x), y).backward()``.
``torch.distributed.pipelining`` needs equal micro-batch shapes, so short micro-batches are padded with copies of
their first row and the padding is cut off before the loss (rows must not interact, which holds for
transformers). With ``dp_group``, gradients and the loss are then averaged over it (``all_reduce(op="avg")``):
dp ranks each holding B rows train like one process with dp*B rows. Leave ``dp_group=None`` when an optimizer
that reduces gradients itself (ZeRO) takes over. Gradients of parameters shared between stages (tied
embeddings) are summed over the pp group.

A failure on any rank fails the step on every rank with that rank's traceback (see ``_failure.py``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.collectives import Group, GroupRef, all_gather_flat, all_reduce, group_size
from llmpar.optim.grad_norm import clip_grad_norm_
from llmpar.pipeline._failure import FailureChannel
from llmpar.pipeline._stage import MeteredStage
from llmpar.pipeline.schedules import bubble_fraction, check_schedule, schedule_class
from llmpar.pipeline.stages import PipelineSplit
from llmpar.pipeline.tied import resolve_tied, set_grad, sync_tied_grads, sync_tied_zero


@dataclass(kw_only=True)
class StepStats:
    """This rank's numbers for the last step (the schedule part: no dp or tied-gradient sync)."""

    wall_s: float
    busy_s: float  # forward, backward and loss compute of this rank's stages
    peak_in_flight: int  # most micro-batches whose forward was done and backward not, on one local stage
    peak_activation_bytes: int  # saved-for-backward bytes at their peak (needs track_memory=True), max over stages
    bubble_formula: float

    @property
    def bubble(self) -> float:
        """Measured idle fraction: 1 - busy / wall (idle includes waiting on sends and receives)."""
        return max(0.0, 1.0 - self.busy_s / self.wall_s) if self.wall_s > 0 else 0.0


class PipelineRunner:
    """Drives this rank's stages of ``split`` through a schedule; see the module docstring."""

    def __init__(
        self,
        split: PipelineSplit,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        *,
        micro_batches: int,
        schedule: str = "1f1b",
        dp_group: Group | None = None,
        monitor: bool = True,
        track_memory: bool = False,
    ) -> None:
        if not isinstance(split, PipelineSplit):
            raise TypeError(
                f"split must be the PipelineSplit that llmpar.pipeline.split() returns, got {type(split).__name__}"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
        self.split = split
        self.loss_fn = loss_fn
        self.schedule_name = check_schedule(
            schedule, pp=split.pp, micro_batches=micro_batches, virtual_stages=split.virtual_stages
        )
        self.micro_batches = micro_batches
        self.dp_group = GroupRef(dp_group) if dp_group is not None else None
        self.num_stages = split.num_stages
        self.has_first = 0 in split.stage_indices
        self.has_last = self.num_stages - 1 in split.stage_indices
        self.device = next(itertools.chain(*(m.parameters() for m in split.modules)), torch.empty(0)).device
        self.stages = [
            MeteredStage(mod, s, self.num_stages, self.device, group=split.pp_group, track_memory=track_memory)
            for mod, s in zip(split.modules, split.stage_indices)
        ]
        cls = schedule_class(self.schedule_name)
        first = self.stages if self.schedule_name == "interleaved_1f1b" else self.stages[0]
        self.schedule = cls(first, micro_batches, loss_fn=self._loss, scale_grads=False)
        self.monitor = monitor
        rank = dist.get_rank() if dist.is_initialized() else 0
        blocks = [b for s in split.stage_indices for b in split.stages[s].blocks]
        self.where = (
            f"global rank {rank}, pp rank {split.pp_rank} (stage{'s' if len(self.stages) > 1 else ''} "
            f"{', '.join(map(str, split.stage_indices))}: {', '.join(blocks)})"
        )
        self.channel = FailureChannel.for_runner()
        self._params = _unique(p for m in split.modules for p in m.parameters())
        # tied weights (tied.py): this rank's copies, and those the grad norm skips (read by llmpar.checkpoint)
        self._tied, self._tied_duplicates = resolve_tied(split, self.device)
        self.zero: Any = None  # a ZeroOptimizer that reduces the grads over dp (attach_zero)
        self.batch_rows: int | None = None  # set by the engine: rows every step's batch must have
        self._targets: torch.Tensor | None = None
        self._total = 1
        self._loss_s = 0.0
        self.last_stats: StepStats | None = None

    # ------------------------------------------------------------------ public

    @property
    def tied_duplicates(self) -> list[nn.Parameter]:
        """This rank's copies of weights tied across stages that a lower stage holds too (not counted by the grad norm,
        not written by a checkpoint)."""
        return list(self._tied_duplicates)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (each once), for the optimizer."""
        return list(self._params)

    def attach_zero(self, optimizer: Any) -> None:
        """Hand the dp reduction to ``optimizer`` (a ``ZeroOptimizer`` over this rank's :meth:`parameters`): each
        step then accumulates all micro-batches locally, ZeRO reduces at the step boundary (stage 2: every
        micro-batch into its partition), tied weights' reduced grads are summed over pp inside ZeRO's shards, and the
        loss is averaged over ZeRO's dp group. Build the runner with ``dp_group=None`` (see
        ``llmpar.pipeline.zero_optimizer``, which does all of this)."""
        if self.dp_group is not None:
            raise ValueError(
                "attach_zero: this runner averages gradients over dp_group itself; build it with "
                "dp_group=None so that ZeRO alone reduces them"
            )
        if not all(hasattr(optimizer, a) for a in ("reduce_gradients", "grad_pieces", "dp_group")):
            raise TypeError(f"attach_zero takes a llmpar.zero.ZeroOptimizer, got {type(optimizer).__name__}")
        if getattr(optimizer, "stage", 0) == 3:
            raise ValueError("attach_zero: ZeRO stage 3 is not supported inside pipeline stages; use stage 0, 1 or 2")
        experts = getattr(optimizer, "experts", None)  # expert params: the optimizer's own one over edp
        owned = {id(p) for o in (optimizer, experts) if o is not None for g in o.param_groups for p in g["params"]}
        missing = [
            n for m in self.split.modules for n, p in m.named_parameters() if p.requires_grad and id(p) not in owned
        ]
        if missing:
            raise ValueError(
                f"attach_zero: the optimizer does not hold this rank's params {missing[:4]}"
                f"{' ...' if len(missing) > 4 else ''}: build it from runner.parameters()"
            )
        self.zero = optimizer

    def step(
        self,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None,
        targets: torch.Tensor | Sequence[torch.Tensor] | None,
    ) -> float:
        """Forward and backward of one batch; returns the batch's mean loss (averaged over dp), on every rank.

        ``inputs`` (needed on the rank of the first stage) and ``targets`` (rank of the last stage) are the whole
        batch ``[B, ...]`` cut into ``micro_batches`` pieces, or already cut: a list of ``micro_batches`` tensors.
        Gradients accumulate into ``.grad`` (zero them before, as with ``loss.backward()``).
        """
        if self.monitor:
            return self.channel.run(lambda: self._step(inputs, targets), self.where)
        return self._step(inputs, targets)

    def evaluate(
        self,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None,
        targets: torch.Tensor | Sequence[torch.Tensor] | None,
    ) -> float:
        """The forward pass alone of one batch (as :meth:`step`, without gradients: ``.grad`` is left as it is);
        returns the batch's mean loss (averaged over dp), on every rank. Put the stage modules in eval mode first
        for dropout-free numbers."""
        if self.monitor:
            return self.channel.run(lambda: self._evaluate(inputs, targets), self.where)
        return self._evaluate(inputs, targets)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so that the whole model's gradient norm is at most ``max_norm`` (torch's coefficient, on
        the device: no host sync); returns the norm before clipping, a float64 0-d tensor.

        Tensor-parallel shards are summed over tp, replicated parameters counted once, tied copies once, and the
        stages' sums added over pp: every rank gets the norm of the unsplit model (``llmpar.optim.grad_norm``)."""
        return clip_grad_norm_(
            self._params,
            max_norm,
            tp_group=self.split.tp_group,
            pp_group=self.split.pp_group,
            skip=self._tied_duplicates,
        )

    def bubble_formula(self) -> float:
        return bubble_fraction(
            self.schedule_name,
            pp=self.split.pp,
            micro_batches=self.micro_batches,
            virtual_stages=self.split.virtual_stages,
        )

    def gather_stats(self) -> list[StepStats]:
        """Every pp rank's :class:`StepStats` of the last step, in pp-rank order (a collective over pp)."""
        if self.last_stats is None:
            raise RuntimeError("gather_stats() needs a step() first")
        s = self.last_stats
        mine = torch.tensor(
            [s.wall_s, s.busy_s, s.peak_in_flight, s.peak_activation_bytes], dtype=torch.float64, device=self.device
        )
        out = torch.empty(4 * self.split.pp, dtype=torch.float64, device=self.device)
        all_gather_flat(out, mine, self.split.pp_group)
        rows = out.view(self.split.pp, 4).tolist()
        return [
            StepStats(
                wall_s=w, busy_s=b, peak_in_flight=int(f), peak_activation_bytes=int(a), bubble_formula=s.bubble_formula
            )
            for w, b, f, a in rows
        ]

    # ------------------------------------------------------------------ internals

    def _cut(self, data: torch.Tensor | Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        m = self.micro_batches
        rows = data.shape[0] if isinstance(data, torch.Tensor) and data.dim() else None
        if self.batch_rows is not None and rows is not None and rows != self.batch_rows:
            raise ValueError(
                f"{what} has {rows} rows; a step takes train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps = {self.batch_rows} rows per dp rank"
            )
        if isinstance(data, torch.Tensor):
            if data.dim() < 1 or data.shape[0] < m:
                raise ValueError(f"{what} has {data.shape[0] if data.dim() else 0} rows, fewer than micro_batches={m}")
            return list(torch.tensor_split(data, m))
        parts = list(data) if isinstance(data, (list, tuple)) else None
        if (
            parts is None
            or len(parts) != m
            or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] for t in parts)
        ):
            raise TypeError(f"{what} must be a tensor [B, ...] or a list of micro_batches={m} non-empty tensors")
        return parts

    @staticmethod
    def _pad(parts: list[torch.Tensor]) -> torch.Tensor:
        rows = max(t.shape[0] for t in parts)
        padded = [
            t if t.shape[0] == rows else torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])]) for t in parts
        ]
        return torch.cat(padded)

    def _loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Loss of one (padded) micro-batch; ``index`` holds each row's position in the batch, -1 for padding."""
        t0 = time.perf_counter()
        assert self._targets is not None
        n = int((index >= 0).sum())
        target = self._targets.index_select(0, index[:n])
        out = output if n == index.numel() else output[:n]  # unpadded: as it is (a loss computed by the model too)
        loss = self.loss_fn(out, target) * (target.numel() / self._total)
        self._loss_s += time.perf_counter() - t0
        return loss

    def _inputs(self, inputs: Any, targets: Any) -> tuple[tuple, dict[str, Any]]:
        """The schedule's (args, kwargs) for one batch: the padded inputs on the first stage, the row index as the
        ``target`` and a list for the losses on the last (``_targets`` holds the real targets for ``_loss``)."""
        args: tuple = ()
        kwargs: dict[str, Any] = {}
        if self.has_first:
            if inputs is None:
                raise ValueError(f"inputs is None on {self.where}, which runs the first stage")
            args = (self._pad([t.to(self.device) for t in self._cut(inputs, "inputs")]),)
        if self.has_last:
            if targets is None:
                raise ValueError(f"targets is None on {self.where}, which runs the last stage")
            parts = self._cut(targets, "targets")
            rows = max(t.shape[0] for t in parts)
            index, start = [], 0
            for t in parts:
                n = t.shape[0]
                index.append(torch.cat([torch.arange(start, start + n), torch.full((rows - n,), -1)]))
                start += n
            self._targets = torch.cat([t.to(self.device) for t in parts])
            self._total = self._targets.numel()
            kwargs = {"target": torch.cat(index).to(self.device), "losses": []}
        for st in self.stages:
            st.reset_stats()
        self._loss_s = 0.0
        return args, kwargs

    def _summed_loss(self, kwargs: dict[str, Any]) -> torch.Tensor:
        """The batch's loss (the last stage's micro-batch losses summed), the same on every pp rank."""
        loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.has_last:
            loss += sum(float(x.detach()) for x in kwargs["losses"])
        if self.split.pp > 1:
            all_reduce(loss, self.split.pp_group)  # only the last stage's is non-zero
        return loss

    def _step(self, inputs: Any, targets: Any) -> float:
        args, kwargs = self._inputs(inputs, targets)
        if self.zero is not None:  # every micro-batch's backward accumulates; ZeRO reduces at step()
            self.zero.set_gradient_accumulation_boundary(False)
        t0 = time.perf_counter()
        try:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        finally:
            self._targets = None
        wall = time.perf_counter() - t0
        self.last_stats = StepStats(
            wall_s=wall,
            busy_s=sum(st.busy_s for st in self.stages) + self._loss_s,
            peak_in_flight=max(st.peak_in_flight for st in self.stages),
            peak_activation_bytes=max(st.meter.peak for st in self.stages),
            bubble_formula=self.bubble_formula(),
        )

        loss = self._summed_loss(kwargs)
        if self.zero is not None:
            sync_tied_zero(self, self.zero)
            if group_size(self.zero.dp_group) > 1:
                all_reduce(loss, self.zero.dp_group, op="avg")
            return float(loss)
        sync_tied_grads(self._tied, self.split.pp_group, self.device)
        if self.dp_group is not None and group_size(self.dp_group) > 1:
            loss = self._sync_dp(loss)
        return float(loss)

    def _evaluate(self, inputs: Any, targets: Any) -> float:
        args, kwargs = self._inputs(inputs, targets)
        try:
            with torch.no_grad():
                self.schedule.eval(*args, return_outputs=False, **kwargs)
        finally:
            self._targets = None
        loss = self._summed_loss(kwargs)
        dp = self.zero.dp_group if self.zero is not None else self.dp_group
        if dp is not None and group_size(dp) > 1:
            all_reduce(loss, dp, op="avg")
        return float(loss)

    def _sync_dp(self, loss: torch.Tensor) -> torch.Tensor:
        """Average every local gradient and the loss over the dp group in one all-reduce."""
        assert self.dp_group is not None
        dtype = self._params[0].dtype if self._params else torch.float64
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in self._params]
            + [loss.to(dtype)]
        )
        all_reduce(flat, self.dp_group, op="avg")
        offset = 0
        for p in self._params:
            n = p.numel()
            set_grad(p, flat[offset : offset + n])
            offset += n
        return flat[-1:].double()


def _unique(params: Any) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


__all__ = ["PipelineRunner", "StepStats"]
