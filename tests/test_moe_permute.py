"""llmpar.ops.moe_permute: the MoE token permute (sort by expert) and unpermute (back to token order, weighed by the
routing scores), forward and backward.

  - the torch path equals autograd through the plain composition bitwise (a scatter into slot order, the k weighted
    slots summed left to right in fp32), dropless and with dropped slots, for top-1/2/3;
  - every path against float64 with elementwise bounds: out = sum_j w y in fp32 (k roundings of |w y| sums) then
    one rounding to the dtype (a whole ulp where the Triton interpreter truncates fp32 -> bf16), dy = w G (one
    rounding), dw = <G, y> (H + 1 fp32 roundings), the permute's dx = sum_j g (k fp32 roundings, then one);
  - the Triton kernels under TRITON_INTERPRET=1 (one subprocess) and on a GPU (``-m gpu``); bad inputs named.
"""

from __future__ import annotations

import os

import pytest
import torch

from llmpar.ops.moe_permute import permute_rows, unpermute_rows

from interp import run_interpreted

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
in_main = pytest.mark.skipif(INTERPRET, reason="runs in the main process")
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
U32 = 2.0**-24


def _case(T, k, H, dtype, *, drop=0, seed=0, device="cpu"):
    """(x, y, order, weights, dy): ``drop`` slots dropped; order sorted by a random expert id, stably."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, 5, (T * k,), generator=g)
    order = torch.sort(experts, stable=True).indices
    if drop:
        keep = torch.randperm(T * k, generator=g)[drop:]
        order = order[torch.isin(order, keep)]
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(order.numel(), H, generator=g, dtype=torch.float64).to(dtype)
    w = torch.rand(T, k, generator=g, dtype=torch.float64).float() + 0.1
    dy = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    return [t.to(device) for t in (x, y, order, w, dy)]


def _composition(y, order, w, T, dtype):
    """The plain composition under autograd (what llmpar.moe.slots.combine_slots ran before the op)."""
    k, h = w.shape[1], y.shape[1]
    base = y.new_empty(T * k, h) if order.numel() == T * k else y.new_zeros(T * k, h)
    y3 = base.index_copy(0, order, y).view(T, k, h).to(torch.promote_types(y.dtype, torch.float32))
    wa = w.to(y3.dtype)
    out = y3[:, 0] * wa[:, 0:1]
    for j in range(1, k):
        out = out + y3[:, j] * wa[:, j : j + 1]
    return out.to(dtype)


def _grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()]


def _check_vs_float64(x, y, order, w, dy, *, truncates=False):
    T, k = w.shape
    dtype = y.dtype
    eps = torch.finfo(dtype).eps
    u = eps if truncates and dtype != torch.float32 else eps / 2
    tiny = 2.0**-25 if dtype == torch.float16 else 0.0
    out, (gy, gw) = _grads(lambda y_, w_: unpermute_rows(y_, order, w_, T), [y, w], dy)
    out64, (gy64, gw64) = _grads(
        lambda y_, w_: _composition(y_, order.cpu(), w_, T, torch.float64),
        [y.double().cpu(), w.double().cpu()],
        dy.double().cpu(),
    )
    mag = _composition(y.double().abs().cpu(), order.cpu(), w.double().cpu(), T, torch.float64)
    checks = {
        "out": (out, out64, (k * U32 + u) * mag + tiny),
        "dy": (gy, gy64, u * gy64.abs() + tiny),
        "dw": (gw, gw64, (y.shape[1] + 1) * U32 * _dw_mag(y, order, dy, T, k) + 1e-30),
    }
    xp, (gx,) = _grads(lambda x_: permute_rows(x_, order, k), [x], y)
    tok = order.cpu() // k
    _, (gx64,) = _grads(lambda x_: x_[tok], [x.double().cpu()], y.double().cpu())
    zero = torch.zeros(x.shape, dtype=torch.float64).requires_grad_()
    zero[tok].backward(y.double().abs().cpu())  # sum_j |g| per token
    checks["dx"] = (gx, gx64, (k * U32 + u) * zero.grad + tiny)
    assert torch.equal(xp.cpu(), x.cpu()[order.cpu() // k])
    for name, (got, ref, bound) in checks.items():
        assert got.dtype == (torch.float32 if name == "dw" else dtype), (name, got.dtype)
        err = (got.double().cpu() - ref).abs()
        assert bool((err <= bound).all()), f"{name}: |error| {(err - bound).max().item():.3g} over the bound"


def _dw_mag(y, order, dy, T, k):
    slots = torch.zeros(T * k, y.shape[1], dtype=torch.float64).index_copy(0, order.cpu(), y.double().abs().cpu())
    return (slots.view(T, k, -1) * dy.double().abs().cpu()[:, None, :]).sum(-1)


CASES = [(37, 1, 45, 0), (37, 2, 45, 0), (23, 3, 70, 0), (23, 3, 70, 11)]  # (T, k, H, dropped slots)


@in_main
@pytest.mark.parametrize("T, k, H, drop", CASES)
def test_torch_path_equals_the_composition_bitwise(monkeypatch, T, k, H, drop):
    monkeypatch.delenv("LLMPAR_BACKEND", raising=False)
    x, y, order, w, dy = _case(T, k, H, torch.float32, drop=drop, seed=T + k)
    got = _grads(lambda y_, w_: unpermute_rows(y_, order, w_, T), [y, w], dy)
    want = _grads(lambda y_, w_: _composition(y_, order, w_, T, torch.float32), [y, w], dy)
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert torch.equal(a, b), (a - b).abs().max()
    _check_vs_float64(x, y, order, w, dy)


@in_main
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_torch_path_16bit_vs_float64(dtype):
    _check_vs_float64(*_case(23, 3, 70, dtype, drop=5, seed=3))


@in_main
def test_bad_inputs_name_the_argument():
    x, y, order, w, _ = _case(5, 2, 7, torch.float32)
    with pytest.raises(TypeError, match="order must be a 1-D int64 tensor"):
        permute_rows(x, order.int(), 2)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        permute_rows(x, order, 0)
    with pytest.raises(ValueError, match=r"weights must be \[num_tokens=6, k\]"):
        unpermute_rows(y, order, w, 6)
    with pytest.raises(ValueError, match="order has 10 slots for 9 rows"):
        unpermute_rows(y[:9], order, w, 5)


@in_main
def test_triton_kernels_under_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, timeout=300, select="interp", what="interpreted MoE permutation kernels")


@interpreted
@pytest.mark.parametrize(
    "dtype, T, k, H, drop",
    [(torch.bfloat16, 17, 3, 40, 9), (torch.float32, 13, 2, 33, 0)],  # dropped slots; dropless (2 column blocks)
    ids=["bf16-dropped", "fp32-dropless"],
)
def test_interp_kernels_vs_float64(monkeypatch, dtype, T, k, H, drop):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    _check_vs_float64(*_case(T, k, H, dtype, drop=drop, seed=T * k), truncates=True)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_vs_float64(monkeypatch, dtype, backend):
    monkeypatch.setenv("LLMPAR_BACKEND", backend)
    _check_vs_float64(*_case(1000, 8, 1031, dtype, drop=300, seed=4, device="cuda"))


@in_main
def test_kernels_compile_for_sm80_and_sm90(monkeypatch):
    """Both kernels as a launch specialises them (tests/triton_aot.py), compiled for A100 and H100, no GPU needed."""
    pytest.importorskip("triton")
    from triton_aot import Recorder, compile_like_launcher

    from llmpar.kernels import moe_permute as kernels

    if kernels.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreted in this process")
    x, y, order, w, dy = _case(23, 3, 1031, torch.bfloat16, drop=5)
    launches = []
    for name, launch in (
        ("_gather_sum_kernel", lambda: kernels.gather_sum(y, order, w.view(-1), dy, 3)),
        ("_unpermute_bwd_kernel", lambda: kernels.unpermute_backward(dy, y, order, w.view(-1), y, w.view(-1), 3)),
    ):
        real, rec = getattr(kernels, name), Recorder()
        monkeypatch.setattr(kernels, name, rec)
        launch()
        monkeypatch.undo()
        launches.append((real, *rec.calls[0]))
    for arch in (80, 90):
        for kernel, args, kw in launches:
            compiled = compile_like_launcher(kernel, args, kw, arch=arch)
            assert compiled.metadata.shared <= 48 * 1024, (arch, kernel)
