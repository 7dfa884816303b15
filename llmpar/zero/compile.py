"""ZeRO-3 under ``torch.compile``: one compiled region per sharding unit, gathers and releases between the regions.

ZeRO-3 gathers a unit's params in the unit module's forward pre-hook and releases them in its forward post-hook
(``stage3.py``); in between a param is its view into the unit's gathered tensor, outside it an empty tensor
(``views.py``). Compiling the whole model would put those hooks -- async all-gathers, ``.data`` swaps, storage
resizes -- inside the graph (graph breaks, guards failing on the empty params, a recompile per step). So, as
torchtitan compiles each transformer block, :func:`compile_stage3` compiles each *leaf* unit module's ``forward``
(a unit holding no other unit: the blocks, the embeddings, the final norm, the head) in place and leaves
``nn.Module.__call__`` eager::

    unit.__call__ (eager)  ->  pre-hook: gather this unit, prefetch the next ones (eager, as without compile)
                           ->  unit.forward (compiled region: params are graph inputs, always whole here)
                           ->  post-hook: wrap outputs for the backward re-gather, release (eager)

Inside a region a param is always its gathered view (same shape, strides and offset at every call), so the guards
hold and nothing recompiles from step to step; no size-0 placeholder and no ``.data`` swap is ever traced. Backward
runs each region's compiled backward between the eager ``_OnBackward`` nodes that re-gather the unit first and the
gradient hooks that reduce-scatter it after, so the gather order, prefetch and overlap are those of eager ZeRO-3.
Units that hold other units (the root, or outer units of a custom ``unit_policy``) stay eager: their forward calls
hooked modules.

Refused, with the reason: a module other than the one the optimizer partitions, a backend that is not registered,
``torch.compile`` arguments it does not take, and CUDA-graph modes (``mode="reduce-overhead"`` /
``"max-autotune"``, ``options={"triton.cudagraphs": True}``): a CUDA graph replays fixed addresses, a ZeRO-3 param's
storage is reallocated at every gather.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from torch import nn

from llmpar.distributed.funcol import with_dynamic_rows

logger = logging.getLogger("llmpar")

__all__ = ["compile_stage3", "compiled_regions", "regions", "uncompile_stage3"]

COMPILE_KWARGS = tuple(p for p in inspect.signature(torch.compile).parameters if p not in ("model", "backend"))
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_EAGER_ATTR = "_llmpar_eager_forward"  # on a compiled unit module: its forward before compile_stage3


def regions(units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The leaf units of ``units`` (``(name, module)``, ``UnitPlan.units``): those that hold no other unit, in
    order. The root is one only when it is the only unit."""
    unit_ids = {id(m) for _, m in units}
    out = []
    for name, m in units:
        if not any(id(sub) in unit_ids for sub in m.modules() if sub is not m):
            out.append((name, m))
    return out


def _check_backend(backend: Any) -> None:
    if callable(backend):
        return
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a registered torch.compile backend name or a callable, got {backend!r}")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        known = torch._dynamo.list_backends()
        raise ValueError(f"backend={backend!r} is not a registered torch.compile backend; registered: {known}")


def _check_kwargs(compile_kwargs: Any) -> dict[str, Any]:
    if compile_kwargs is None:
        return {}
    if not isinstance(compile_kwargs, dict):
        raise TypeError(f"compile_kwargs must be a dict of torch.compile arguments or None, got {compile_kwargs!r}")
    unknown = sorted(str(k) for k in compile_kwargs if k not in COMPILE_KWARGS)
    if unknown:
        raise ValueError(
            f"compile_kwargs has {unknown}: torch.compile of a ZeRO-3 unit takes {list(COMPILE_KWARGS)} "
            "(backend is its own argument)"
        )
    mode, options = compile_kwargs.get("mode"), compile_kwargs.get("options") or {}
    if not isinstance(options, dict):
        raise TypeError(f"compile_kwargs['options'] must be a dict of inductor options, got {options!r}")
    if mode in CUDAGRAPH_MODES or options.get("triton.cudagraphs"):
        what = f"mode={mode!r}" if mode in CUDAGRAPH_MODES else "options['triton.cudagraphs']=True"
        raise ValueError(
            f"compile_kwargs {what} records CUDA graphs, which replay fixed addresses, while a ZeRO-3 param's "
            "storage is reallocated at every gather; use mode=None, 'default' or 'max-autotune-no-cudagraphs'"
        )
    if options.get("freezing"):
        raise ValueError(
            "compile_kwargs options['freezing']=True folds the params into the graph as constants, while ZeRO-3 "
            "params change at every step and are gathered into new storage; leave freezing off"
        )
    return dict(compile_kwargs)


