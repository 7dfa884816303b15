"""Mixture of experts: the router (top-k over softmax / sigmoid scores, group-limited routing, auxiliary losses,
aux-loss-free expert bias).

Floor: beside ``tensor_parallel`` and ``context_parallel``; it uses ``distributed`` (and, for the expert GEMMs,
``ops``) only.
"""

from llmpar.moe.losses import load_balancing_loss, sequence_aux_loss, z_loss
from llmpar.moe.router import Router, RouterConfig, Routing, route

__all__ = ["Router", "RouterConfig", "Routing", "load_balancing_loss", "route", "sequence_aux_loss", "z_loss"]
