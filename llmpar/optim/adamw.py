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

state_precision (per param group; None: as ``precision`` says): "fp32" (= precision "auto"), "bf16" (= "bf16_sr",
bf16 params), or the low-bit states of ``llmpar.ops.lowbit``, for float32 params (bf16 ones with a float32 master):
    "int8"  state: m_codes, v_codes uint8 [n], m_scale, v_scale float32 [ceil(n/256)]      (~2.03 B/param)
    "int4"  state: m_codes, v_codes uint8 [ceil(n/2)], m_scale, v_scale float32 [ceil(n/128)]  (~1.06 B/param)
    (+ "master" float32 for bf16 params). Blocks run along each param's flat view, from its first element.
    ``stochastic_rounding=True`` rounds the codes stochastically (reproducible from ``seed``; torch path).

max_grad_norm: clip the L2 norm of all grads (all groups) to it, inside the step, and skip the step (params, state and
step counts unchanged) when that norm is not finite; the norm of the last step is ``last_grad_norm`` (a device tensor,
read it with ``.item()`` only when you need it). The math and the backends are in ``llmpar.ops.adamw``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from llmpar.ops import lowbit
from llmpar.ops.adamw import MODES, adamw_step, check_param_dtype, check_precision, resolve_precision
from llmpar.ops.grad_norm import clip_coefficient
from llmpar.optim.grad_norm import global_grad_norm
from llmpar.validation import FLOAT32_MAX, FLOAT32_TINY

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master", "kahan_comp", "m_codes", "m_scale", "v_codes", "v_scale")
STATE_PRECISIONS = ("fp32", "bf16", "int8", "int4")
LOWBIT_BITS = {"int8": 8, "int4": 4}
_LOWBIT_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the 16-bit ones with a float32 master


def check_state_precision(state_precision: object) -> str | None:
    """``state_precision`` (None or one of STATE_PRECISIONS), or a ValueError naming the accepted values."""
    if state_precision is None or state_precision in STATE_PRECISIONS:
        return state_precision  # type: ignore[return-value]
    raise ValueError(
        f"state_precision={state_precision!r} is not known; use one of {', '.join(STATE_PRECISIONS)} "
        "(or None: as precision= says)"
    )


def group_mode(precision: str, state_precision: str | None, dtype: torch.dtype) -> str:
    """The mode a param of ``dtype`` steps in: a MODES name, or "int8" / "int4" (low-bit states)."""
    sp = check_state_precision(state_precision)
    if sp in LOWBIT_BITS:
        if dtype not in _LOWBIT_PARAM_DTYPES:
            raise TypeError(
                f"params have dtype {dtype}; state_precision={sp!r} takes float32, bfloat16 or float16 params"
            )
        return sp
    if sp is not None:
        want = "auto" if sp == "fp32" else "bf16_sr"
        if precision not in ("auto", want):
            raise ValueError(f"state_precision={sp!r} and precision={precision!r} disagree; give one of them")
        precision = want
    return resolve_precision(precision, dtype)


