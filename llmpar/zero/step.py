"""The step of a :class:`~llmpar.zero.optimizer.ZeroOptimizer` (``ZeroOptimizer`` derives from :class:`ZeroStep`):
what of each flat buffer this rank holds (its gradient and param shards per unit), the global gradient norm, and
``step()``: finish the reduction, unscale and clip (a non-finite norm skips the step on every rank, on the device),
one fused AdamW per buffer or per unit shard on the backend the buffer's mode and placement choose (the host step
under offload, the low-bit step for int8 / int4 states, ``llmpar.ops.adamw_step`` otherwise), the updated shards
all-gathered unit by unit as soon as each is stepped (stages 1/2, ``param_gather.py``), then the stats, the loss
scale and stage 3's persistent units. The optimizer's construction (its buffers: ``buffers.py``) is ``optimizer.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from llmpar.ops.adamw import MODES, adamw_step
from llmpar.optim.grad_norm import global_grad_norm
from llmpar.zero import lowbit_state
from llmpar.zero.experts import joint_norm, sync_hyperparameters
from llmpar.zero.loss_scale import unscale_and_clip
from llmpar.zero.offload import host_step_buffer
from llmpar.zero.param_gather import step_gather
from llmpar.zero.stats import StepApplied

if TYPE_CHECKING:
    from llmpar.distributed.collectives import CommCounter, GroupRef
    from llmpar.zero.config import OptimizerConfig
    from llmpar.zero.grads import FlatBuffer, GradReducer
    from llmpar.zero.loss_scale import LossScaler
    from llmpar.zero.offload import Copier, Placement
    from llmpar.zero.param_gather import DeferredGather
    from llmpar.zero.stage3 import Stage3Runtime
    from llmpar.zero.stats import NormStats

logger = logging.getLogger("llmpar")


class ZeroStep:
    """Mixin for ``ZeroOptimizer``: this rank's views of the buffers and the step (module docstring)."""

    # set by ZeroOptimizer.__init__
    buffers: list[FlatBuffer]
    param_groups: list[dict[str, Any]]
    config: OptimizerConfig
    stage: int
    rank: int
    seed: int
    dp_group: GroupRef
    tp_group: GroupRef | None
    pp_group: GroupRef | None
    _norm_skip: set[int]
    max_grad_norm: float | None
    counter: CommCounter | None
    reducer: GradReducer
    placement: Placement
    copier: Copier
    stats: NormStats
    loss_scaler: LossScaler | None
    stage3: Stage3Runtime | None
    deferred_gather: DeferredGather | None
    # the expert params' optimizer over the expert-data-parallel ranks (``experts.py``), and the expert-parallel
    # group: None until ZeroOptimizer.__init__ sets them (a meta-built model's materialize_sharded steps in before)
    experts: "ZeroStep | None" = None
    ep_group: GroupRef | None = None
    etp_group: GroupRef | None = None  # expert tensor parallelism: the expert norm is summed over it too

    if TYPE_CHECKING:

        def _check_alive(self, what: str) -> None: ...

    # ------------------------------------------------------------------ views
    def _rank(self) -> int:
        return self.rank if self.stage > 0 else 0

    def _grads(self, b: FlatBuffer) -> list[torch.Tensor]:
        units = range(len(b.layout.units))
        if self.stage >= 2 or b.host_grad is not None:  # the partition (stage 1 offload: its host copy)
            return [b.layout.shard_of_partition(b.grad if b.host_grad is None else b.host_grad, u) for u in units]
        return [b.layout.shard_of_full(b.grad, u, self._rank()) for u in units]

    def _shards(self, b: FlatBuffer) -> list[torch.Tensor]:
        if b.shard is not None:
            return [b.layout.shard_of_partition(b.shard, u) for u in range(len(b.layout.units))]
        return [b.layout.shard_of_full(b.flat, u, self._rank()) for u in range(len(b.layout.units))]

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        """Whether the next backward ends a gradient accumulation (stages 0/1 reduce only then; stage 2 reduces
        every micro-step into its partition)."""
        self.reducer.boundary = bool(boundary)
        if self.experts is not None:
            self.experts.set_gradient_accumulation_boundary(boundary)

    # ------------------------------------------------------------------- step
    def _global_norm(self) -> torch.Tensor:
        """The whole model's grad norm (``llmpar.optim.grad_norm``, float64 0-d on the device): this rank's partitions
        summed over dp (stages 1/2), tensor-parallel buffers over tp, stages over pp; ``norm_skip`` params left out."""
        repl: list[torch.Tensor] = []
        split: list[torch.Tensor] = []
        for b in self.buffers:
            if self._norm_skip and any(id(p) in self._norm_skip for p in b.params):
                grads = [v for i, v, _a, _z in self._grad_pieces(b) if id(b.params[i]) not in self._norm_skip]
            else:
                grads = self._grads(b)
            (split if b.tp_split else repl).extend(grads)
        return global_grad_norm(
            repl,
            split=split,
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            dp_group=self.dp_group if self.stage > 0 else None,
            device=self.buffers[0].flat.device,
            counter=self.counter,
        )

    def _grad_pieces(self, b: FlatBuffer) -> list[tuple[int, torch.Tensor, int, int]]:
        """(param index, view into this rank's grads, start, stop in the param's flat view) for buffer ``b``."""
        out = []
        for u, g in enumerate(self._grads(b)):
            for i, a, z, at in b.layout.param_slices(u, self._rank()):
                out.append((i, g[at : at + z - a], a, z))
        return out

    def reduce_gradients(self) -> None:
        """Finish the gradient reduction now (idempotent; step() calls it too). Afterwards :meth:`grad_pieces`
        gives this rank's reduced, dp-averaged gradients, e.g. to sum a shared weight's over the pipeline."""
        self.reducer.wait_all()
        self.reducer.reduce_now()
        if self.experts is not None:
            self.experts.reduce_gradients()

    def grad_pieces(self, param: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
        """The pieces of ``param``'s reduced gradient this rank holds: (view, start, stop) in ``param.reshape(-1)``
        (stage 0: the whole param; stages 1/2: this rank's slices). Valid after :meth:`reduce_gradients`."""
        for b in self.buffers:
            for i, p in enumerate(b.params):
                if p is param:
                    return [(v, a, z) for j, v, a, z in self._grad_pieces(b) if j == i]
        raise ValueError(f"grad_pieces: the tensor of shape {tuple(param.shape)} is not a param of this optimizer")

    def _units(self, b: FlatBuffer, name: str) -> list[torch.Tensor]:
        return [b.layout.shard_of_partition(b.state[name], u) for u in range(len(b.layout.units))]

    @torch.no_grad()
    def step(self) -> StepApplied:
        """Apply one AdamW step from the accumulated grads. Returns a :class:`StepApplied`, false when the step was
        skipped for non-finite grads (its ``bool()`` reads the device flag; nothing else here does)."""
        self._check_alive("step")
        if not self._finish_reduction():
            return StepApplied(None)
        norm = self._global_norm()
        experts = self.experts
        if experts is not None:  # expert params: their own optimizer over the expert-data-parallel ranks
            experts._finish_reduction()
            norm = joint_norm(norm, experts._global_norm(), self.ep_group, self.counter, self.etp_group)
        # the norm of the grads / loss scale; the clip coefficient with 1/scale folded in; found-inf skips the step
        norm, gscale, gscale64, found_inf = unscale_and_clip(norm, self.max_grad_norm, self.loss_scaler)
        self._apply_step(gscale, gscale64, found_inf)
        if experts is not None:
            sync_hyperparameters(self, experts)
            experts._apply_step(gscale, gscale64, found_inf)
        self.stats.record(norm, found_inf)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        return StepApplied(found_inf)

    def _finish_reduction(self) -> bool:
        """Wait for the gradient reduction of this accumulation (False: there was no backward since the last step)."""
        r = self.reducer
        r.wait_all()
        self.wait_params()
        if r.micro_steps == 0:
            logger.warning("ZeroOptimizer.step() without a backward since the last step: nothing to do")
            return False
        r.reduce_now()
        self.copier.sync()  # the host step reads the copied-out grads
        return True

    def _apply_step(self, gscale: torch.Tensor | None, gscale64: torch.Tensor | None, found_inf: torch.Tensor) -> None:
        """Step every buffer's partition with the clip / unscale coefficient ``gscale`` (float64 grads:
        ``gscale64``), skipped on every rank where ``found_inf``; then gather the params and reset the reducer."""
        r = self.reducer
        # stages 1/2: each unit's all-gather starts as soon as its shard is stepped, while the next units step
        # (``param_gather.py``); a skipped step left the shards as they were: gathering them is harmless
        gather = step_gather(self)
        for bi, b in enumerate(self.buffers):
            g = self.param_groups[b.group_index]
            hyper = dict(
                lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"]
            )
            grads, scale = self._grads(b), gscale
            if gscale64 is not None and b.grad.dtype == torch.float64:  # the fused step takes a float32 coefficient:
                torch._foreach_mul_(grads, gscale64.to(b.grad.device))  # float64 grads get theirs exactly
                scale = None
            for u in self._step_units(b, grads, each=gather is not None, gscale=scale, found_inf=found_inf, **hyper):
                if gather is not None:
                    gather.unit_stepped(bi, u)
        if gather is not None:
            gather.finish()
        if r.quantizer is not None and r.quantizer.reset_if_skipped(found_inf):  # a skip: no stale / NaN error
            logger.warning(
                "ZeroOptimizer: step skipped for non-finite gradients: the error-feedback residuals of "
                "the quantized gradients were reset"
            )
        if self.stage3 is not None:  # a skipped step left the shards as they were: re-gathering is harmless
            self.stage3.regather_persistent()
        r.reset()

    def _step_units(self, b: FlatBuffer, grads: list[torch.Tensor], *, each: bool, **kw: Any) -> Iterator[int]:
        """Step buffer ``b``'s partition, yielding each unit once its shard holds the new values: one fused call per
        unit when ``each`` (the same math and rounding stream as one call), else one call (the host step: one)."""
        units = list(range(len(b.layout.units)))
        lowbit = lowbit_state.bits_of(b.mode) is not None
        if lowbit:  # stochastic rounding of the codes: seeded per unit shard (lowbit_state.sr_salt)
            kw["sr"] = (self.seed, self._rank()) if self.config.stochastic_rounding else None
        if self.placement.offload_optimizer:
            (lowbit_state.host_step if lowbit else host_step_buffer)(b, self._shards(b), grads, **kw)
            yield from units
            return
        if lowbit:  # codes + scales per unit shard, whole blocks (lowbit_state.py)
            masters = self._units(b, "master") if "master" in b.state else None
            yield from lowbit_state.step_each(b, self._shards(b), grads, units, masters, each=each, **kw)
            return
        extra = MODES[b.mode].extra
        state = [self._shards(b), grads, self._units(b, "exp_avg"), self._units(b, "exp_avg_sq"), b.steps]
        extras = None if extra is None else self._units(b, extra[0])
        for sel in [[u] for u in units] if each else [units]:
            p, g, m, v, st = ([xs[u] for u in sel] for xs in state)
            ex = None if extras is None else [extras[u] for u in sel]
            adamw_step(p, g, m, v, st, precision=b.mode, extras=ex, seed=self.seed, salts=sel, **kw)
            yield from sel

    def wait_params(self) -> None:
        """Wait for a deferred all-gather of updated params (``overlap_param_gather``; ``param_gather.py``): call it
        before reading ``param.data`` outside llmpar between ``step()`` and the next forward."""
        if self.deferred_gather is not None:
            self.deferred_gather.wait_all()
        if self.experts is not None:
            self.experts.wait_params()

    @torch.no_grad()
    def refresh_master(self) -> None:
        """The fp32 masters take the params' current values (after the user modified params)."""
        self.wait_params()
        for b in self.buffers:
            if "master" in b.state:
                for u, src in enumerate(self._shards(b)):
                    b.layout.shard_of_partition(b.state["master"], u).copy_(src)
        if self.experts is not None:
            self.experts.refresh_master()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated grads: the next backward starts a new accumulation (the buffers are overwritten then)."""
        self.reducer.reset()
        for b in self.buffers:
            for p in b.params:
                p.grad = None
        if self.experts is not None:
            self.experts.zero_grad(set_to_none)
