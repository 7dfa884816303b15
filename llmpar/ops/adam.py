"""``deepspeed.ops.adam`` for DeepSpeed scripts: ``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's signatures,
both :class:`llmpar.optim.FusedAdamW` (one fused multi-tensor AdamW launch per bucket; torch's fused CPU AdamW on the
CPU, the step ZeRO-Offload runs on the host masters).

    from llmpar.ops.adam import FusedAdam          # deepspeed.ops.adam.FusedAdam
    opt = FusedAdam(model.parameters(), lr=3e-4, weight_decay=0.1)
    engine, opt, _, _ = llmpar.initialize(model=model, optimizer=opt, config=ds)   # its groups go to ZeRO

Used alone they are ordinary torch optimizers; given to ``llmpar.initialize`` their param groups and
hyper-parameters become the ZeRO optimizer's (``llmpar.runtime.client``). Both run AdamW (``adam_w_mode`` /
``adamw_mode`` True, DeepSpeed's default): Adam with L2 regularisation (``adam_w_mode=False`` and a weight decay),
``bias_correction=False`` and AMSGrad are other math and are refused; with weight_decay 0 the two modes are the same
step. A DeepSpeed-compatibility module at DeepSpeed's path: nothing inside llmpar imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

import torch

from llmpar.optim.adamw import FusedAdamW


def _check(name: str, *, bias_correction: bool, adamw: bool, weight_decay: float, amsgrad: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported: llmpar's AdamW always corrects the bias")
    if amsgrad:
        raise ValueError(f"{name}(amsgrad=True) is not supported")
    if not adamw and weight_decay != 0:
        raise ValueError(
            f"{name} with Adam's L2 mode (adam_w_mode=False) and weight_decay={weight_decay} is not "
            "supported: llmpar runs AdamW (decoupled weight decay); use the AdamW mode (the default)"
        )


class FusedAdam(FusedAdamW):
    """DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)`` as :class:`FusedAdamW`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _check(
            "FusedAdam", bias_correction=bias_correction, adamw=adam_w_mode, weight_decay=weight_decay, amsgrad=amsgrad
        )
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam_w_mode, self.set_grad_none = True, set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(FusedAdamW):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True)``: AdamW stepped on the host (params
    on the CPU, as DeepSpeed's requires; torch's fused CPU AdamW). Given to ``llmpar.initialize`` it may hold device
    params: the config's ``offload_optimizer`` then decides where ZeRO steps. ``fp32_optimizer_states=False``
    (moments in a 16-bit param's dtype) is not supported for 16-bit params (``FusedAdamW(precision="bf16_sr")`` keeps
    bf16 moments)."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _check(
            "DeepSpeedCPUAdam",
            bias_correction=bias_correction,
            adamw=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if not fp32_optimizer_states and any(
            p.dtype in (torch.bfloat16, torch.float16) for g in self.param_groups for p in g["params"]
        ):
            raise ValueError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported for 16-bit params: the "
                "moments are kept in float32 (FusedAdamW(precision='bf16_sr') keeps bfloat16 ones)"
            )
        self.adam_w_mode, self.fp32_optimizer_states = True, fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and p.device.type != "cpu":
                    raise RuntimeError(
                        f"DeepSpeedCPUAdam param is on {p.device} and must be 'cpu' (it steps on the "
                        "host): use FusedAdam, or hand it to llmpar.initialize with "
                        '"offload_optimizer": {"device": "cpu"}'
                    )
        return super().step(closure)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
