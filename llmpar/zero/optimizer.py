"""ZeroOptimizer: AdamW over data-parallel ranks with ZeRO stage 0, 1, 2 or 3 on the flat layout of ``layout.py``.

    opt = ZeroOptimizer(model.named_parameters(), OptimizerConfig(lr=3e-4, weight_decay=0.1), env.mesh["dp"], stage=2,
                        tp_group=env.mesh["tp"], max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()

What each rank holds (psi = trainable params, N = dp ranks, bf16 params with fp32 master; the flat buffers holding it
are built by ``buffers.py``):
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

step() (``step.py``): the global gradient norm (``llmpar.optim.grad_norm``: partition norms summed over dp;
tensor-parallel params summed over tp, replicated ones counted once) -> clip coefficient and found-inf flag -> one fused
``adamw_step`` per flat buffer over this rank's partition (the coefficient applied inside; a non-finite norm skips the
step on every rank: norm, flag and skip count stay on the device, ``stats.py``; ``skipped_steps`` / ``last_grad_norm``
read them when asked) -> the updated shards all-gathered unit by unit straight into the param buffer (stages 1/2: one
fused step per unit, each unit's gather launched as soon as its shard is stepped; at most ``allgather_bucket_size``
elements in flight). Per step: stage 0 an all-reduce (2 psi), stages 1/2 reduce-scatter + all-gather (psi + psi).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmpar.distributed.agree import check_same_on_ranks
from llmpar.distributed.collectives import CommCounter, Group, GroupRef, broadcast_coalesced, group_rank, group_size
from llmpar.zero.buffers import build_buffers, frozen_buffers, layout_of
from llmpar.zero.checkpointing import ZeroCheckpointing
from llmpar.zero.compressed import compression
from llmpar.zero.config import OptimizerConfig, ZeroConfig, param_groups
from llmpar.zero.experts import check_expert_groups, refuse_spread_experts, split_expert_groups
from llmpar.zero.grads import GradReducer
from llmpar.zero.init import default_device, materialize_sharded, remap_params, replace_meta_params
from llmpar.zero.loss_scale import LossScaler
from llmpar.zero.offload import Copier, Placement, memory_bytes
from llmpar.zero.param_gather import DeferredGather
from llmpar.zero.stage3 import Stage3Runtime
from llmpar.zero.state_dict import OptimizerStateDict
from llmpar.zero.stats import NormStats, StepStatsView
from llmpar.zero.step import ZeroStep
from llmpar.zero.units import UnitPlan, UnitPolicy

logger = logging.getLogger("llmpar")


class ZeroOptimizer(ZeroStep, StepStatsView, ZeroCheckpointing, OptimizerStateDict):
    """AdamW with ZeRO stage 0/1/2 over ``dp_group`` (module docstring). ``param_groups[i]["lr"]`` may be changed by a
    scheduler between steps. The stage is ``zero_config.stage``, or ``stage=`` (default 2) without a zero_config
    (:meth:`ZeroConfig.resolve`). ``expert_group=`` / ``ep_group=``: the expert-data-parallel and expert-parallel
    groups; params tagged ``expert_parallel`` then go to ``self.experts``, a ZeroOptimizer over ``expert_group``
    driven by this one (``experts.py``; ``experts_only=True`` marks that one: its ``dp_group`` is the
    expert-data-parallel group); ``etp_group=``: the expert-tensor-parallel group of experts split along their
    intermediate dimension (their norm summed over it; ``consolidated_state_dict`` merges them). Without
    ``expert_group`` params holding experts spread over ep > 1 ranks are refused. ``state_dict()`` /
    ``load_state_dict()`` / ``destroy()``: ``state_dict.py``."""

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
        expert_group: Group | None = None,
        ep_group: Group | None = None,
        etp_group: Group | None = None,
        experts_only: bool = False,
    ) -> None:
        cfg = optimizer_config if optimizer_config is not None else OptimizerConfig()
        if isinstance(cfg, dict):
            cfg = OptimizerConfig(**cfg)
        if not isinstance(cfg, OptimizerConfig):
            raise TypeError(f"optimizer_config must be an OptimizerConfig or a dict, got {type(cfg).__name__}")
        zcfg = ZeroConfig.resolve(stage, zero_config, default_stage=2)  # the one source of the stage
        stage = zcfg.stage
        shard_module: nn.Module | None = None  # stage 3: the model whose forward gathers the sharded params
        if stage == 3:
            if not isinstance(module, nn.Module):
                raise TypeError(
                    "ZeRO stage 3 needs module= (the model whose forward gathers the sharded params), got "
                    f"{type(module).__name__}"
                )
            shard_module = module
        self._deferred: set[int] = set()  # stage 3 params built on the meta device (llmpar.zero.Init)
        self.init_peak_numel = 0
        self.deferred_gather: DeferredGather | None = None  # overlap_param_gather (set once the buffers exist)
        if shard_module is not None and any(p.is_meta for p in shard_module.parameters()):
            mapping = replace_meta_params(shard_module, default_device())
            self._deferred = {id(p) for p in mapping.values()}
            params = remap_params(params, mapping)
        groups = param_groups(params, cfg)  # checked before any group is touched
        if dp_group is None:
            raise TypeError(
                "dp_group is required: pass the data-parallel ProcessGroup or DeviceMesh (e.g. "
                "env.mesh['dp']); llmpar never falls back to a global group"
            )
        expert_groups: list[dict] = []
        if expert_group is not None:  # tagged expert params: a second optimizer over edp (``experts.py``)
            check_expert_groups(dp_group, expert_group, ep_group)
            groups, expert_groups, self._expert_owner = split_expert_groups(groups)
        elif not experts_only:
            refuse_spread_experts(groups)  # averaging different ranks' experts over dp would corrupt them
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
        self.plan = UnitPlan(shard_module, unit_policy) if shard_module is not None else None
        # every dp rank starts from dp rank 0's params (as DDP and DeepSpeed do): ranks built with different seeds
        # would otherwise train different models (stage 0) or step mixed shards
        broadcast_coalesced([p for g in groups for p in g["params"] if id(p) not in self._deferred], 0, self.dp_group)
        self.buffers = build_buffers(
            self.param_groups,
            cfg,
            zcfg,
            stage=stage,
            dp=self.dp,
            rank=self._rank(),
            placement=self.placement,
            plan=self.plan,
            deferred=self._deferred,
            grad_accum_dtype=grad_accum_dtype,
            align=align,
        )
        self.frozen_buffers = (
            frozen_buffers(
                shard_module,
                self.buffers,
                lambda named: layout_of(named, self.dp, align, zcfg, self.plan),
                self.placement,
                self.rank,
                self._deferred,
            )
            if shard_module is not None
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
        self.ep_group = GroupRef(ep_group) if ep_group is not None else None
        self.etp_group = GroupRef(etp_group) if etp_group is not None and expert_groups else None
        self.experts: ZeroOptimizer | None = None
        if expert_groups:
            self.experts = ZeroOptimizer(
                expert_groups,
                cfg,
                expert_group,  # type: ignore[arg-type]
                zero_config=zcfg,
                pp_group=pp_group,
                grad_accum_dtype=grad_accum_dtype,
                counter=counter,
                align=align,
                seed=seed,
                module=module,
                unit_policy=unit_policy,
                ranks_per_node=ranks_per_node,
                experts_only=True,
            )
            self.experts.reducer.scale = 1.0 / self.dp  # the mean over every dp rank's loss (``experts.py``)
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

    # ------------------------------------------------------------- checks
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

    @property
    def expert_group_owner(self) -> tuple[int, ...]:
        """For each expert param group (the experts' optimizer over edp), the index of the dense param group it was
        split from, whose hyper-parameters it follows; empty without experts."""
        return tuple(getattr(self, "_expert_owner", ()))

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
