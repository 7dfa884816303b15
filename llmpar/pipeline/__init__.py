"""Pipeline parallelism: cut a model into stages (:func:`split`, ``stages.py``) and run them with the schedules of
``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B) through :class:`PipelineRunner`, adding what they
lack for us: tensor-parallel layers inside each stage, tied embeddings across the first and last stage, loss and
gradient-accumulation semantics equal to plain training, bubble accounting, and failures reported on every rank.

    env = llmpar.init_distributed(pp=2, tp=2)
    runner = llmpar.pipeline.build_pipeline(model, env.mesh, GPT.loss, schedule="1f1b", micro_batches=8)
    loss = runner.step(x, y)          # then clip with runner.clip_grad_norm_ and step your optimizer

DeepSpeed's ``PipelineModule(layers=[LayerSpec(...), TiedLayerSpec(...), modules, callables], num_stages=...)``
(``module.py``, ``specs.py``) cuts itself like DeepSpeed and builds only this rank's layers; ``split`` takes it as is.

ZeRO over the dp axis (``zero.py``): build the runner with ``dp_group=None`` and the optimizer with
``zero_optimizer(runner, OptimizerConfig(...), stage=1, max_grad_norm=1.0)``; then ``runner.step``; ``opt.step()``.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module; imported on first use, so that importing one module of the package (the schedules, the
# block helpers) does not load torch.distributed.pipelining
_EXPORTS = {
    "PipelineStageError": "_failure",
    "StageModule": "blocks",
    "to_blocks": "blocks",
    "balanced_boundaries": "partition",
    "PipelineRunner": "runner",
    "StepStats": "runner",
    "SCHEDULES": "schedules",
    "bubble_fraction": "schedules",
    "normalize_schedule": "schedules",
    "PipelineSplit": "stages",
    "StageInfo": "stages",
    "split": "stages",
    "zero_optimizer": "zero",
    "build_pipeline": "build",
    "PipelineModule": "module",
    "PipeStage": "pipe_stage",
    "LayerSpec": "specs",
    "TiedLayerSpec": "specs",
    "partition_layers": "specs",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmpar.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(f"llmpar.pipeline.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
