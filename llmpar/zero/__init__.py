"""ZeRO: flat-buffer layout, bucketed gradient reduction and the partitioned optimizer (stages 0-3), CPU offload.

    from llmpar.zero import ZeroOptimizer, OptimizerConfig
    opt = ZeroOptimizer(model.named_parameters(), OptimizerConfig(lr=3e-4), env.mesh["dp"], stage=2)
    opt = ZeroOptimizer(model.named_parameters(), None, env.mesh["dp"], stage=3, module=model)   # params sharded

``Init`` and ``GatheredParameters`` take DeepSpeed's signatures too (``deepspeed.zero.Init(config_dict_or_path=...,
enabled=...)``, ``deepspeed.zero.GatheredParameters(params, modifier_rank=0)`` without the optimizer: the params
know theirs once ``llmpar.initialize`` built it, :data:`OWNER_ATTR`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch

from llmpar.zero import gather as _gather
from llmpar.zero import init as _init
from llmpar.zero.config import OffloadConfig, OptimizerConfig, ZeroConfig
from llmpar.zero.deferred import DeferredInitError
from llmpar.zero.gather import consolidated_state_dict, frozen_state_dict, load_frozen
from llmpar.zero.layout import FlatLayout, ParamSlot, Unit
from llmpar.zero.loss_scale import LossScaler
from llmpar.zero.optimizer import ZeroOptimizer
from llmpar.zero.units import unit_modules

OWNER_ATTR = "_llmpar_zero_optimizer"  # on each param: a weakref to the ZeroOptimizer holding it (set by initialize)


def mark_owner(optimizer: ZeroOptimizer) -> None:
    """Let every param of ``optimizer`` find it (a weak reference: no cycle), for :func:`GatheredParameters`
    without the optimizer argument."""
    ref = weakref.ref(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            setattr(p, OWNER_ATTR, ref)


class Init(_init.Init):
    """``with llmpar.zero.Init(): model = LlamaForCausalLM(cfg)``: params on the meta device, their construction
    recorded and replayed by ZeRO-3 one unit at a time, so every param and buffer equals the plain build's under the
    same seed (``llmpar.zero.init``; an op the replay cannot reproduce is refused where it runs, naming the module;
    ``init_fn=`` a per-unit init run after the replay; writes into the params between the block and
    ``initialize``, ``load_state_dict`` included, are recorded and replayed too). DeepSpeed's arguments are taken
    too: ``enabled=False`` is a plain block (the model is built normally); ``config_dict_or_path`` / ``config``,
    ``dtype`` (the engine puts the params in the config's precision), ``remote_device`` "cpu" / "none" (offload is
    the config's ``offload_param``), ``pin_memory``, ``mem_efficient_linear`` are accepted. What would change the
    partitioning here is refused with the alternative: ``module=`` (an already built model), process groups /
    ``mpu`` (``initialize`` takes ``dp_group=`` / ``mesh=``), NVMe, quantized weights, a param swapper."""

    def __init__(
        self,
        module: Any = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        *,
        init_fn: _init.InitFn | None = None,
    ) -> None:
        if module is not None:
            raise ValueError(
                "zero.Init(module=...) partitions a model already built: llmpar.initialize shards it "
                'under "zero_optimization.stage": 3; or build it inside `with llmpar.zero.Init():`'
            )
        groups = {
            "data_parallel_group": data_parallel_group,
            "mpu": mpu,
            "zero_param_parallel_group": zero_param_parallel_group,
            "sequence_data_parallel_group": sequence_data_parallel_group,
        }
        for name, value in groups.items():
            if value is not None:
                raise ValueError(
                    f"zero.Init({name}=...) is not taken: the ranks a model is sharded over are "
                    "llmpar.initialize's (dp_group= / mesh=)"
                )
        if remote_device not in (None, "cpu", "none"):
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}): only CPU offload is supported (the config's "
                '"offload_param": {"device": "cpu"})'
            )
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError("zero.Init with quantized weights (ZeRO++) is not supported")
        if param_swapper is not None:
            raise ValueError("zero.Init(param_swapper=...) (NVMe) is not supported")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        super().__init__(init_fn=init_fn)
        self.enabled = enabled

    def __enter__(self) -> Init:
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            super().__exit__(*exc)


@contextlib.contextmanager
def GatheredParameters(
    params: Any,
    optimizer_or_modifier_rank: Any = None,
    fwd_module: Any = None,  # noqa: N802
    enabled: bool = True,
    *,
    modifier_rank: int | None = None,
    optimizer: Any = None,
) -> Iterator[None]:
    """Params whole on every dp rank within the block; with ``modifier_rank`` that rank's values at exit become the
    params everywhere (shards and fp32 masters). llmpar's form ``GatheredParameters(params, optimizer,
    modifier_rank=...)`` (``params`` None: all of them) or DeepSpeed's ``GatheredParameters(params,
    modifier_rank=None, fwd_module=None, enabled=True)``: the optimizer is the one ``llmpar.initialize`` built for
    these params; params it does not hold are left alone (DeepSpeed's rule for non-ZeRO params), and none held makes
    the block a no-op. Collective over dp: every rank enters it with the same params. ``fwd_module`` (DeepSpeed's
    external-parameter registration) is not supported."""
    if isinstance(optimizer_or_modifier_rank, int) or optimizer_or_modifier_rank is None:
        if optimizer_or_modifier_rank is not None and modifier_rank is not None:
            raise TypeError("modifier_rank given twice")
        modifier_rank = optimizer_or_modifier_rank if optimizer_or_modifier_rank is not None else modifier_rank
    elif optimizer is not None:
        raise TypeError("optimizer given twice")
    else:
        optimizer = optimizer_or_modifier_rank
    if fwd_module is not None:
        raise ValueError(
            "GatheredParameters(fwd_module=...) is not supported: a param used by another module's "
            "forward must be registered there too (tie it: other.weight = param) or both modules put in "
            "one sharding unit (llmpar.initialize(unit_policy=...))"
        )
    if not enabled:
        yield
        return
    if optimizer is not None:  # llmpar's form
        with _gather.GatheredParameters(params, optimizer, modifier_rank=modifier_rank):
            yield
        return
    plist = [] if params is None else [params] if isinstance(params, torch.Tensor) else list(params)
    if any(isinstance(p, torch.Tensor) and p.is_meta for p in plist):
        raise ValueError(
            "GatheredParameters: params on the meta device (built under llmpar.zero.Init) have no values "
            "before llmpar.initialize materialises them: write into them directly (model.load_state_dict, "
            "in-place ops: recorded and replayed by initialize), modify them after initialize, or give "
            "Init(init_fn=...)"
        )
    owners = {id(o): o for o in (getattr(p, OWNER_ATTR, lambda: None)() for p in plist) if o is not None}
    if len(owners) > 1:
        raise ValueError("GatheredParameters: the params belong to different optimizers: gather each one's apart")
    if not owners:
        yield
        return
    owner = next(iter(owners.values()))
    held = [p for p in plist if getattr(p, OWNER_ATTR, lambda: None)() is owner]
    with _gather.GatheredParameters(held, owner, modifier_rank=modifier_rank):
        yield


def register_external_parameter(module: Any, parameter: Any) -> None:
    """DeepSpeed's registration of a param used in the forward of a module that does not hold it: not supported."""
    raise NotImplementedError(
        "register_external_parameter is not supported: register the param in the module that "
        "uses it too (tie it: module.weight = parameter; ZeRO-3 gathers a param for every module "
        "holding it) or put both modules in one sharding unit (llmpar.initialize(unit_policy=))"
    )


def unregister_external_parameter(module: Any, parameter: Any) -> None:
    raise NotImplementedError("unregister_external_parameter is not supported (nor is register_external_parameter)")


__all__ = [
    "DeferredInitError",
    "FlatLayout",
    "GatheredParameters",
    "Init",
    "LossScaler",
    "OWNER_ATTR",
    "OffloadConfig",
    "OptimizerConfig",
    "ParamSlot",
    "Unit",
    "ZeroConfig",
    "ZeroOptimizer",
    "consolidated_state_dict",
    "frozen_state_dict",
    "load_frozen",
    "mark_owner",
    "register_external_parameter",
    "unit_modules",
    "unregister_external_parameter",
]
