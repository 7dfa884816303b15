"""linear_act, the GEMM with a fused bias / activation / residual epilogue, and its backward, vs the torch composition
the tests check it against (tests/gemm_helpers.py ``_composition``: ``act(F.linear(x, W, b)) + r``).

Shapes [M tokens, K in, N out]: small on CPU (torch runs both sides there: the rows show the op's overhead), an
LLM MLP's on CUDA (bf16). ``bias_act_backward`` (dY * act'(z) and the bias gradient in one pass) is timed on CUDA
only: on CPU llmpar's backward is torch's own (the fwd+bwd cases).
"""

from __future__ import annotations

import pytest
import torch
from suite_util import IMPLS, grid, require, run

from llmpar.ops import linear_act
from llmpar.ops.gemm_reference import ACTIVATIONS, act_grad_torch

from gemm_helpers import _composition, _inputs, _rand

SIZES = {"cpu": [(256, 256, 512), (512, 512, 1024)], "cuda": [(2048, 1024, 4096), (8192, 4096, 11008)]}
DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
EPILOGUES = {"bias+gelu_tanh": ("gelu_tanh", False), "bias+residual": ("none", True)}  # act, residual


def _mkn(size: tuple[int, int, int]) -> str:
    return "x".join(map(str, size))


def _cuda_ops(act: str) -> tuple[str, ...]:
    return ("linear_lt", "bias_act_backward") + (("linear_lt_aux",) if act == "gelu_tanh" else ())


def _case(device: torch.device, size: tuple[int, int, int], epilogue: str, grad: bool):
    act, has_residual = EPILOGUES[epilogue]
    x, w, b, r, dy = (t.to(device) for t in _inputs(*size, DTYPE[device.type]))
    r = r if has_residual else None
    if grad:
        for t in (x, w, b):
            t.requires_grad_()
    return act, x, w, b, r, dy


@grid(SIZES, _mkn, epilogue=EPILOGUES, impl=IMPLS)
def test_linear_act_forward(benchmark, device, size, epilogue, impl):
    act, x, w, b, r, _ = _case(device, size, epilogue, grad=False)
    require(impl, device, _cuda_ops(act))
    if impl == "torch":

        def fn():
            return _composition(x, w, b, r, act, x.dtype)
    else:

        def fn():
            return linear_act(x, w, b, act=act, residual=r)

    with torch.no_grad():
        run(
            benchmark, fn, device=device, group=f"linear_act fwd {epilogue} {_mkn(size)}", impl=impl, dtype=str(x.dtype)
        )


@grid(SIZES, _mkn, epilogue=EPILOGUES, impl=IMPLS)
def test_linear_act_fwd_bwd(benchmark, device, size, epilogue, impl):
    act, x, w, b, r, dy = _case(device, size, epilogue, grad=True)
    require(impl, device, _cuda_ops(act))

    def fn():
        x.grad = w.grad = b.grad = None
        y = _composition(x, w, b, r, act, x.dtype) if impl == "torch" else linear_act(x, w, b, act=act, residual=r)
        y.backward(dy)

    run(
        benchmark, fn, device=device, group=f"linear_act fwd+bwd {epilogue} {_mkn(size)}", impl=impl, dtype=str(x.dtype)
    )


@grid(SIZES, _mkn, act=("gelu_tanh", "silu"), impl=("torch", "llmpar-cuda"))
def test_bias_act_backward(benchmark, device, size, act, impl):
    if device.type != "cuda":
        pytest.skip("bias_act_backward is a CUDA kernel; on CPU linear_act's backward is torch's (fwd+bwd cases)")
    require(impl, device, ("bias_act_backward",))
    m, _, n = size
    g = torch.Generator().manual_seed(0)
    z, dy = (_rand((m, n), DTYPE[device.type], g).to(device) for _ in range(2))  # pre-activation, upstream grad
    if impl == "torch":  # what autograd runs for act(F.linear(...)): act' elementwise, then the bias gradient

        def fn():
            gp = act_grad_torch(dy, z, act)
            return gp, gp.sum(0, dtype=torch.float32)
    else:
        code = ACTIVATIONS.index(act)

        def fn():
            return torch.ops.llmpar.bias_act_backward(dy, z, code)

    run(benchmark, fn, device=device, group=f"bias_act_backward {act} {m}x{n}", impl=impl, dtype=str(z.dtype))
