"""Mixture-of-experts layers in the plain engine: their expert-parallel groups, aux losses, bias updates and logs.

At ``initialize`` (:func:`setup_experts`), with the block enabled (DeepSpeed's AutoEP), transformers' sparse MoE
blocks (Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V3, gpt-oss) are first swapped for MoEBlocks holding the same
weights (:func:`llmpar.moe.hf.swap_moe_blocks`); this covers llmpar's Trainer and accelerate, which initialize
through it. Then the model's :class:`llmpar.moe.MoEBlock` layers are found and the
expert-parallel degree is taken from the ``"expert_parallel"`` block (``autoep_size`` when enabled; else the degree
the layers were built with). ``ParallelDims(ep=...)`` over the engine's mesh gives the ``ep`` group (the ranks whose
experts make one layer) and the ``edp`` group (the ranks holding the same experts); a layer built with
``ep_group=None`` is spread over ``ep`` (``MoEBlock.set_ep_group``), a layer built over another degree is refused, and
ZeRO reduces and shards expert params over ``edp`` (``llmpar.zero.experts``).

Layers whose experts are split over an expert-tensor-parallel group (``MoEBlock(etp_group=...)``, groups from
``llmpar.moe.expert_parallel_groups``) are trained with their etp ranks as the engine's tensor-parallel ranks
(``mesh["tp"]`` of size etp: the ranks holding the same tokens; :func:`_expert_tp` refuses other groups and models
mixing etp sizes): the expert ZeroOptimizer reduces each shard over the edp ranks of its tp coordinate (the ranks
holding the same shard; at ep = 1 the dp ranks), the gradient norm sums the expert shards over etp once each, and
``module_state_dict`` merges the shards into the whole experts under their global names; llmpar's own
``save_checkpoint`` refuses them (``ZeroOptimizer.checkpoint_experts``).

DeepSpeed's legacy layer (``llmpar.moe.layer.MoE`` at ``ep_size`` > 1, found by its ``deepspeed_moe``
:class:`~llmpar.moe.legacy.LegacyMoELayer`) keeps its own groups: a layer without one gets DeepSpeed's
(``set_deepspeed_parallelism()``, as DeepSpeed's engine calls it), and ZeRO shards its experts (tagged as DeepSpeed tags
them, ``allreduce = False``) over the expert-data-parallel group that came with it (``ParallelDims``' when the layer
was built with ``ep_group=ParallelDims(ep=...).group("ep")``). The optimizer's groups may come from
``split_params_into_different_moe_groups_for_optimizer`` (their ``"moe"`` / ``"name"`` labels are dropped: the tags
decide). One ep degree per model; the script adds ``l_aux`` to its loss itself, as with DeepSpeed.

In training (:class:`MoEState`):

- ``engine(...)`` records the weighted aux losses of the layers' forward (each ``MoEBlock.aux_loss``: the router's
  ``aux_loss_coeff * aux + seq_aux_loss_coeff * seq_aux + z_loss_coeff * z``) and adds their tokens per expert to the
  counts of the current logging window;
- ``engine.backward(loss)`` backpropagates ``loss + sum of those aux losses`` (``"add_aux_loss": true``, the default;
  Megatron's way), then divides by the accumulation steps as usual;
- after each optimizer step, layers with ``RouterConfig(expert_bias=True)`` move their bias from the load summed over
  the data-parallel (x cp) ranks (DeepSeek-V3's aux-loss-free balancing);
- every ``steps_per_print`` line gains ``moe=[layer: max/mean ...]``: per layer, the busiest expert's tokens over the
  mean, from global rank 0's tokens since the last line (no collective: 1.00 is perfectly even).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.collectives import Group, group_size
from llmpar.distributed.dims import ParallelDims
from llmpar.moe.block import MoEBlock
from llmpar.moe.hf import swap_moe_blocks
from llmpar.moe.legacy import LegacyMoELayer
from llmpar.runtime.expert_block import ExpertParallelConfig
from llmpar.zero.experts import ETP_LAYOUT

logger = logging.getLogger("llmpar")


@dataclasses.dataclass(kw_only=True)
class MoEState:
    """The engine's view of the model's MoE layers (module docstring)."""

    layers: list[tuple[str, MoEBlock]]
    ep: int = 1
    ep_group: Any = None
    edp_group: Any = None
    etp: int = 1  # the expert-tensor-parallel degree of the layers (1: experts whole)
    etp_group: Any = None  # the layers' etp group: this rank's tensor-parallel ranks
    add_aux_loss: bool = True
    aux_loss: torch.Tensor | None = None  # the last training forward's weighted aux losses, summed over layers
    tokens: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per layer: [E] since the last log line

    def after_forward(self) -> None:
        """Record the layers' aux losses and tokens per expert of the forward that just ran (training only)."""
        losses = [b.aux_loss for _, b in self.layers if isinstance(b.aux_loss, torch.Tensor)]
        self.aux_loss = torch.stack([x.float().reshape(()) for x in losses]).sum() if losses else None
        if not self.tokens:  # on the counts' device: no host sync per forward
            self.tokens = [
                torch.zeros(b.num_experts, dtype=torch.int64, device=b.router.weight.device) for _, b in self.layers
            ]
        for acc, (_, b) in zip(self.tokens, self.layers):
            if b.tokens_per_expert is not None:
                acc += b.tokens_per_expert.detach().to(acc.device, torch.int64)

    def loss_with_aux(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus the recorded aux losses (once: they are cleared), when ``add_aux_loss``."""
        aux, self.aux_loss = self.aux_loss, None
        if not self.add_aux_loss or aux is None or not aux.requires_grad:
            return loss
        return loss + aux.to(loss.dtype)

    @torch.no_grad()
    def update_biases(self, dp_group: Any) -> None:
        """The aux-loss-free bias step of every layer with an expert bias, the load summed over ``dp_group``."""
        for _, b in self.layers:  # a rate of 0 (transformers' DeepSeek-V3 bias as loaded) moves nothing
            if getattr(b.router, "expert_bias", None) is not None and b.router.config.bias_update_rate:
                b.update_expert_bias(dp_group)

    def log_suffix(self) -> str:
        """``, moe max/mean=[name: x.xx, ...]`` of this rank's tokens per expert since the last
        :meth:`reset_tokens`; "" when none."""
        parts = []
        for acc, (name, _) in zip(self.tokens, self.layers):
            mean = acc.double().mean().item()
            if mean > 0:
                parts.append(f"{name}: {acc.max().item() / mean:.2f}")
        return f", moe max/mean=[{', '.join(parts)}]" if parts else ""

    def reset_tokens(self) -> None:
        """Start a new logging window (after each ``steps_per_print`` line, on every rank)."""
        for acc in self.tokens:
            acc.zero_()


def moe_layers(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    """The model's MoE layers, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEBlock)]


def _dims(mesh: Any, zero_group: Group, ep: int) -> ParallelDims:
    """The degrees of the engine's ranks with ``ep``: from the mesh when there is one, else ZeRO's group must be the
    whole job."""
    if mesh is not None and getattr(mesh, "mesh_dim_names", None):
        return dataclasses.replace(ParallelDims.from_mesh(mesh), ep=ep)
    world = dist.get_world_size()
    if group_size(zero_group) != world:
        raise ValueError(
            f"expert parallelism (ep={ep}) with a dp_group of {group_size(zero_group)} of the {world} ranks and no "
            "mesh: pass mesh= (llmpar.init_distributed(...).mesh) so the ep / edp groups can be derived from it"
        )
    return ParallelDims(dp=world, ep=ep, world_size=world)


def _legacy_groups(model: nn.Module, mesh: Any, zero_group: Group) -> tuple[int, Any, Any] | None:
    """``(ep, ep_group, edp_group)`` of the model's DeepSpeed-style layers (``llmpar.moe.layer.MoE``) spread over
    ep > 1 ranks; None when there are none. A layer without a group yet gets DeepSpeed's (its owner's
    ``set_deepspeed_parallelism()``, as DeepSpeed's engine calls it). The ``edp`` group is the one the layer was given
    with its ep group (DeepSpeed's registry), else the ``ParallelDims`` one when the ep ranks are ``ParallelDims``'.
    Layers over different ep sizes or different ranks are refused (one expert-data-parallel group per engine)."""
    found = []
    for name, owner in model.named_modules():
        layer = getattr(owner, "deepspeed_moe", None)
        if not isinstance(layer, LegacyMoELayer) or layer.ep_size == 1:
            continue
        if layer.dispatcher is None:
            if not callable(getattr(owner, "set_deepspeed_parallelism", None)):
                raise ValueError(f"MoE layer {name} has ep_size={layer.ep_size} but no expert-parallel group")
            owner.set_deepspeed_parallelism()
        found.append((name or type(owner).__name__, layer))
    if not found:
        return None
    sizes = sorted({layer.ep_size for _, layer in found})
    if len(sizes) > 1:
        raise ValueError(
            f"MoE layers with ep_size {sizes} in one model: llmpar reduces every expert over one "
            "expert-data-parallel group; build every MoE layer with the same ep_size"
        )
    ep = sizes[0]
    ranks = {n: sorted(dist.get_process_group_ranks(layer.ep_group)) for n, layer in found}
    first = next(iter(ranks.values()))
    for n, r in ranks.items():
        if r != first:
            raise ValueError(
                f"MoE layer {n} exchanges tokens over ranks {r}, {found[0][0]} over {first}: use one group"
            )
    name, layer = found[0]
    ep_group, edp_group = layer.ep_group, layer.edp_group
    if edp_group is None:
        dims = _dims(mesh, zero_group, ep)
        if dims.derived_ranks("ep", dist.get_rank()) != first:
            raise ValueError(
                f"MoE layer {name} exchanges tokens over ranks {first}, not ParallelDims(ep={ep}).group('ep') "
                f"{dims.derived_ranks('ep', dist.get_rank())}, and no expert-data-parallel group came with it: "
                "use moe.set_deepspeed_parallelism() or ep_group=ParallelDims(ep=...).group('ep')"
            )
        ep_group, edp_group = dims.group("ep"), dims.group("edp")
    return ep, ep_group, edp_group


def _expert_tp(layers: list[tuple[str, MoEBlock]], mesh: Any) -> tuple[int, Any]:
    """``(etp, etp group)`` of the layers' experts ((1, None) when whole). Layers split over an etp group
    (``MoEBlock(etp_group=...)``) must all be, over the engine's tensor-parallel ranks (the ranks holding the same
    tokens: ``mesh["tp"]`` of size etp), else a ValueError naming the layer. Tags each shard with its packed layout
    (``llmpar.zero.experts.ETP_LAYOUT``) for ``consolidated_state_dict``'s merge."""
    sizes = {name: getattr(b, "etp_size", 1) for name, b in layers}
    etp = max(sizes.values(), default=1)
    if etp == 1:
        return 1, None
    whole = [n or type(b).__name__ for n, b in layers if sizes[n] != etp]
    split = next(n or type(b).__name__ for n, b in layers if sizes[n] == etp)
    if whole:
        raise ValueError(
            f"MoE layer {split} splits its experts over an expert-tensor-parallel group of {etp} ranks but "
            f"{whole[0]} over {sizes[whole[0]]}: build every MoE layer with the same etp_group"
        )
    names = getattr(mesh, "mesh_dim_names", None) or ()
    tp_ranks = sorted(dist.get_process_group_ranks(mesh["tp"].get_group())) if "tp" in names else [dist.get_rank()]
    hint = (
        f"llmpar.initialize runs the etp ranks as its tensor-parallel ranks (they pass the same tokens): pass "
        f"mesh=llmpar.init_distributed(tp={etp}).mesh and build the layers over "
        f"llmpar.moe.expert_parallel_groups(ep, etp={etp}).etp_group"
    )
    if len(tp_ranks) != etp:
        raise ValueError(
            f"MoE layer {split} splits its experts over an expert-tensor-parallel group of {etp} ranks but the "
            f"engine's tensor-parallel group has {len(tp_ranks)}: {hint}"
        )
    group = None
    for name, b in layers:
        group = b.experts.etp_group.get()  # type: ignore[union-attr]
        have = sorted(dist.get_process_group_ranks(group))
        if have != tp_ranks:
            raise ValueError(
                f"MoE layer {name or type(b).__name__} splits its experts over ranks {have}, but this rank's "
                f"tensor-parallel ranks are {tp_ranks}: {hint}"
            )
        setattr(b.experts.gate_up_proj, ETP_LAYOUT, "gate_up")
        setattr(b.experts.down_proj, ETP_LAYOUT, "down")
    return etp, group


def setup_experts(model: nn.Module, cfg: ExpertParallelConfig, mesh: Any, zero_group: Group) -> MoEState | None:
    """Find the MoE layers, build the ep / edp groups and spread the layers (module docstring); None without MoE
    layers. Refused on every rank alike (the checks only read the config and the layers)."""
    if cfg.enabled and (swapped := swap_moe_blocks(model)):
        logger.info("expert_parallel: %d transformers MoE blocks run as llmpar MoE blocks", swapped)
    layers = moe_layers(model)
    etp, etp_group = _expert_tp(layers, mesh)
    legacy = _legacy_groups(model, mesh, zero_group)
    if legacy is not None:
        if etp > 1:
            raise ValueError(
                "llmpar.moe.MoEBlock layers split over an expert-tensor-parallel group beside llmpar.moe.layer.MoE "
                "layers: not supported in one engine; build the model with one kind"
            )
        ep, ep_group, edp_group = legacy
        if cfg.enabled and cfg.ep != ep:
            raise ValueError(
                f'"expert_parallel.autoep_size"={cfg.autoep_size} but the model\'s MoE layers were built with '
                f"ep_size={ep}: give the same degree"
            )
        if any(b.ep_size > 1 or cfg.ep > 1 for _, b in layers):
            raise ValueError(
                "llmpar.moe.MoEBlock layers spread over ep ranks beside llmpar.moe.layer.MoE layers over their own "
                "groups: not supported in one engine; build the model with one kind"
            )
        return MoEState(layers=layers, ep=ep, ep_group=ep_group, edp_group=edp_group, add_aux_loss=cfg.add_aux_loss)
    if not layers:
        if cfg.ep > 1:
            raise ValueError(
                f'"expert_parallel.autoep_size"={cfg.autoep_size} but the model has no llmpar.moe.MoEBlock layer '
                "to spread over the expert-parallel ranks"
            )
        return None
    built = sorted({b.ep_size for _, b in layers})
    ep = cfg.ep if cfg.enabled else max(built)
    for name, b in layers:
        if b.ep_size not in (1, ep):
            raise ValueError(
                f"MoE layer {name} was built over an expert-parallel group of {b.ep_size} ranks but the engine runs "
                f'ep={ep} ("expert_parallel.autoep_size"): build it with ep_group=None (spread at initialize) or '
                f"over ParallelDims(ep={ep}).group('ep')"
            )
        if b.num_experts % ep:
            raise ValueError(
                f"MoE layer {name}: num_experts={b.num_experts} is not divisible by ep={ep} "
                '("expert_parallel.autoep_size")'
            )
    state = MoEState(layers=layers, ep=ep, etp=etp, etp_group=etp_group, add_aux_loss=cfg.add_aux_loss)
    if ep == 1:
        if etp > 1:  # the expert shards: their own optimizer over the dp ranks (each holds this etp rank's shard)
            state.edp_group = zero_group
        return state
    if group_size(zero_group) % ep:
        what = f'"expert_parallel.autoep_size"={ep}' if cfg.enabled else f"the MoE layers' ep={ep}"
        raise ValueError(
            f"{what} does not divide the {group_size(zero_group)} data-parallel (x cp) ranks: the expert-parallel "
            "groups fold over them; choose a divisor"
        )
    dims = _dims(mesh, zero_group, ep)
    state.ep_group, state.edp_group = dims.group("ep"), dims.group("edp")
    want = dims.derived_ranks("ep", dist.get_rank())
    for name, b in layers:
        if b.ep_size == 1:
            b.set_ep_group(state.ep_group)
        else:
            have = dist.get_process_group_ranks(b.dispatcher.group.get())  # type: ignore[attr-defined]
            if sorted(have) != want:
                raise ValueError(
                    f"MoE layer {name} exchanges tokens over ranks {sorted(have)} but this rank's expert-parallel "
                    f"group is {want} (ParallelDims(ep={ep}).group('ep'): the inner data-parallel ranks)"
                )
    return state


__all__ = ["MoEState", "moe_layers", "setup_experts"]