def compile_stage3(optimizer: Any, module: nn.Module, backend: str | Callable[..., Any], compile_kwargs: Any) -> None:
    """Compile, in place, the ``forward`` of each leaf ZeRO-3 unit of ``module`` (:func:`regions`) with
    ``torch.compile(forward, backend=backend, **compile_kwargs)``; the gather / release hooks stay eager between the
    regions (module docstring). ``optimizer``: the stage-3 ``ZeroOptimizer`` built with ``module=module``. Calling
    it again recompiles from the eager forwards (:func:`uncompile_stage3` restores them). Not collective: a bad
    argument raises the same error on every rank."""
    from llmpar.zero.optimizer import ZeroOptimizer

    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"optimizer must be the stage-3 ZeroOptimizer partitioning module, got {type(optimizer).__name__}"
        )
    if optimizer.stage != 3 or optimizer.plan is None or optimizer.stage3 is None:
        raise ValueError(
            f"compile_stage3 compiles ZeRO-3 units; the optimizer runs ZeRO stage {optimizer.stage} "
            "(stages 0-2 compile the whole model)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    root = optimizer.plan.units[0][1]
    if module is not root:
        raise ValueError(
            f"module (a {type(module).__name__}) is not the model this optimizer's ZeRO-3 partitions (a "
            f"{type(root).__name__}): pass the module given to the optimizer as module="
        )
    _check_backend(backend)
    kwargs = _check_kwargs(compile_kwargs)
    uncompile_stage3(module)
    chosen = regions(optimizer.plan.units)
    for _, m in chosen:
        eager = m.forward
        compiled = with_dynamic_rows(torch.compile(eager, backend=backend, **kwargs), m)  # MoE over ep > 1 ranks
        m.forward = compiled  # type: ignore[method-assign]
        setattr(m, _EAGER_ATTR, (eager, compiled))
    outer = len(optimizer.plan.units) - len(chosen)
    logger.info(
        "ZeRO-3 regional compile (backend %s): %d unit regions; %d outer unit(s) stay eager",
        backend if isinstance(backend, str) else getattr(backend, "__name__", "callable"),
        len(chosen),
        outer,
    )


def compiled_regions(module: nn.Module) -> list[str]:
    """The names of ``module``'s submodules (itself: ``""``) whose forward :func:`compile_stage3` compiled."""
    return [n for n, m in module.named_modules() if _EAGER_ATTR in m.__dict__]


def uncompile_stage3(module: nn.Module) -> None:
    """Give every unit :func:`compile_stage3` compiled its eager ``forward`` back. A forward wrapped again since
    (say, by activation checkpointing applied after the compile) is left as it is, calling the compiled one."""
    for name, m in module.named_modules():
        eager, compiled = m.__dict__.pop(_EAGER_ATTR, (None, None))
        if eager is None:
            continue
        if m.__dict__.get("forward") is not compiled:
            logger.warning("ZeRO-3 unit %r: its compiled forward was wrapped since; left compiled", name)
        elif getattr(eager, "__self__", None) is m and getattr(eager, "__func__", None) is getattr(
            type(m), "forward", None
        ):
            del m.__dict__["forward"]  # the class's forward again (no bound method kept on the instance)
        else:
            m.forward = eager  # type: ignore[method-assign]  # a forward set on the instance before (a wrapper)
