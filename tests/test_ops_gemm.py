"""linear_act (llmpar.ops.gemm): y = act(x @ W^T + b) (+ residual), forward and backward, vs float64 and torch.

The torch path is checked in-process. The Triton kernel (llmpar.kernels.gemm) runs under TRITON_INTERPRET=1 in a
subprocess, as in test_ops_triton.py: triton.jit picks its interpreter when a kernel is decorated, so the variable
must be set before llmpar.kernels is imported, and setting it in the main pytest process would slow every other op.
Error bound (DESIGN habit 6): the fused kernel's error vs float64 is at most 2x the error of the unfused torch
composition in the same dtype (plus one output rounding as a floor).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmpar.ops import linear_act, linear_act_backward, linear_act_rows
from llmpar.ops.gemm import ACTIVATIONS, _act_torch

from gemm_helpers import DTYPES, INTERPRET, _assert_within, _check_op, _grads, _inputs, _rand
from interp import run_interpreted

# ---------------------------------------------------------------- torch path (CPU, in-process)


@pytest.mark.skipif(INTERPRET, reason="torch-path tests run in the main process")
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_torch_path_is_the_composition(monkeypatch, act):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    x, w, b, r, dy = _inputs(5, 33, 23, torch.float32)
    _check_op(x, w, b, r, dy, act)
    y = linear_act(x.reshape(1, 5, 33), w, act=act)  # leading dims and no bias
    torch.testing.assert_close(y, _act_torch(x @ w.t(), act).reshape(1, 5, 23), rtol=0, atol=0)


@pytest.mark.skipif(INTERPRET, reason="torch-path tests run in the main process")
def test_torch_path_main_grad_rows_and_backward(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    x, w, b, r, dy = _inputs(7, 33, 23, torch.bfloat16)
    main = _rand((23, 33), torch.float32, torch.Generator().manual_seed(3))
    start = main.clone()
    wl = w.clone().requires_grad_()
    y = linear_act(x, wl, b, act="gelu_tanh", main_grad=main)
    y.backward(dy)
    assert wl.grad is None
    x64 = x.double()
    pre = F.linear(x, w, b)
    gp = torch.ops.aten.gelu_backward(dy, pre, approximate="tanh")
    torch.testing.assert_close(main.double() - start.double(), gp.double().t() @ x64, rtol=1e-5, atol=1e-5)
    out = torch.empty(7, 23, dtype=torch.bfloat16)
    pre_out = torch.empty(7, 23, dtype=torch.bfloat16)
    for a, e in ((0, 3), (3, 3), (3, 7)):
        linear_act_rows(x, w, b, out=out, start=a, end=e, act="gelu_tanh", pre_out=pre_out)
    torch.testing.assert_close(out, linear_act(x, w, b, act="gelu_tanh"), rtol=0, atol=0)
    dx, dw, db = linear_act_backward(dy, x, w, pre_out, act="gelu_tanh", has_bias=True)
    _, (gx, gw, gb) = _grads(lambda xx, ww, bb: linear_act(xx, ww, bb, act="gelu_tanh"), [x, w, b], dy)
    torch.testing.assert_close(dx, gx)
    torch.testing.assert_close(dw, gw)
    torch.testing.assert_close(db, gb)


@pytest.mark.skipif(INTERPRET, reason="torch-path tests run in the main process")
def test_bad_arguments_name_themselves():
    x, w, b, r, _ = _inputs(5, 33, 23, torch.float32)
    with pytest.raises(ValueError, match="act='gelu2' is not an activation"):
        linear_act(x, w, act="gelu2")
    with pytest.raises(TypeError, match="must share one floating dtype"):
        linear_act(x, w.half())
    with pytest.raises(ValueError, match="wants a last dim of 33"):
        linear_act(x[:, :32], w)
    with pytest.raises(ValueError, match="bias has shape"):
        linear_act(x, w, b[:5])
    with pytest.raises(ValueError, match="residual has shape"):
        linear_act(x, w, residual=r[:, :5])
    with pytest.raises(ValueError, match="main_grad must be float32"):
        linear_act(x, w, main_grad=torch.zeros(23, 33, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out_dtype must be"):
        linear_act(x, w, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"rows \[4, 9\) are not a range"):
        linear_act_rows(x, w, out=torch.empty(5, 23), start=4, end=9)
    with pytest.raises(ValueError, match="needs the pre-activation"):
        linear_act_backward(torch.ones(5, 23), x, w, None, act="silu")


# ---------------------------------------------------------------- Triton kernel under the interpreter


@pytest.mark.skipif(INTERPRET, reason="already under TRITON_INTERPRET=1: the tests below run in-process")
def test_triton_gemm_under_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, timeout=300)


interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")


@interpreted
def test_dispatch_picks_triton():
    from llmpar.kernels import gemm

    assert gemm.INTERPRETED and gemm.HAS_TRITON
    assert gemm.ACTS == {a: i for i, a in enumerate(ACTIVATIONS)}


@interpreted
@pytest.mark.parametrize("m, k, n", [(5, 33, 23), (5, 127, 123)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_triton_forward_backward_vs_float64(monkeypatch, act, dtype, m, k, n):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    x, w, b, r, dy = _inputs(m, k, n, dtype, seed=k + n)
    _check_op(x, w, b, None, dy, act) if k == 127 else _check_op(x, w, b, r, dy, act)


@interpreted
@pytest.mark.parametrize("act", ["none", "gelu_erf"])
def test_triton_out_dtype_residual_dtype_and_strides(monkeypatch, act):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    x, w, b, r, dy = _inputs(9, 40, 21, torch.bfloat16, seed=5, res_dtype=torch.float32)
    _check_op(x, w, b, r, dy, act, out_dtype=torch.float32)
    xt = x.t().contiguous().t()  # column-major x: the kernel takes strides
    assert not xt.is_contiguous()
    torch.testing.assert_close(linear_act(xt, w, b, act=act), linear_act(x, w, b, act=act), rtol=0, atol=0)


@interpreted
def test_triton_main_grad_accumulates(monkeypatch):
    x, w, b, _, dy = _inputs(6, 33, 23, torch.bfloat16, seed=11)
    init = _rand((23, 33), torch.float32, torch.Generator().manual_seed(4))
    mains = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("LLMPAR_BACKEND", backend)
        main = init.clone()
        for _ in range(2):
            wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
            linear_act(x, wl, bl, act="silu", main_grad=main).backward(dy)
            assert wl.grad is None and bl.grad is not None
        mains[backend] = main
    ref = init.double() + 2 * (torch.ops.aten.silu_backward(dy.double(), F.linear(x, w, b).double()).t() @ x.double())
    _assert_within(mains["triton"], ref, mains["torch"], torch.bfloat16, "main_grad")
    torch.testing.assert_close(mains["triton"], mains["torch"], rtol=2e-2, atol=2e-2)


@interpreted
@pytest.mark.parametrize("act", ["relu", "gelu_tanh"])
def test_triton_rows_equal_full_call_and_backward(monkeypatch, act):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    x, w, b, r, dy = _inputs(21, 33, 23, torch.float16, seed=7)
    full = linear_act(x, w, b, act=act, residual=r)
    out = torch.full((21, 23), 7.0, dtype=torch.float16)
    pre = torch.empty(21, 23, dtype=torch.float16)
    for a, e in ((0, 5), (5, 5), (5, 18), (18, 21)):
        got = linear_act_rows(x, w, b, out=out, start=a, end=e, act=act, residual=r, pre_out=pre)
        assert got.shape == (e - a, 23)
    torch.testing.assert_close(out, full, rtol=0, atol=0)
    torch.testing.assert_close(pre, F.linear(x.float(), w.float(), b.float()).half(), rtol=1e-3, atol=1e-3)
    dx, dw, db = linear_act_backward(dy, x, w, pre, act=act, has_bias=True)
    _, (gx, gw, gb, _) = _grads(lambda *t: linear_act(*t[:3], act=act, residual=t[3]), [x, w, b, r], dy)
    for got, want in ((dx, gx), (dw, gw), (db, gb)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@interpreted
def test_forced_triton_rejects_float64(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    x, w, *_ = _inputs(5, 33, 23, torch.float64)
    with pytest.raises(TypeError, match="cannot use the triton kernel: x dtype torch.float64"):
        linear_act(x, w)
    monkeypatch.setenv("LLMPAR_BACKEND", "")
    assert linear_act(x, w).dtype == torch.float64
