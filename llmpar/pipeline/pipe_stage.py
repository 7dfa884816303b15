"""The stage module of a :class:`~llmpar.pipeline.module.PipelineModule`, and the blocks that wrap its callable
layers.

:class:`PipeStage` clones its inputs before its first layer, as DeepSpeed's engine does: an in-place first layer
(``ReLU(inplace=True)``) then writes into the copy, never into the buffer ``torch.distributed.pipelining`` received the
activation in (a leaf that requires grad: autograd refuses in-place writes to it) or into the batch. Several tensors
from the previous stage reach the first layer as one tuple (DeepSpeed's convention). With a checkpoint interval k,
runs of k layers recompute their activations in the backward pass, as DeepSpeed's ``activation_checkpoint_interval``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from llmpar.pipeline.blocks import StageModule


class CallLayer(nn.Module):
    """A callable layer (no parameters) as a block."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


class TiedCall(nn.Module):
    """A tied module used through its spec's ``forward_fn(module, x)``."""

    def __init__(self, module: nn.Module, fn: Callable) -> None:
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(self.module, x)


class PipeStage(StageModule):
    """One stage of a :class:`PipelineModule`: clones its inputs, then runs its layers in order (module docstring).
    With ``checkpoint_interval`` k > 0, runs of k layers that hold parameters (or whose class names are all in
    ``checkpointable``) recompute their activations in the backward pass (``checkpoint_func(fn, *inputs)``,
    default non-reentrant ``torch.utils.checkpoint``)."""

    def __init__(
        self,
        blocks: list[tuple[str, nn.Module]],
        *,
        stage_index: int,
        checkpoint_interval: int = 0,
        checkpoint_func: Callable | None = None,
        checkpointable: list[str] | None = None,
    ) -> None:
        super().__init__(blocks, stage_index=stage_index, block_names=[n for n, _ in blocks])
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_func = checkpoint_func
        self.checkpointable = checkpointable

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        x: Any = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
        x = x[0] if len(x) == 1 else x
        layers = list(self)
        k = self.checkpoint_interval
        if k <= 0 or not self.training:
            return _run(layers, x)
        for start in range(0, len(layers), k):
            chunk = layers[start : start + k]
            if not self._checkpointable(chunk):
                x = _run(chunk, x)
                continue
            args = x if isinstance(x, tuple) else (x,)
            fn = lambda *a, chunk=chunk: _run(chunk, a[0] if len(a) == 1 else a)
            if self.checkpoint_func is not None:
                x = self.checkpoint_func(fn, *args)
            else:
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(fn, *args, use_reentrant=False)
        return x

    def _checkpointable(self, chunk: list[nn.Module]) -> bool:
        inner = [m.module if isinstance(m, TiedCall) else m for m in chunk]
        if self.checkpointable is not None:
            return all(type(m).__name__ in self.checkpointable for m in inner)
        return any(any(True for _ in m.parameters()) for m in inner)


def _run(layers: list[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


__all__ = ["CallLayer", "PipeStage", "TiedCall"]
