"""The fused AdamW step (llmpar.ops.adamw_step) in each precision mode, and with clipping, vs torch's fused AdamW
doing what a user would do instead:

    fp32          torch.optim.AdamW(fused=True) on the same fp32 params (foreach where torch has no fused kernel)
    fp32_master   torch fused AdamW on the fp32 masters, then a copy into the bf16 params
    bf16_sr       torch fused AdamW on the bf16 params (bf16 moments, nearest rounding)
    bf16_kahan    the same torch baseline as bf16_sr
    fp32+clip     torch clip_grad_norm_ + fused AdamW vs llmpar grad_norm + clip_coefficient + adamw_step(gscale)
State: the tests' ``make_state`` (tests/test_optim_ops.py: mid-training moments, step 4, values over a few
magnitudes), many tensors of one size per case. Steps keep counting across rounds, as in training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from suite_util import IMPLS, grid, once, require, run
from test_optim_ops import HYPER, make_state

from llmpar.ops import adamw_step, clip_coefficient, grad_norm

SIZES = {"cpu": [(1 << 16, 16), (1 << 17, 32)], "cuda": [(1 << 20, 16), (1 << 20, 64)]}  # (elements each, tensors)
PRECISIONS = ("fp32", "fp32_master", "bf16_sr", "bf16_kahan", "fp32+clip")
MAX_NORM = 1.0


def _ident(size: tuple[int, int]) -> str:
    return f"{size[0] * size[1] / 1e6:.1f}M"


def _torch_adamw(params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    """torch.optim.AdamW over copies of ``params`` with ``grads``, fused where torch has the kernel for them."""
    leaves = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(leaves, grads):
        p.grad = g.detach().clone()
    hyper = dict(
        lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], weight_decay=HYPER["weight_decay"]
    )
    try:
        opt = torch.optim.AdamW(leaves, fused=True, **hyper)
        opt.step()  # builds the state; raises here where fused is unsupported for this device / dtype
    except RuntimeError:
        opt = torch.optim.AdamW(leaves, foreach=True, **hyper)
    return opt


def _torch_case(precision: str, st: dict) -> Callable[[], None]:
    if precision == "fp32_master":
        opt = _torch_adamw(st["x"], [g.float() for g in st["g"]])
        masters = [p for group in opt.param_groups for p in group["params"]]

        def step():
            opt.step()
            torch._foreach_copy_(st["p"], masters)

        return step
    opt = _torch_adamw(st["p"], st["g"])
    if precision != "fp32+clip":
        return opt.step
    params = [p for group in opt.param_groups for p in group["params"]]

    def clip_step():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()

    return clip_step


def _llmpar_case(precision: str, st: dict) -> Callable[[], None]:
    mode = "fp32" if precision == "fp32+clip" else precision
    args = dict(precision=mode, extras=st["x"] or None, **HYPER)
    if precision != "fp32+clip":
        return lambda: adamw_step(st["p"], st["g"], st["m"], st["v"], st["s"], **args)

    def clip_step():
        gscale, found_inf = clip_coefficient(grad_norm(st["g"]), MAX_NORM)
        adamw_step(st["p"], st["g"], st["m"], st["v"], st["s"], gscale=gscale, found_inf=found_inf, **args)

    return clip_step


@once
def _state(mode: str, numel: int, n: int) -> dict[str, list[torch.Tensor]]:
    return {k: [t.cpu() for t in v] for k, v in make_state(mode, [(numel,)] * n).items()}


@grid(SIZES, _ident, precision=PRECISIONS, impl=IMPLS)
def test_adamw_step(benchmark, device, size, precision, impl):
    require(impl, device, ("adamw_step",) + (("sum_squares",) if precision == "fp32+clip" else ()))
    numel, n = size
    mode = "fp32" if precision == "fp32+clip" else precision
    st = _state(device, mode, numel, n)
    fn = _torch_case(precision, st) if impl == "torch" else _llmpar_case(precision, st)
    run(benchmark, fn, device=device, group=f"adamw {precision} {_ident(size)}", impl=impl, params=numel * n, tensors=n)
