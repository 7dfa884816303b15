"""The runtime layer: the one front door of llmpar.

``config.py`` reads the DeepSpeed JSON once, ``blocks.py`` turns each block into its component's typed config,
``schedules.py`` holds DeepSpeed's LR schedules, ``initialize.py`` builds the mesh and picks the engine,
``engine_base.py`` / ``engine.py`` / ``pipeline_engine.py`` are the engines. Everything below (zero/, pipeline/,
checkpoint/, tensor_parallel/, ops/) knows nothing of configs or engines; the command line sits on top.
"""

import importlib
from typing import Any

from llmpar.runtime import lr_schedules  # noqa: F401  (deepspeed.runtime.lr_schedules as an attribute too)
from llmpar.runtime.config import Blocks, Config, read_config
from llmpar.runtime.engine import Engine
from llmpar.runtime.engine_base import EngineBase
from llmpar.runtime.initialize import initialize
from llmpar.runtime.pipeline_engine import PipelineEngine
from llmpar.runtime.schedules import SchedulerConfig, WarmupSchedule


def __getattr__(name: str) -> Any:
    """``deepspeed.runtime.utils`` as an attribute: that DeepSpeed-compatibility module (top floor) loaded on first
    use, never by the runtime itself."""
    if name == "utils":
        return importlib.import_module("llmpar.runtime.utils")
    raise AttributeError(f"module 'llmpar.runtime' has no attribute {name!r}")


__all__ = [
    "Blocks",
    "Config",
    "Engine",
    "EngineBase",
    "PipelineEngine",
    "SchedulerConfig",
    "WarmupSchedule",
    "initialize",
    "read_config",
]
