"""ZeRO: flat-buffer layout, bucketed gradient reduction and the partitioned optimizer (stages 0-3), CPU offload.

    from llmpar.zero import ZeroOptimizer, OptimizerConfig
    opt = ZeroOptimizer(model.named_parameters(), OptimizerConfig(lr=3e-4), env.mesh["dp"], stage=2)
    opt = ZeroOptimizer(model.named_parameters(), None, env.mesh["dp"], stage=3, module=model)   # params sharded
"""
from llmpar.zero.config import OffloadConfig, OptimizerConfig, ZeroConfig
from llmpar.zero.gather import GatheredParameters, consolidated_state_dict, frozen_state_dict, load_frozen
from llmpar.zero.init import Init
from llmpar.zero.layout import FlatLayout, ParamSlot, Unit
from llmpar.zero.optimizer import ZeroOptimizer
from llmpar.zero.stage3 import unit_modules

__all__ = ["FlatLayout", "GatheredParameters", "Init", "OffloadConfig", "OptimizerConfig", "ParamSlot", "Unit",
           "ZeroConfig", "ZeroOptimizer", "consolidated_state_dict", "frozen_state_dict", "load_frozen", "unit_modules"]
