"""ZeroOptimizer: AdamW over data-parallel ranks with ZeRO stage 0, 1, 2 or 3 on the flat layout of ``layout.py``.

    opt = ZeroOptimizer(model.named_parameters(), OptimizerConfig(lr=3e-4, weight_decay=0.1), env.mesh["dp"], stage=2,
                        tp_group=env.mesh["tp"], max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()

What each rank holds (psi = trainable params, N = dp ranks, bf16 params with fp32 master):
    stage 0: params 2 psi, grads 2 psi, master + moments 12 psi           (plain data parallel)
    stage 1: params 2 psi, grads 2 psi, master + moments 12 psi / N       (optimizer state partitioned)
    stage 2: params 2 psi, grads 2 psi / N, master + moments 12 psi / N   (gradients too)
    stage 3: params 2 psi / N, grads 2 psi / N, master + moments 12 psi / N (params too: ``stage3.py``; + the units
             gathered at a time)
offload_optimizer moves grads + master + moments to the host (fp32 there: 16 psi / N; stage 1 keeps its gradient
accumulator on the device and copies the reduced partition out), offload_param the stage-3 param shards
(``offload.py``). fp16: ``loss_scaler=`` (``loss_scale.py``) unscales inside the step and skips overflowing steps.
Stage 3 shards frozen params too (``frozen_buffers``: gathered, never stepped).
(fp32 grad accumulators when ``grad_accum_dtype=torch.float32``: grads 4 psi resp. 4 psi / N.)
Low-bit states (``OptimizerConfig.state_precision`` "int8" / "int4", types AdamW8bit / AdamW4bit): m and v as codes +
float32 block scales in the same partitions, ~2.03 resp. ~1.06 B per element instead of 8 (plus the fp32 master of
16-bit params, or under offload); blocks run along each unit, every shard whole blocks; optional stochastic rounding
of the codes from ``seed`` (default: the config's; ``lowbit_state.py``).

step(): the global gradient norm (``llmpar.optim.grad_norm``: partition norms summed over dp; tensor-parallel params
summed over tp, replicated ones counted once) -> clip coefficient and found-inf flag -> one fused ``adamw_step`` per
flat buffer over this rank's partition (the coefficient applied inside; a non-finite norm skips the step on every
rank: norm, flag and skip count stay on the device, ``stats.py``; ``skipped_steps`` / ``last_grad_norm`` read them
when asked) -> the updated shards all-gathered unit by unit straight into the param buffer (stages 1/2: one fused
step per unit, each unit's gather launched as soon as its shard is stepped; at most ``allgather_bucket_size``
elements in flight). Per step: stage 0 an all-reduce (2 psi), stages 1/2 reduce-scatter + all-gather (psi + psi).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmpar.distributed.agree import check_same_on_ranks
from llmpar.distributed.collectives import CommCounter, Group, GroupRef, broadcast_coalesced, group_rank, group_size
from llmpar.ops.adamw import MODES, adamw_step
from llmpar.ops.bucket import pack_bucket
from llmpar.optim.adamw import state_dtypes
from llmpar.optim.grad_norm import global_grad_norm
from llmpar.zero import lowbit_state
from llmpar.zero.checkpointing import ZeroCheckpointing
from llmpar.zero.compressed import compression
from llmpar.zero.config import OptimizerConfig, ZeroConfig, param_groups
from llmpar.zero.grads import FlatBuffer, GradReducer
from llmpar.zero.init import default_device, materialize_sharded, remap_params, replace_meta_params
from llmpar.zero.layout import FlatLayout
from llmpar.zero.loss_scale import LossScaler, unscale_and_clip
from llmpar.zero.offload import Copier, Placement, host_step_buffer, master_dtype, memory_bytes
from llmpar.zero.param_gather import DeferredGather, step_gather
from llmpar.zero.stage3 import Stage3Runtime, frozen_buffers, shard_params
from llmpar.zero.state_dict import OptimizerStateDict
from llmpar.zero.stats import NormStats, StepApplied, StepStatsView
from llmpar.zero.units import UnitPlan, UnitPolicy, split_persistent

logger = logging.getLogger("llmpar")


class ZeroOptimizer(StepStatsView, ZeroCheckpointing, OptimizerStateDict):
    """AdamW with ZeRO stage 0/1/2 over ``dp_group`` (module docstring). ``param_groups[i]["lr"]`` may be changed by a
    scheduler between steps. The stage is ``zero_config.stage``, or ``stage=`` (default 2) without a zero_config
    (:meth:`ZeroConfig.resolve`). ``state_dict()`` / ``load_state_dict()`` / ``destroy()``: ``state_dict.py``."""

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_config: OptimizerConfig | dict | None,
        dp_group: Group,
        *,
        stage: int | None = None,
        zero_config: ZeroConfig | None = None,
        tp_group: Group | None = None,
        max_grad_norm: float | None = None,
        grad_accum_dtype: torch.dtype | None = None,
        counter: CommCounter | None = None,
        align: int = 16,
        seed: int | None = None,
        module: nn.Module | None = None,
        unit_policy: UnitPolicy | None = None,
        pp_group: Group | None = None,
        norm_skip: Iterable[torch.Tensor] = (),
        loss_scaler: LossScaler | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        cfg = optimizer_config if optimizer_config is not None else OptimizerConfig()
        if isinstance(cfg, dict):
            cfg = OptimizerConfig(**cfg)
        if not isinstance(cfg, OptimizerConfig):
            raise TypeError(f"optimizer_config must be an OptimizerConfig or a dict, got {type(cfg).__name__}")
        zcfg = ZeroConfig.resolve(stage, zero_config, default_stage=2)  # the one source of the stage
        stage = zcfg.stage
        if stage == 3 and not isinstance(module, nn.Module):
            raise TypeError(
                "ZeRO stage 3 needs module= (the model whose forward gathers the sharded params), got "
                f"{type(module).__name__}"
            )
        self._deferred: set[int] = set()  # stage 3 params built on the meta device (llmpar.zero.Init)
        self.init_peak_numel = 0
        self.deferred_gather: DeferredGather | None = None  # overlap_param_gather (set once the buffers exist)
        if stage == 3 and any(p.is_meta for p in module.parameters()):
            mapping = replace_meta_params(module, default_device())
            self._deferred = {id(p) for p in mapping.values()}
            params = remap_params(params, mapping)
        groups = param_groups(params, cfg)  # checked before any group is touched
        if dp_group is None:
            raise TypeError(
                "dp_group is required: pass the data-parallel ProcessGroup or DeviceMesh (e.g. "
                "env.mesh['dp']); llmpar never falls back to a global group"
            )
        if max_grad_norm is not None and not (0 < max_grad_norm < float("inf")):
            raise ValueError(f"max_grad_norm={max_grad_norm} must be a positive finite number or None")
        self.config, self.zero_config, self.stage = cfg, zcfg, stage
        self.dp_group, self.tp_group = GroupRef(dp_group), (GroupRef(tp_group) if tp_group is not None else None)
        if pp_group is not None and stage == 3:
            raise ValueError("pp_group with stage=3: ZeRO-3 does not run inside pipeline stages; use stage 0, 1 or 2")
        # pipeline parallel: the global norm adds every stage's sum over pp; norm_skip (tied copies held by another
        # stage too) is left out of this rank's sum so that each shared weight counts once
        self.pp_group = GroupRef(pp_group) if pp_group is not None else None
        self._norm_skip = {id(p) for p in norm_skip}
        self.dp, self.rank = group_size(self.dp_group), group_rank(self.dp_group)
        self.max_grad_norm, self.counter, self.seed = max_grad_norm, counter, cfg.seed if seed is None else seed
        self.param_groups = groups
        self.stats = NormStats()  # grad norm + skipped steps, on the device until read
        # fp16: grads arrive multiplied by the loss scale; the step divides by it (``loss_scale.py``)
        self.loss_scaler = loss_scaler
        self.frozen = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
        device = next(p.device for g in self.param_groups for p in g["params"])
        self.placement = Placement(device, offload_optimizer=zcfg.offload_optimizer, offload_param=zcfg.offload_param)
        self.copier = Copier(device)
        if loss_scaler is not None:
            loss_scaler.to(device)
        self.plan = UnitPlan(module, unit_policy) if stage == 3 else None
        # every dp rank starts from dp rank 0's params (as DDP and DeepSpeed do): ranks built with different seeds
        # would otherwise train different models (stage 0) or step mixed shards
        broadcast_coalesced([p for g in groups for p in g["params"] if id(p) not in self._deferred], 0, self.dp_group)
        self.buffers = self._build_buffers(cfg, grad_accum_dtype, align)
        self.frozen_buffers = (
            frozen_buffers(
                module,
                self.buffers,
                lambda named: self._layout(named, self.dp, align),
                self.placement,
                self.rank,
                self._deferred,
            )
            if stage == 3
            else []
        )
        self._check_same_model()
        if self._deferred:
            materialize_sharded(self)
        quantizer, weights = compression(zcfg, self.dp_group, self.dp, counter, ranks_per_node)
        self.reducer = GradReducer(
            self.buffers,
            stage=min(stage, 2),
            dp_group=self.dp_group,
            dp=self.dp,
            rank=self.rank,
            overlap=zcfg.overlap_comm,
            reduce_dtype_of=lambda b: b.layout.dtype,
            counter=counter,
            copier=self.copier if self.placement.offload_optimizer else None,
            inflight_budget=4 * zcfg.reduce_bucket_size,
            quantizer=quantizer,
            keep_scratch=stage < 3,
        )
        if zcfg.overlap_param_gather and stage in (1, 2) and self.dp > 1:
            if module is None:
                raise ValueError(
                    "zero_config.overlap_param_gather needs module= (the model whose forward waits for "
                    "the param all-gather)"
                )
            self.deferred_gather = DeferredGather(self, module)
        self.stage3: Stage3Runtime | None = None
        if stage == 3:
            assert self.plan is not None
            self.stage3 = Stage3Runtime(
                self.plan,
                self.buffers + self.frozen_buffers,
                dp_group=self.dp_group,
                device=device,
                prefetch_numel=zcfg.stage3_prefetch_bucket_size,
                max_live_numel=zcfg.stage3_max_live_parameters,
                reuse_numel=zcfg.stage3_max_reuse_distance,
                persist_numel=zcfg.stage3_param_persistence_threshold,
                counter=counter,
                copier=self.copier,
                host_shards=self.placement.offload_param,
                weights=weights,
            )
            self.reducer.on_unit_reduced = self.stage3.unit_reduced
            self.reducer.on_backward_end = self.stage3.end_backward

    # ---------------------------------------------------------------- layout
    def _layout(self, named: list[tuple[str, torch.Tensor]], shards: int, align: int) -> FlatLayout:
        params = [p for _, p in named]
        groups = None
        if self.plan is not None:  # stage 3: one unit per module, small params in one persistent unit
            groups = split_persistent(
                self.plan.groups(params), params, self.zero_config.stage3_param_persistence_threshold
            )
        return FlatLayout(
            params,
            [n for n, _ in named],
            shards=shards,
            unit_numel=self.zero_config.reduce_bucket_size,
            align=align,
            groups=groups,
        )

    def _build_buffers(self, cfg: OptimizerConfig, grad_accum_dtype: torch.dtype | None, align: int) -> list:
        shards = 1 if self.stage == 0 else self.dp
        keyed: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}
        for gi, g in enumerate(self.param_groups):
            for name, p in zip(g["names"], g["params"]):
                if not p.requires_grad:
                    continue
                if not p.is_floating_point():
                    raise TypeError(f"param {name!r} has dtype {p.dtype}; ZeRO trains floating-point params")
                tp_split = bool(getattr(p, "tensor_model_parallel", False))
                keyed.setdefault((gi, p.dtype, p.device, tp_split), []).append((name, p))
        if not keyed:
            raise ValueError("no parameter requires grad: nothing for ZeroOptimizer to train")
        buffers = []
        pool, rank = self.placement, self._rank()
        for key, named in keyed.items():
            gi, dtype, device, tp_split = key
            mode = lowbit_state.buffer_mode(cfg.precision, cfg.state_precision, dtype, f"param {named[0][0]!r}")
            bits = lowbit_state.bits_of(mode)
            params = [p for _, p in named]
            layout = self._layout(named, shards, lowbit_state.block_align(align, mode))
            shard = None
            if self.stage == 3:  # only this rank's shard is kept; Stage3Runtime re-points the params
                flat = torch.empty(0, dtype=dtype, device=device)
                shard = shard_params(layout, params, pool, rank, self._deferred)  # meta-built: materialize_sharded
                mine_of = lambda u: layout.shard_of_partition(shard, u)  # noqa: E731
            else:
                flat = torch.zeros(layout.total, dtype=dtype, device=device)
                with torch.no_grad():
                    for u, unit in enumerate(layout.units):
                        pack_bucket([params[i].detach() for i in unit.params], out=layout.unit_view(flat, u))
                    for i, p in enumerate(params):
                        p.data = layout.param_view(flat, i)
                mine_of = lambda u: layout.shard_of_full(flat, u, rank)  # noqa: E731
            acc_dtype = grad_accum_dtype or dtype
            sdtypes = state_dtypes(mode, dtype)
            host_grad = None
            if pool.offload_optimizer:  # the host steps in fp32 (float64 for float64 params) on a master copy
                host = master_dtype(dtype)
                sdtypes = {"exp_avg": host, "exp_avg_sq": host, "master": host}
                if bits is not None:
                    sdtypes = {**state_dtypes(mode, torch.float32), "master": host}
                if self.stage == 1:  # the accumulator stays on the device; the reduced partition goes to the host
                    host_grad = pool.zeros("grads", layout.partition, host)
                else:
                    acc_dtype = host
            if self.stage < 2:
                grad = torch.zeros(layout.total, dtype=acc_dtype, device=device)
            else:
                grad = pool.zeros("grads", layout.partition, acc_dtype)
            state = {}
            for name, sdtype in sdtypes.items():
                numel = layout.partition if bits is None else lowbit_state.state_numel(name, layout.partition, bits)
                state[name] = pool.zeros("master" if name == "master" else "optimizer_state", numel, sdtype)
                if name == "master":
                    for u in range(len(layout.units)):
                        layout.shard_of_partition(state[name], u).copy_(mine_of(u))
            if bits is not None:
                lowbit_state.zero_fill_(state, bits)
            step_device = pool.host if pool.offload_optimizer else device
            steps = [torch.zeros((), dtype=torch.float32, device=step_device) for _ in layout.units]
            buffers.append(
                FlatBuffer(
                    key=key,
                    group_index=gi,
                    tp_split=tp_split,
                    layout=layout,
                    params=params,
                    mode=mode,
                    flat=flat,
                    grad=grad,
                    state=state,
                    steps=steps,
                    shard=shard,
                    host_grad=host_grad,
                )
            )
        return buffers

    def _check_same_model(self) -> None:
        """Every dp rank must hold the same trainable params (shapes, dtypes, groups): a mismatch is an error on every
        rank after one small all-gather, instead of a hang inside a reduce-scatter later."""
        desc = repr(
            [
                (b.key[0], str(b.key[1]), b.tp_split, [tuple(p.shape) for p in b.params], self.stage)
                for b in self.buffers + self.frozen_buffers
            ]
        )
        check_same_on_ranks(
            desc,
            self.dp_group,
            what="the data-parallel ranks hold different models or ZeRO stages",
            hint="same params, dtypes and stage on every dp rank",
        )

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
        r = self.reducer
        r.wait_all()
        self.wait_params()
        if r.micro_steps == 0:
            logger.warning("ZeroOptimizer.step() without a backward since the last step: nothing to do")
            return StepApplied(None)
        r.reduce_now()
        self.copier.sync()  # the host step reads the copied-out grads
        # the norm of the grads / loss scale; the clip coefficient with 1/scale folded in; found-inf skips the step
        norm, gscale, gscale64, found_inf = unscale_and_clip(self._global_norm(), self.max_grad_norm, self.loss_scaler)
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
        self.stats.record(norm, found_inf)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        if self.stage3 is not None:  # a skipped step left the shards as they were: re-gathering is harmless
            self.stage3.regather_persistent()
        r.reset()
        return StepApplied(found_inf)

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
        state = [
            self._shards(b),
            grads,
            self._units(b, "exp_avg"),
            self._units(b, "exp_avg_sq"),
            b.steps,
            None if extra is None else self._units(b, extra[0]),
        ]
        for sel in [[u] for u in units] if each else [units]:
            p, g, m, v, st, ex = (None if xs is None else [xs[u] for u in sel] for xs in state)
            adamw_step(p, g, m, v, st, precision=b.mode, extras=ex, seed=self.seed, salts=sel, **kw)
            yield from sel

    def wait_params(self) -> None:
        """Wait for a deferred all-gather of updated params (``overlap_param_gather``; ``param_gather.py``): call it
        before reading ``param.data`` outside llmpar between ``step()`` and the next forward."""
        if self.deferred_gather is not None:
            self.deferred_gather.wait_all()

    @torch.no_grad()
    def refresh_master(self) -> None:
        """The fp32 masters take the params' current values (after the user modified params)."""
        self.wait_params()
        for b in self.buffers:
            if "master" in b.state:
                for u, src in enumerate(self._shards(b)):
                    b.layout.shard_of_partition(b.state["master"], u).copy_(src)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated grads: the next backward starts a new accumulation (the buffers are overwritten then)."""
        self.reducer.reset()
        for b in self.buffers:
            for p in b.params:
                p.grad = None

    # ---------------------------------------------------------------- reports
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds persistently, by kind and by pool, measured from the tensors themselves
        (``offload.memory_bytes``)."""
        return memory_bytes(self)

    def num_params(self) -> int:
        """Trainable elements this optimizer updates (psi, without padding)."""
        return sum(b.layout.numel for b in self.buffers)

    def describe(self) -> dict:
        """Global layout of every flat buffer (for checkpoints)."""
        return {
            "stage": self.stage,
            "dp": self.dp,
            "buffers": [
                {"group": b.group_index, "tp_split": b.tp_split, "mode": b.mode, **b.layout.describe()}
                for b in self.buffers
            ],
        }
