"""Mixture of experts: the router, the dispatcher seam (local, all-to-all over an expert-parallel group), the experts
in transformers' packed layout, and the :class:`MoE` layer that composes them.

Floor: beside ``tensor_parallel`` and ``context_parallel``; it uses ``distributed`` (and, for the expert GEMMs,
``ops``) only. See ``llmpar/moe/layer.py`` for the layer and the errors it raises.
"""

from llmpar.moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher, make_dispatcher
from llmpar.moe.experts import Experts, SharedExperts, grouped_mlp
from llmpar.moe.layer import MoE
from llmpar.moe.losses import load_balancing_loss, sequence_aux_loss, z_loss
from llmpar.moe.router import Router, RouterConfig, Routing, route
from llmpar.moe.slots import DispatchMeta, DispatchStats, PendingDispatch

__all__ = [
    "AllToAllDispatcher",
    "DispatchMeta",
    "DispatchStats",
    "Dispatcher",
    "Experts",
    "LocalDispatcher",
    "MoE",
    "PendingDispatch",
    "Router",
    "RouterConfig",
    "Routing",
    "SharedExperts",
    "grouped_mlp",
    "load_balancing_loss",
    "make_dispatcher",
    "route",
    "sequence_aux_loss",
    "z_loss",
]
