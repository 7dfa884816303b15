"""ZeRO: flat-buffer layout, bucketed gradient reduction and the partitioned optimizer (stages 0, 1, 2).

    from llmpar.zero import ZeroOptimizer, OptimizerConfig
    opt = ZeroOptimizer(model.named_parameters(), OptimizerConfig(lr=3e-4), env.mesh["dp"], stage=2)
"""
from llmpar.zero.config import OptimizerConfig, ZeroConfig
from llmpar.zero.layout import FlatLayout, ParamSlot, Unit
from llmpar.zero.optimizer import ZeroOptimizer

__all__ = ["FlatLayout", "OptimizerConfig", "ParamSlot", "Unit", "ZeroConfig", "ZeroOptimizer"]
