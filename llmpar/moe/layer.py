"""``deepspeed.moe.layer`` for DeepSpeed scripts: :class:`MoE`, DeepSpeed's legacy mixture-of-experts layer.

    from llmpar.moe.layer import MoE
    moe = MoE(hidden_size=512, expert=MLP(512), num_experts=8, ep_size=2, k=2)
    moe.set_deepspeed_parallelism()              # ep_size > 1: the "ep_size_2" groups of llmpar.utils.groups
    out, l_aux, exp_counts = moe(x)              # x: [..., hidden_size] -> out: same shape

The user's ``expert`` is deep-copied ``num_experts / ep_size`` times on each rank; the gate, the capacity dropping
and the returned ``l_aux`` / ``exp_counts`` are DeepSpeed 0.19's (:mod:`llmpar.moe.legacy`), the tokens move through
llmpar's dispatchers (dropless exchange of the kept slots, no padding to capacity). The state dict has DeepSpeed's
names (``deepspeed_moe.gate.wg.weight``, ``deepspeed_moe.experts.deepspeed_experts.<i>.*``, ``mlp.*`` and
``coefficient.*`` for ``use_residual``), so a DeepSpeed MoE's weights load as they are. ``ep_group=`` (llmpar's
addition) gives the expert-parallel group directly instead of :meth:`MoE.set_deepspeed_parallelism`.

Not provided: Tutel (``use_tutel=True`` runs without it, as DeepSpeed does when Tutel is not installed) and expert
tensor parallelism with a tensor-parallel mpu (a ValueError). A DeepSpeed-compatibility module: nothing inside llmpar
imports it; llmpar's own layer is :class:`llmpar.moe.MoEBlock`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.moe.legacy import LegacyMoELayer, ModuleExperts, TopKGate, check_moe_args
from llmpar.utils import groups

logger = logging.getLogger("llmpar")


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` (same arguments and defaults; see ``deepspeed.moe.layer.MoE``). ``forward(hidden_states,
    used_token=None) -> (output, l_aux, exp_counts)``: output ``[..., hidden_size]`` in the input's dtype, l_aux the
    gate's load-balancing loss (fp32 scalar, add it to the loss yourself), exp_counts ``[num_experts]`` int64, this
    rank's choices per expert before dropping."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        ep_group: Any = None,
    ) -> None:
        super().__init__()
        check_moe_args(hidden_size, num_experts, ep_size, k)
        if not isinstance(expert, nn.Module):
            raise TypeError(f"expert must be a torch.nn.Module, got {type(expert).__name__}")
        if use_tutel:
            logger.warning("MoE(use_tutel=True): Tutel is not used; the layer runs llmpar's dispatcher")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = ModuleExperts(expert, self.num_local_experts, self.expert_group_name, ep_size)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = LegacyMoELayer(gate, experts, num_experts, ep_size)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        if ep_group is not None:
            self.deepspeed_moe.set_ep_group(ep_group)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Give the layer its expert-parallel group: the ``"ep_size_<ep>"`` group of :mod:`llmpar.utils.groups`,
        created (a collective over the job) when it does not exist yet. A no-op for ep_size=1."""
        if self.ep_size == 1:
            return
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            if groups.mpu is None or not self.enable_expert_tensor_parallelism:
                groups._create_expert_and_data_parallel(
                    self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_
                )
            else:
                groups._create_expert_data_and_model_parallel(
                    self.ep_size, mpu=groups.mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_
                )
        self.deepspeed_moe.set_ep_group(
            groups._get_expert_parallel_group(self.expert_group_name),
            groups._get_expert_data_parallel_group(self.expert_group_name),
        )

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


__all__ = ["MoE"]
