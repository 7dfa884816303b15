"""A client optimizer or LR scheduler given to ``llmpar.initialize`` (DeepSpeed's ``optimizer=`` / ``lr_scheduler=``),
mapped onto the ZeroOptimizer.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    engine, zero_opt, _, sched = llmpar.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)

optimizer: one of :data:`SUPPORTED` (or a callable ``params -> optimizer``). Its param groups (params and lr, betas,
eps, weight_decay) become the ZeroOptimizer's groups, in order, and ZeRO steps them over its partitions with the fused
AdamW step; the object itself is never stepped. Adam with L2 regularisation (``torch.optim.Adam(weight_decay>0)``),
AMSGrad and ``maximize`` are other math and are refused, as are other optimizer classes.
lr_scheduler: a torch LR scheduler built on that optimizer (or a callable ``optimizer -> scheduler``, which also
works with the config's optimizer). The engine steps it after each applied optimizer step (DeepSpeed's rule: not
after a step skipped for non-finite gradients) and copies the lr (and betas) it set in the client optimizer's groups
into the ZeroOptimizer's.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from llmpar.optim.adamw import FusedAdamW
from llmpar.zero.config import OptimizerConfig

SUPPORTED = (
    "torch.optim.AdamW, torch.optim.Adam (weight_decay=0 or decoupled_weight_decay=True), "
    "llmpar.optim.FusedAdamW, llmpar.ops.adam.FusedAdam / DeepSpeedCPUAdam"
)
_HYPER = ("lr", "betas", "eps", "weight_decay")


def _float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def _check_kind(opt: torch.optim.Optimizer) -> None:
    name = type(opt).__name__
    if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam, FusedAdamW)):
        raise TypeError(
            f"optimizer={name}: llmpar runs AdamW inside its ZeRO optimizer and maps only {SUPPORTED} "
            'onto it; describe the optimizer in the config\'s "optimizer" block or pass one of those'
        )
    for gi, g in enumerate(opt.param_groups):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if g.get(flag):
                raise ValueError(
                    f"optimizer={name} with {flag}=True (param group {gi}) is not supported: llmpar's "
                    "ZeRO step is plain AdamW"
                )
        if (
            isinstance(opt, torch.optim.Adam)
            and not isinstance(opt, torch.optim.AdamW)
            and _float(g["weight_decay"]) != 0
            and not g.get("decoupled_weight_decay", False)
        ):
            raise ValueError(
                f"optimizer=torch.optim.Adam with weight_decay={g['weight_decay']} (param group {gi}) is "
                "Adam with L2 regularisation, which llmpar does not run: use torch.optim.AdamW (decoupled "
                "weight decay), Adam(decoupled_weight_decay=True) or weight_decay=0"
            )


def client_optimizer(
    model: nn.Module, optimizer: Any, model_parameters: Any, clipping: float
) -> tuple[torch.optim.Optimizer, list[dict], OptimizerConfig]:
    """(the torch optimizer, its param groups as group dicts of (name, param) pairs, the OptimizerConfig)."""
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer ({SUPPORTED}) or a callable returning one, got "
            f"{type(optimizer).__name__}"
        )
    _check_kind(optimizer)
    if any(optimizer.state.values()):
        raise ValueError(
            f"optimizer={type(optimizer).__name__} has state (it was stepped): llmpar's ZeRO optimizer "
            "starts from fresh moments; pass a new optimizer (or load a checkpoint into the engine)"
        )
    max_norm = getattr(optimizer, "max_grad_norm", None)
    if max_norm is not None and float(max_norm) != clipping:
        raise ValueError(
            f"optimizer={type(optimizer).__name__}(max_grad_norm={max_norm}) but the config's "
            f'"gradient_clipping" is {clipping}: the engine clips; set "gradient_clipping" instead'
        )
    name_of: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), n)
    groups, precisions = [], set()
    for gi, g in enumerate(optimizer.param_groups):
        named = [(name_of.get(id(p), f"group{gi}.param{k}"), p) for k, p in enumerate(g["params"])]
        groups.append(
            {
                "params": named,
                "lr": _float(g["lr"]),
                "betas": tuple(_float(b) for b in g["betas"]),
                "eps": _float(g["eps"]),
                "weight_decay": _float(g["weight_decay"]),
            }
        )
        precisions.add((g.get("precision", "auto"), g.get("state_precision")))
    if len(precisions) > 1:
        raise ValueError(
            f"optimizer={type(optimizer).__name__} has param groups of different precisions "
            f"{sorted(precisions, key=str)}: the engine runs one precision mode; give every group the "
            "same"
        )
    first = groups[0] if groups else {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    precision, state_precision = precisions.pop() if precisions else ("auto", None)
    if state_precision == "bf16":  # FusedAdamW's spelling of the bf16_sr mode
        precision, state_precision = "bf16_sr", None
    sr = bool(getattr(optimizer, "stochastic_rounding", False)) and state_precision in ("int8", "int4")
    cfg = OptimizerConfig(
        type="AdamW",
        precision=precision,
        state_precision=state_precision,
        stochastic_rounding=sr,
        seed=int(getattr(optimizer, "seed", 0)),
        **{k: first[k] for k in _HYPER},
    )
    return optimizer, groups, cfg


def proxy_optimizer(zero_opt: Any) -> torch.optim.Optimizer:
    """A torch optimizer over the ZeroOptimizer's params and groups, for a callable ``lr_scheduler`` when the
    optimizer comes from the config (never stepped: the scheduler's lrs are copied over)."""
    cfg = zero_opt.config
    groups = [{"params": list(g["params"]), **{k: g[k] for k in _HYPER}} for g in zero_opt.param_groups]
    return torch.optim.Optimizer(
        groups, {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    )


def client_scheduler(
    scheduler: Any, torch_opt: torch.optim.Optimizer | None, zero_opt: Any
) -> tuple[Any, torch.optim.Optimizer]:
    """(the scheduler object, the torch optimizer it sets lrs in)."""
    if callable(scheduler) and not hasattr(scheduler, "step"):
        torch_opt = torch_opt if torch_opt is not None else proxy_optimizer(zero_opt)
        scheduler = scheduler(torch_opt)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            "lr_scheduler=ReduceLROnPlateau needs a metric at each step, which engine.step() does not "
            "have: use a schedule that steps without one (LambdaLR, OneCycleLR, ...) or the config's "
            '"scheduler" block'
        )
    if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")):
        raise TypeError(
            f"lr_scheduler must be an LR scheduler (step, state_dict, load_state_dict) or a callable "
            f"optimizer -> scheduler, got {type(scheduler).__name__}"
        )
    bound = getattr(scheduler, "optimizer", None)
    if torch_opt is None:
        raise ValueError(
            "lr_scheduler= an object needs optimizer= the torch optimizer it was built on; with the "
            'config\'s "optimizer" pass a callable instead (lr_scheduler=lambda opt: LambdaLR(opt, f))'
        )
    if bound is not torch_opt:
        raise ValueError(
            f"lr_scheduler={type(scheduler).__name__} was built on another optimizer than the "
            "optimizer= given to initialize: build it on that one"
        )
    return scheduler, torch_opt


def mirror_groups(src: list[dict], dst: list[dict]) -> None:
    """Copy the lr (and betas) a scheduler set in ``src``'s param groups into ``dst``'s (the same order)."""
    for s, d in zip(src, dst):
        d["lr"] = _float(s["lr"])
        if "betas" in s and "betas" in d:
            d["betas"] = tuple(_float(b) for b in s["betas"])


def step_scheduler(scheduler: Any, torch_opt: torch.optim.Optimizer, zero_opt: Any, lr_kwargs: dict | None) -> None:
    """Step a client scheduler (its optimizer is never stepped: torch's order warning is moot) and copy its lrs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been overridden")
        scheduler.step(**(lr_kwargs or {}))
    mirror_groups(torch_opt.param_groups, zero_opt.param_groups)


__all__ = ["SUPPORTED", "client_optimizer", "client_scheduler", "mirror_groups", "proxy_optimizer", "step_scheduler"]
