"""Mixture of experts: the router, the dispatcher seam (local, all-to-all over an expert-parallel group), the experts
in transformers' packed layout, and the :class:`MoEBlock` layer that composes them
(``llmpar.moe.layer`` is left for DeepSpeed's ``deepspeed.moe.layer.MoE`` under the renaming rule).

Floor: beside ``tensor_parallel`` and ``context_parallel``; it uses ``distributed`` (and, for the expert GEMMs,
``ops``) only. See ``llmpar/moe/block.py`` for the layer and the errors it raises.
"""

from llmpar.moe.block import MoEBlock
from llmpar.moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher, make_dispatcher
from llmpar.moe.expert_tp import ExpertGroups, expert_parallel_groups, merge_intermediate, shard_intermediate
from llmpar.moe.experts import Experts, SharedExperts, grouped_mlp
from llmpar.moe.losses import load_balancing_loss, sequence_aux_loss, z_loss
from llmpar.moe.router import Router, RouterConfig, Routing, route
from llmpar.moe.slots import DispatchMeta, DispatchStats, PendingDispatch

__all__ = [
    "AllToAllDispatcher",
    "DispatchMeta",
    "DispatchStats",
    "Dispatcher",
    "ExpertGroups",
    "Experts",
    "LocalDispatcher",
    "MoEBlock",
    "PendingDispatch",
    "Router",
    "RouterConfig",
    "Routing",
    "SharedExperts",
    "expert_parallel_groups",
    "grouped_mlp",
    "load_balancing_loss",
    "make_dispatcher",
    "merge_intermediate",
    "route",
    "sequence_aux_loss",
    "shard_intermediate",
    "z_loss",
]
