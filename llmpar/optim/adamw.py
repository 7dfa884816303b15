"""FusedAdamW: a drop-in ``torch.optim.Optimizer`` running AdamW in one fused launch per (group, dtype) bucket, in any
precision mode, with gradient clipping and the non-finite-grad skip folded into the step.

    opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, precision="bf16_sr", max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()

Precision modes (per param group; "auto" = "fp32" for float32/float64 params, "fp32_master" for bf16/fp16 ones):
    "fp32"         state: exp_avg, exp_avg_sq float32 (8 B/param; a torch.optim.AdamW state_dict loads as is)
    "fp32_master"  state: master, exp_avg, exp_avg_sq float32 (12 B/param); the bf16/fp16 param is the rounded master
    "bf16_sr"      state: exp_avg, exp_avg_sq bfloat16 (4 B/param); stochastic rounding, reproducible from ``seed``
    "bf16_kahan"   state: exp_avg, exp_avg_sq, kahan_comp bfloat16 (6 B/param); Kahan-compensated param updates
Every param also has ``state["step"]``, a float32 scalar on its device (as torch's fused AdamW keeps it).

max_grad_norm: clip the L2 norm of all grads (all groups) to it, inside the step, and skip the step (params, state and
step counts unchanged) when that norm is not finite; the norm of the last step is ``last_grad_norm`` (a device tensor,
read it with ``.item()`` only when you need it). The math and the backends are in ``llmpar.ops.adamw``.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from llmpar.ops.adamw import MODES, adamw_step, check_param_dtype, check_precision, resolve_precision
from llmpar.ops.grad_norm import clip_coefficient
from llmpar.optim.grad_norm import global_grad_norm
from llmpar.validation import FLOAT32_MAX, FLOAT32_TINY

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master", "kahan_comp")


def check_eps(name: str, eps: Any) -> float:
    """``eps`` as a float, refused (naming ``name``) unless in [FLOAT32_TINY, FLOAT32_MAX]: the step divides by
    ``sqrt(v) + eps`` in float32, and v is 0 wherever a gradient has been 0 (unused embedding rows, padding), so eps 0
    (or one that rounds to 0 in float32) turns those params into NaN at the first step."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name} must be a number, got {eps!r}")
    if not FLOAT32_TINY <= float(eps) <= FLOAT32_MAX:
        raise ValueError(f"{name}={eps!r} must be > 0 and finite: in [{FLOAT32_TINY:g}, {FLOAT32_MAX:g}] (a normal "
                         "float32; AdamW divides by sqrt(v) + eps, and v is 0 wherever a gradient is 0: eps 0 makes "
                         "those params NaN)")
    return float(eps)