def check_eps(name: str, eps: Any) -> float:
    """``eps`` as a float, refused (naming ``name``) unless in [FLOAT32_TINY, FLOAT32_MAX]: the step divides by
    ``sqrt(v) + eps`` in float32, and v is 0 wherever a gradient has been 0 (unused embedding rows, padding), so eps 0
    (or one that rounds to 0 in float32) turns those params into NaN at the first step."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name} must be a number, got {eps!r}")
    if not FLOAT32_TINY <= float(eps) <= FLOAT32_MAX:
        raise ValueError(
            f"{name}={eps!r} must be > 0 and finite: in [{FLOAT32_TINY:g}, {FLOAT32_MAX:g}] (a normal "
            "float32; AdamW divides by sqrt(v) + eps, and v is 0 wherever a gradient is 0: eps 0 makes "
            "those params NaN)"
        )
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
    if (
        not isinstance(betas, (list, tuple))
        or len(betas) != 2
        or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{where}betas={betas!r} must be two numbers in [0, 1)")
    check_eps(f"{where}eps", eps)
    if (
        isinstance(weight_decay, bool)
        or not isinstance(weight_decay, numbers.Real)
        or not 0.0 <= weight_decay <= FLOAT32_MAX
    ):
        raise ValueError(f"{where}weight_decay={weight_decay!r} must be >= 0 and finite (<= {FLOAT32_MAX:g})")


def state_dtypes(precision: str, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """State tensor name -> dtype for a param of ``dtype`` in mode ``precision`` (besides "step"); ``precision`` may
    be a low-bit mode ("int8", "int4")."""
    if precision in LOWBIT_BITS:
        out = {"m_codes": torch.uint8, "m_scale": torch.float32, "v_codes": torch.uint8, "v_scale": torch.float32}
        if dtype != torch.float32:
            out["master"] = torch.float32
        return out
    spec = MODES[precision]
    moment = spec.moment_dtype or dtype
    out = {"exp_avg": moment, "exp_avg_sq": moment}
    if spec.extra is not None:
        out[spec.extra[0]] = spec.extra[1]
    return out


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (torch's math and defaults) with fused multi-tensor kernels and low-precision modes (module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        precision: str = "auto",
        max_grad_norm: float | None = None,
        seed: int = 0,
        state_precision: str | None = None,
        stochastic_rounding: bool = False,
    ) -> None:
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_precision(precision, allow_auto=True)
        check_state_precision(state_precision)
        self.stochastic_rounding = bool(stochastic_rounding)
        if max_grad_norm is not None and not (max_grad_norm > 0 and max_grad_norm < float("inf")):
            raise ValueError(f"max_grad_norm={max_grad_norm} must be a positive finite number or None")
        self.max_grad_norm = max_grad_norm
        self.seed = int(seed)
        self.last_grad_norm: torch.Tensor | None = None
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            precision=precision,
            state_precision=state_precision,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_group(group)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        """The group's hyper-parameters in range (:func:`check_hyperparameters`: a group may override the defaults);
        its precision is "auto" or a mode that takes each of its params (llmpar.ops.adamw's checks)."""
        check_hyperparameters(
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            where="param group: ",
        )
        check_precision(group["precision"], allow_auto=True)
        for p in group["params"]:
            mode = group_mode(group["precision"], group.get("state_precision"), p.dtype)
            if mode not in LOWBIT_BITS:
                check_param_dtype(mode, p.dtype, f"a parameter of shape {tuple(p.shape)}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # e.g. a torch.optim.AdamW state_dict: no precision key
            group.setdefault("precision", "auto")
            group.setdefault("state_precision", None)
        self.__dict__.setdefault("stochastic_rounding", False)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("seed", 0)
        self.__dict__.setdefault("last_grad_norm", None)

    def _init_state(self, p: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if mode in LOWBIT_BITS:
            state.update(lowbit.new_state(p.numel(), LOWBIT_BITS[mode], p.device))
        for name, dtype in state_dtypes(mode, p.dtype).items():
            if name in state:
                continue
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
                mode = group_mode(group["precision"], group.get("state_precision"), p.dtype)
                state = self.state[p] if len(self.state[p]) > 0 else self._init_state(p, mode)
                key = (gi, p.device, mode, p.dtype, p.grad.dtype)
                b = buckets.setdefault(key, {k: [] for k in ("p", "g", "m", "v", "x", "s", "salt", "ms", "vs")})
                b["p"].append(p)
                b["g"].append(p.grad)
                if mode in LOWBIT_BITS:
                    for k, name in (("m", "m_codes"), ("ms", "m_scale"), ("v", "v_codes"), ("vs", "v_scale")):
                        b[k].append(state[name])
                    if "master" in state:
                        b["x"].append(state["master"])
                else:
                    b["m"].append(state["exp_avg"])
                    b["v"].append(state["exp_avg_sq"])
                    extra = MODES[mode].extra
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
            if mode in LOWBIT_BITS:
                lowbit.adamw_lowbit_step(
                    b["p"],
                    b["g"],
                    b["m"],
                    b["ms"],
                    b["v"],
                    b["vs"],
                    b["s"],
                    b["x"] or None,
                    bits=LOWBIT_BITS[mode],
                    lr=lr,
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    gscale=gscale,
                    found_inf=found_inf,
                    seed=self.seed if self.stochastic_rounding else None,
                    salts=b["salt"],
                )
                continue
            adamw_step(
                b["p"],
                b["g"],
                b["m"],
                b["v"],
                b["s"],
                precision=mode,
                lr=lr,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                extras=b["x"] or None,
                gscale=gscale,
                found_inf=found_inf,
                seed=self.seed,
                salts=b["salt"],
            )
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
            mode = group_mode(group["precision"], group.get("state_precision"), p.dtype)
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
            if mode in LOWBIT_BITS:  # codes / scales sized for this param at these bits, or a clear error
                for m in ("m", "v"):
                    try:
                        lowbit.check_state(
                            state[f"{m}_codes"],
                            state[f"{m}_scale"],
                            LOWBIT_BITS[mode],
                            p.numel(),
                            f"{m}_codes",
                            f"{m}_scale",
                        )
                    except (TypeError, ValueError) as e:
                        raise ValueError(f"state of param {pid} does not fit state_precision={mode!r}: {e}") from None
            state["step"] = torch.as_tensor(src["step"], dtype=torch.float32).to(p.device).reshape(())
