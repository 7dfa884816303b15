"""DeepSpeed's layer specifications and its partitioning of a layer list into pipeline stages.

A pipeline model is a list of *layers*, each one of:

* ``LayerSpec(Type, *args, **kwargs)``: a module built later, only by the stage that owns it;
* ``TiedLayerSpec(key, Type, *args, forward_fn=None, tied_weight_attr=["weight"], **kwargs)``: a module shared by
  every layer with the same ``key`` (one copy per stage; the ``tied_weight_attr`` weights are kept equal across
  stages); ``forward_fn(module, x)`` replaces ``module(x)`` where given (e.g. an embedding used as the output head);
* an ``nn.Module`` (already built, the same on every rank), or any callable (``lambda x: x.flatten(1)``).

``partition_layers(layers, num_stages, method)`` returns DeepSpeed's stage edges ``parts`` (stage s holds layers
``parts[s]:parts[s + 1]``) for its three methods, with its exact results (``partition.py``):

* ``"uniform"``: the same number of layers per stage;
* ``"parameters"``: balanced trainable-parameter counts (every ``LayerSpec`` is built once to count it: this draws
  from the random generator exactly as DeepSpeed does, so that the stages' weights come out the same);
* ``"type:REGEX"``: balanced counts of layers whose class name (a function's ``__name__``) matches ``REGEX``
  (case-insensitive; DeepSpeed lower-cases the method, regex included).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Sequence

from torch import nn

from llmpar.pipeline.partition import partition_balanced, partition_uniform

logger = logging.getLogger("llmpar")
PARTITION_METHODS = ("parameters", "uniform", "type:REGEX")


class LayerSpec:
    """A layer built later (by the stage that owns it): ``LayerSpec(nn.Linear, 512, 512, bias=False)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec typename must be an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """The module, built now."""
        if log:
            logger.info("building %r", self)
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` weights are shared by every layer with the same ``key``, on every stage."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str):
            raise TypeError(f"TiedLayerSpec key must be a str, got {type(key).__name__}")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec forward_fn must be callable as forward_fn(module, x), got {forward_fn!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def check_layers(layers: Any) -> list[Any]:
    """The layers as a list; a TypeError names the first one that is neither a spec, a module nor a callable."""
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(
            f"layers must be a list of LayerSpec / TiedLayerSpec / nn.Module / callables, got {type(layers).__name__}"
        )
    out = list(layers)
    if not out:
        raise ValueError("layers is empty: a pipeline needs at least one layer")
    for i, layer in enumerate(out):
        if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
            raise TypeError(
                f"layers[{i}] is a {type(layer).__name__}: pass a LayerSpec, TiedLayerSpec, nn.Module or callable"
            )
    return out


def layer_name(layer: Any) -> str | None:
    """The class name DeepSpeed matches ``type:`` against (None for a callable without ``__name__``)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def layer_param_counts(layers: Sequence[Any]) -> list[int]:
    """Trainable parameters of each layer; each ``LayerSpec`` is built (and dropped) to count it."""
    counts = []
    for layer in layers:
        module = layer.build() if isinstance(layer, LayerSpec) else layer if isinstance(layer, nn.Module) else None
        counts.append(0 if module is None else sum(p.numel() for p in module.parameters() if p.requires_grad))
    return counts


def partition_layers(layers: Sequence[Any], num_stages: int, method: str = "parameters") -> list[int]:
    """DeepSpeed's ``parts`` for ``layers`` cut into ``num_stages`` stages by ``method`` (module docstring)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be a positive int")
    if not isinstance(method, str):
        raise TypeError(f"partition_method must be a str, one of {PARTITION_METHODS}, got {type(method).__name__}")
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(layers), num_stages)
    if method == "parameters":
        return partition_balanced(layer_param_counts(layers), num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":")[1], re.IGNORECASE)
        hits = [1 if (name := layer_name(layer)) is not None and pattern.search(name) else 0 for layer in layers]
        if not any(hits):
            raise ValueError(
                f"partition_method={method!r}: no layer's class name matches "
                f"{pattern.pattern!r} (names: {[layer_name(layer) for layer in layers]})"
            )
        return partition_balanced(hits, num_stages)
    raise ValueError(f"partition_method={method!r} is not one of {PARTITION_METHODS}")


__all__ = [
    "LayerSpec",
    "PARTITION_METHODS",
    "TiedLayerSpec",
    "check_layers",
    "layer_name",
    "layer_param_counts",
    "partition_layers",
]