def check_hyperparameters(*, lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """AdamW's hyper-parameters in the ranges the fused step computes with (float32 inside the kernels), each error
    naming ``where`` + the name: lr (a number or a one-element tensor) and weight_decay in [0, FLOAT32_MAX], betas
    two numbers in [0, 1), eps as :func:`check_eps`."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}lr as a tensor must have one element, got shape {tuple(lr.shape)}")
    elif isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0.0 <= lr <= FLOAT32_MAX:
        raise ValueError(f"{where}lr={lr!r} must be >= 0 and finite (<= {FLOAT32_MAX:g}, a float32)")
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2
            or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{where}betas={betas!r} must be two numbers in [0, 1)")
    check_eps(f"{where}eps", eps)
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real) or \
            not 0.0 <= weight_decay <= FLOAT32_MAX:
        raise ValueError(f"{where}weight_decay={weight_decay!r} must be >= 0 and finite (<= {FLOAT32_MAX:g})")


def state_dtypes(precision: str, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """State tensor name -> dtype for a param of ``dtype`` in mode ``precision`` (besides "step")."""
    spec = MODES[precision]
    moment = spec.moment_dtype or dtype
    out = {"exp_avg": moment, "exp_avg_sq": moment}
    if spec.extra is not None:
        out[spec.extra[0]] = spec.extra[1]
    return out


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (torch's math and defaults) with fused multi-tensor kernels and low-precision modes (module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, precision: str = "auto",
                 max_grad_norm: float | None = None, seed: int = 0) -> None:
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_precision(precision, allow_auto=True)
        if max_grad_norm is not None and not (max_grad_norm > 0 and max_grad_norm < float("inf")):
            raise ValueError(f"max_grad_norm={max_grad_norm} must be a positive finite number or None")
        self.max_grad_norm = max_grad_norm
        self.seed = int(seed)
        self.last_grad_norm: torch.Tensor | None = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, precision=precision)
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_group(group)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        """The group's hyper-parameters in range (:func:`check_hyperparameters`: a group may override the defaults);
        its precision is "auto" or a mode that takes each of its params (llmpar.ops.adamw's checks)."""
        check_hyperparameters(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                              weight_decay=group["weight_decay"], where="param group: ")
        check_precision(group["precision"], allow_auto=True)
        for p in group["params"]:
            check_param_dtype(resolve_precision(group["precision"], p.dtype), p.dtype,
                              f"a parameter of shape {tuple(p.shape)}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # e.g. a torch.optim.AdamW state_dict: no precision key
            group.setdefault("precision", "auto")
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("seed", 0)
        self.__dict__.setdefault("last_grad_norm", None)

    def _init_state(self, p: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for name, dtype in state_dtypes(mode, p.dtype).items():
            if name == "master":
                state[name] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            else:
                state[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over every param with a grad. Returns the closure's loss (if a closure is given)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets: dict[tuple, dict[str, list]] = {}
        grads_by_device: dict[torch.device, list[torch.Tensor]] = {}
        salt = -1
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                salt += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                mode = resolve_precision(group["precision"], p.dtype)
                state = self.state[p] if len(self.state[p]) > 0 else self._init_state(p, mode)
                extra = MODES[mode].extra
                key = (gi, p.device, mode, p.dtype, p.grad.dtype)
                b = buckets.setdefault(key, {k: [] for k in ("p", "g", "m", "v", "x", "s", "salt")})
                b["p"].append(p)
                b["g"].append(p.grad)
                b["m"].append(state["exp_avg"])
                b["v"].append(state["exp_avg_sq"])
                if extra is not None:
                    b["x"].append(state[extra[0]])
                b["s"].append(state["step"])
                b["salt"].append(salt)
                grads_by_device.setdefault(p.device, []).append(p.grad)
        clip: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.max_grad_norm is not None and grads_by_device:
            total = global_grad_norm([g for gs in grads_by_device.values() for g in gs])  # on the first device
            self.last_grad_norm = total
            for d in grads_by_device:
                clip[d] = clip_coefficient(total.to(d), self.max_grad_norm)
        for (gi, device, mode, _, _), b in buckets.items():
            group = self.param_groups[gi]
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != device:
                lr = lr.to(device)
            gscale, found_inf = clip.get(device, (None, None))
            adamw_step(b["p"], b["g"], b["m"], b["v"], b["s"], precision=mode, lr=lr, beta1=group["betas"][0],
                       beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                       extras=b["x"] or None, gscale=gscale, found_inf=found_inf, seed=self.seed, salts=b["salt"])
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the state kept in the dtypes its precision mode needs (torch casts every state tensor
        to the param's dtype, which would turn fp32 masters and moments of bf16 params into bf16)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        if len(ids) != len(params):
            return  # super() has raised already in this case
        for pid, (p, group) in zip(ids, params):
            if pid not in saved or p not in self.state:
                continue
            state, src = self.state[p], saved[pid]
            mode = resolve_precision(group["precision"], p.dtype)
            want = state_dtypes(mode, p.dtype)
            for name in list(state):
                if name in _STATE_KEYS and name not in want:
                    raise ValueError(f"state of param {pid} has {name!r}, which precision={mode!r} does not keep")
            for name, dtype in want.items():
                if name not in src:
                    if name == "master":
                        state[name] = p.detach().to(torch.float32, copy=True)
                        continue
                    raise ValueError(f"state of param {pid} lacks {name!r}, needed by precision={mode!r}")
                state[name] = src[name].to(device=p.device, dtype=dtype).contiguous()
            state["step"] = torch.as_tensor(src["step"], dtype=torch.float32).to(p.device).reshape(())
