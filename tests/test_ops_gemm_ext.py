"""linear_act's CUDA-extension path: dispatch to llmpar::linear_lt / linear_lt_aux / bias_act_backward (faked
CUDA availability; the ops' CPU references from llmpar/ops/_library.py run on CPU), the bias-activation backward's math
vs float64, and the GPU tests run by bench/gpu_check.sh (pytest -m gpu)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from llmpar.ops import _dispatch, gemm_backends, linear_act, linear_act_backward, linear_act_rows
from llmpar.ops.gemm import ACTIVATIONS, bias_act_backward_reference, select_backward_backend, select_forward_backend
from llmpar.ops.gemm_reference import act_grad_torch, act_torch

from gemm_helpers import DTYPES, INTERPRET, _assert_within, _check_op, _composition, _err, _grads, _inputs, _rand

# ---------------------------------------------------------------- CUDA-extension dispatch and wiring (CPU)

EXT_OPS = frozenset({"linear_lt", "linear_lt_aux", "bias_act_backward"})
in_main = pytest.mark.skipif(INTERPRET, reason="runs in the main process")


def _fake_ext(monkeypatch, registered):
    """Pretend the CUDA extension is loaded with exactly these ops (device checks skipped) and Triton can run."""

    def cuda_reason(device, *, build=True, op=None, ops=()):
        missing = [name for name in ((op,) if op else ()) + tuple(ops) if name not in registered]
        return f"llmpar._C has no op llmpar::{missing[0]}" if missing else None

    monkeypatch.setattr(_dispatch, "cuda_unavailable_reason", cuda_reason)
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda device: None)


@in_main
def test_dispatch_picks_linear_lt_only_when_registered_and_eligible(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "")
    x, w, _, r, dy = _inputs(5, 33, 23, torch.bfloat16)
    no_aux, no_bwd = EXT_OPS - {"linear_lt_aux"}, EXT_OPS - {"bias_act_backward"}
    cases = [
        (EXT_OPS, "none", r, None, "cuda"),
        (EXT_OPS, "gelu_tanh", None, None, "cuda"),
        (EXT_OPS, "relu", None, None, "cuda"),
        (EXT_OPS, "silu", None, None, "triton"),
        (EXT_OPS, "gelu_erf", None, None, "triton"),
        (EXT_OPS, "relu", r, None, "triton"),
        (EXT_OPS, "none", None, torch.float32, "triton"),
        (EXT_OPS, "none", r.float(), None, "triton"),
        (no_aux, "gelu_tanh", None, None, "triton"),
        (no_aux, "relu", None, None, "cuda"),
        (no_bwd, "none", None, None, "triton"),
        (set(), "none", None, None, "triton"),
    ]
    for registered, act, res, out_dtype, want in cases:
        _fake_ext(monkeypatch, registered)
        got = select_forward_backend(x, w, act, res, out_dtype)
        assert got == want, (sorted(registered), act, res is not None, out_dtype, got)
        assert select_backward_backend(dy, x) == ("cuda" if "bias_act_backward" in registered else "triton")
    _fake_ext(monkeypatch, EXT_OPS)
    assert select_forward_backend(x.double(), w.double()) == "torch"
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    with pytest.raises(TypeError, match="cannot use the cuda kernel: act='silu' has no cuBLASLt epilogue"):
        linear_act(x, w, act="silu")
    _fake_ext(monkeypatch, no_aux)
    with pytest.raises(RuntimeError, match="cuda backend cannot run linear_act: .*no op llmpar::linear_lt_aux"):
        linear_act(x, w, act="gelu_tanh")


def test_cuda_reason_names_the_missing_op(monkeypatch):
    from llmpar.ops import _ext

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_ext, "load", lambda build=True: _ext.ExtStatus(available=True, source="jit", reason="ok"))
    monkeypatch.setattr(_dispatch, "has_ext_op", lambda name: name == "linear_lt")
    cuda = torch.device("cuda")
    assert _dispatch.cuda_unavailable_reason(cuda, ops=("linear_lt",)) is None
    assert "no op llmpar::bias_act_backward" in _dispatch.cuda_unavailable_reason(
        cuda, ops=("linear_lt", "bias_act_backward")
    )


@in_main
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_cuda_path_wiring_with_reference_ops(monkeypatch, dtype):
    """The CUDA backend's Python side (forward/aux/backward, rows, main_grad, the dX hook) through the real
    torch.ops.llmpar ops, which run their registered plain-torch references on CPU tensors."""
    calls = {}

    def counted(name, fn):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)

        return call

    ops = type("Ops", (), {name: staticmethod(counted(name, getattr(torch.ops.llmpar, name))) for name in EXT_OPS})
    monkeypatch.setattr(gemm_backends, "_ext_ops", lambda: ops)
    _fake_ext(monkeypatch, EXT_OPS)
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    x, w, b, r, dy = _inputs(7, 33, 23, dtype, seed=21)
    for act, res in (("none", r), ("none", None), ("gelu_tanh", None), ("relu", None)):
        _check_op(x, w, b, res, dy, act)
    assert calls.get("linear_lt", 0) >= 3 and calls.get("linear_lt_aux", 0) >= 1, calls
    assert calls.get("bias_act_backward", 0) >= 2, calls
    out, pre = torch.empty(7, 23, dtype=dtype), torch.empty(7, 23, dtype=dtype)
    for a, e in ((0, 3), (3, 3), (3, 7)):
        linear_act_rows(x, w, b, out=out, start=a, end=e, act="gelu_tanh", pre_out=pre)
    torch.testing.assert_close(out, linear_act(x, w, b, act="gelu_tanh"))  # CPU matmuls block rows differently
    plain = torch.empty(7, 23, dtype=dtype)
    for a, e in ((0, 4), (4, 7)):
        linear_act_rows(x, w, out=plain, start=a, end=e)  # plain GEMM straight into the rows
    torch.testing.assert_close(plain, x @ w.t())
    main = _rand((23, 33), torch.float32, torch.Generator().manual_seed(2))
    start, seen = main.clone(), []
    dx, dw, db = linear_act_backward(
        dy,
        x,
        w,
        pre,
        act="gelu_tanh",
        has_bias=True,
        main_grad=main,
        on_grad_input=lambda g: seen.append(torch.equal(main, start)),
    )
    assert seen == [True] and dw is None, "dX's hook must run before dW is accumulated"
    _, (gx, gw, gb) = _grads(lambda *t: _composition(*t, None, "gelu_tanh", dtype), [x, w, b], dy)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for got, want in ((dx, gx), (main - start, gw.float()), (db, gb)):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@in_main
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act_backward_reference_vs_float64(act, dtype):
    """The math of llmpar::bias_act_backward (what csrc/bias_act_kernels.cu computes) vs float64 autograd."""
    g = torch.Generator().manual_seed(len(act))
    grad, pre = _rand((37, 19), dtype, g), _rand((37, 19), dtype, g, 2.0)
    z = pre.double().requires_grad_()
    act_torch(z, act).backward(grad.double())
    gp, db = bias_act_backward_reference(grad, pre, ACTIVATIONS.index(act))
    assert gp.dtype == dtype and db.dtype == torch.float32 and db.shape == (19,)
    _assert_within(gp, z.grad, act_grad_torch(grad, pre, act), dtype, f"dY' ({act})")
    exact = (grad.double() * (z.grad / grad.double())).sum(0)  # the sum of unrounded dY * act'(z)
    torch.testing.assert_close(db.double(), exact, rtol=1e-5, atol=1e-5 * z.grad.abs().sum(0).max().item())
    if act == "relu":  # relu(z) serves as pre: same sign
        torch.testing.assert_close(bias_act_backward_reference(grad, F.relu(pre), 4)[0], gp, rtol=0, atol=0)


@in_main
def test_no_pre_activation_written_without_a_backward(monkeypatch):
    """linear_act under no_grad (or with nothing requiring grad): the Triton kernel gets no pre buffer and the CUDA
    path calls linear_lt (GELU epilogue alone) instead of linear_lt_aux; with a backward to come, both keep pre."""
    pytest.importorskip("triton")
    from llmpar.kernels import gemm as K

    seen, calls = [], []

    def linear_fwd(x, w, bias, residual, out, pre, act, *, allow_tf32=False):
        seen.append(pre is not None)
        z = F.linear(x, w, bias)
        out.copy_(act_torch(z, ACTIVATIONS[act]) + (residual if residual is not None else 0))
        if pre is not None:
            pre.copy_(z)

    ops = type(
        "Ops",
        (),
        {n: staticmethod(lambda *a, n=n: calls.append(n) or getattr(torch.ops.llmpar, n)(*a)) for n in EXT_OPS},
    )
    monkeypatch.setattr(K, "linear_fwd", linear_fwd)
    monkeypatch.setattr(gemm_backends, "_ext_ops", lambda: ops)
    _fake_ext(monkeypatch, EXT_OPS)
    x, w, b, _, dy = _inputs(9, 37, 23, torch.float32, seed=8)
    for backend in ("triton", "cuda"):
        monkeypatch.setenv("LLMPAR_BACKEND", backend)
        want = F.gelu(F.linear(x, w, b), approximate="tanh")
        with torch.no_grad():
            torch.testing.assert_close(linear_act(x, w, b, act="gelu_tanh"), want)
        torch.testing.assert_close(linear_act(x, w, b, act="gelu_tanh"), want)  # nothing requires grad
        xg = x.clone().requires_grad_()
        y = linear_act(xg, w, b, act="gelu_tanh")
        if backend == "cuda":  # (the Triton backward kernels cannot run here)
            y.backward(dy)
            torch.testing.assert_close(
                xg.grad,
                _grads(lambda *t: _composition(*t, None, "gelu_tanh", torch.float32), [x, w, b], dy)[1][0],
                rtol=1e-5,
                atol=1e-5,
            )
    assert seen == [False, False, True], seen
    assert calls == ["linear_lt", "linear_lt", "linear_lt_aux", "bias_act_backward"], calls


def test_one_autotune_config_launches_without_the_autotuner(monkeypatch):
    """LLMPAR_AUTOTUNE_CONFIGS=1: the GEMM kernel is launched straight with the first config that fits (Triton's
    autotuner would still benchmark the one config its pruning leaves); 2: through the autotuner."""
    pytest.importorskip("triton")
    from llmpar.kernels import gemm as K
    from llmpar.kernels.gemm_configs import HOPPER_CONFIGS, fitting

    launches, tuned = [], []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    monkeypatch.setattr(K, "_gemm_kernel", Kernel())
    monkeypatch.setattr(K, "_tuned_kernel", lambda family, role: tuned.append((family, role)) or Kernel())
    monkeypatch.setattr(K, "_arch_family", lambda device: "hopper")
    monkeypatch.setattr(K, "smem_limit", lambda device: 232448)
    g = torch.Generator().manual_seed(4)
    dy, x, dw = _rand((300, 77), torch.float32, g), _rand((300, 45), torch.float32, g), torch.empty(77, 45)
    args = (dy, x, dw, dy, dw, dw, dw, dw, 77, 45, 300)
    flags = dict(
        ACT=0,
        GATE_ACT=1,
        HAS_BIAS=False,
        HAS_RES=False,
        SAVE_PRE=False,
        ROWSUM=True,
        ACCUMULATE=False,
        IEEE=True,
        INTERPRETER=False,
    )
    monkeypatch.setenv("LLMPAR_AUTOTUNE_CONFIGS", "1")
    K._launch_compiled("wgrad", args, flags, 77, 45)
    bm, bn, bk, group, stages, warps = fitting(HOPPER_CONFIGS, 232448, 4, 4, 4, gate=True, rowsum=True)[0]
    assert bm == 128 and bk == 32, "fp32 with the gated operand: the smaller tile that fits, not the table's first"
    assert not tuned and launches == [
        (
            (-(-77 // bm) * -(-45 // bn),),
            {
                **flags,
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "GROUP_M": group,
                "num_stages": stages,
                "num_warps": warps,
            },
        )
    ]
    monkeypatch.setenv("LLMPAR_AUTOTUNE_CONFIGS", "2")
    K._launch_compiled("wgrad", args, flags, 77, 45)
    assert tuned == [("hopper", "wgrad")] and len(launches) == 2


# ---------------------------------------------------------------- cuBLASLt's GELU epilogue: reference and bound

# The reference of CUBLASLT_EPILOGUE_GELU(_AUX) is tanh-GELU, gelu(z, approximate="tanh"): cuBLASLt's documentation
# says only "GELU", and PyTorch, which routes F.gelu(approximate="tanh") after a linear to this epilogue, applies
# gelu_(..., "tanh") itself where the epilogue is not available (aten/src/ATen/native/cuda/Blas.cpp). How the epilogue
# evaluates tanh is not documented: with the hardware approximation (PTX tanh.approx.f32, relative error <= 2^-10.987)
# |dy| <= 0.5 |z| |dt| <= 0.5 |z| 2^-10.9, far above one float32 rounding. So a GELU epilogue's output passes when
# within the usual bound (2x the unfused error + one rounding), or within it after that allowance per element and
# closer (L2) to tanh-GELU than to exact (erf) GELU: the allowance is as large as their difference, but an
# approximation's errors do not follow that difference's pattern. The second case warns with the size of the error,
# so the GPU run's log says which one the epilogue is.
TANH_APPROX_REL = 2.0**-10.9


def _assert_gelu_epilogue(got, ref, unfused, dtype, what, z64):
    """``_assert_within`` for a GELU epilogue's output ``got`` of ``ref`` = tanh-GELU(z64), with the
    tanh-approximation allowance (see above)."""
    floor = torch.finfo(dtype).eps * ref.abs().max().item()
    bound = 2 * _err(unfused, ref) + floor
    err = (got.double() - ref).abs()
    if err.max().item() <= bound:
        return
    to_tanh, to_erf = err.norm().item(), (got.double() - F.gelu(z64)).norm().item()
    assert to_tanh < to_erf, f"{what}: closer to exact (erf) GELU ({to_erf:.3g}) than to tanh-GELU ({to_tanh:.3g})"
    excess = (err - 0.5 * z64.abs() * TANH_APPROX_REL).max().item()
    assert excess <= bound, (
        f"{what}: GELU epilogue error {err.max().item():.3g} beyond tanh.approx's allowance "
        f"by {excess:.3g} (bound {bound:.3g}, {dtype})"
    )
    warnings.warn(
        f"{what}: cuBLASLt's GELU epilogue is {err.max().item():.3g} off tanh-GELU ({dtype} bound "
        f"{bound:.3g}): it evaluates tanh approximately (within tanh.approx.f32's 2^-10.9)",
        stacklevel=2,
    )


def _check_op_gelu_epilogue(monkeypatch, x, w, b, r, dy, act, *, views: bool = False):
    """``_check_op`` where y may come from cuBLASLt's GELU epilogue (LLMPAR_BACKEND=cuda): y of act gelu_tanh is
    checked with ``_assert_gelu_epilogue``; everything else as ``_check_op`` does (``monkeypatch``: a context the
    caller closes right after)."""
    import gemm_helpers

    if act == "gelu_tanh":
        z64 = F.linear(x.double(), w.double(), b.double() if b is not None else None)
        plain = gemm_helpers._assert_within

        def within(got, ref, unfused, dtype, what):
            if what == "y (gelu_tanh)":
                return _assert_gelu_epilogue(got, ref, unfused, dtype, what, z64)
            return plain(got, ref, unfused, dtype, what)

        monkeypatch.setattr(gemm_helpers, "_assert_within", within)
    _check_op(x, w, b, r, dy, act, views=views)


def test_gelu_epilogue_bound_takes_tanh_approx_and_no_more():
    """The bound passes an exact result silently, a tanh.approx-sized error with a warning, and fails exact GELU
    (erf) in place of tanh-GELU (the allowance does not swallow the wrong function) and errors past the allowance."""
    g = torch.Generator().manual_seed(11)
    z = _rand((37, 123), torch.float64, g, 3.0)
    ref = F.gelu(z, approximate="tanh")
    unfused = ref.float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_gelu_epilogue(ref.float(), ref, unfused, torch.float32, "exact", z)
    u = 0.7978845608028654 * (z + 0.044715 * z**3)
    t_approx = torch.tanh(u) * (
        1 + TANH_APPROX_REL * 0.9 * torch.sign(torch.randn(z.shape, generator=g, dtype=torch.float64))
    )
    approx = (0.5 * z * (1 + t_approx)).float()
    with pytest.warns(UserWarning, match="evaluates tanh approximately"):
        _assert_gelu_epilogue(approx, ref, unfused, torch.float32, "approx", z)
    with pytest.raises(AssertionError, match="closer to exact"):
        _assert_gelu_epilogue(F.gelu(z).float(), ref, unfused, torch.float32, "erf", z)
    with pytest.raises(AssertionError, match="beyond tanh.approx's allowance"):
        _assert_gelu_epilogue((ref + 4 * TANH_APPROX_REL * z.abs()).float(), ref, unfused, torch.float32, "far", z)


# ---------------------------------------------------------------- CUDA (run by bench/gpu_check.sh: pytest -m gpu)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA tests run in the main process")
@pytest.mark.parametrize("m, k, n", [(5, 4097, 123), (257, 1024, 4097)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_triton_cuda_vs_float64(monkeypatch, act, dtype, m, k, n):
    pytest.importorskip("triton")
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    x, w, b, r, dy = (t.cuda() for t in _inputs(m, k, n, dtype, seed=m + k))
    _check_op(x, w, b, r, dy, act)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA tests run in the main process")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "act, with_bias, with_res",
    [(0, True, True), (0, False, False), (1, True, False), (1, False, False), (4, True, False)],
)
def test_cublaslt_linear_lt_vs_float64(dtype, act, with_bias, with_res):
    from llmpar.ops import _ext

    if not _ext.load().available or not _dispatch.has_ext_op("linear_lt"):
        pytest.skip("llmpar._C has no linear_lt (cublasLt.h not found at build time?)")
    name = {0: "none", 1: "gelu_tanh", 4: "relu"}[act]
    x, w, b, r, _ = (t.cuda() for t in _inputs(5, 4097, 123, dtype, seed=act))
    b, r = (b if with_bias else None), (r if with_res else None)
    got = torch.ops.llmpar.linear_lt(x, w, b, act, r)
    ref = _composition(
        x.double(),
        w.double(),
        b.double() if b is not None else None,
        r.double() if r is not None else None,
        name,
        torch.float64,
    )
    unfused = _composition(x, w, b, r, name, dtype)
    if name == "gelu_tanh":
        z64 = F.linear(x.double(), w.double(), b.double() if b is not None else None)
        _assert_gelu_epilogue(got, ref, unfused, dtype, f"linear_lt act={act}", z64)
    else:
        _assert_within(got, ref, unfused, dtype, f"linear_lt act={act}")


def _require_ext_ops(*names):
    from llmpar.ops import _ext

    if not torch.cuda.is_available() or not _ext.load().available:
        pytest.skip("no CUDA device or llmpar._C unavailable")
    missing = [n for n in names if not _dispatch.has_ext_op(n)]
    if missing:
        pytest.skip(f"llmpar._C lacks {missing} (cublasLt.h not found at build time?)")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA tests run in the main process")
@pytest.mark.parametrize(
    "grad_dtype, pre_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_cuda_bias_act_backward_vs_reference(act, grad_dtype, pre_dtype):
    _require_ext_ops("bias_act_backward")
    g = torch.Generator().manual_seed(7)
    for m, n in ((5, 123), (4097, 37), (1, 1)):
        grad, pre = _rand((m, n), grad_dtype, g).cuda(), _rand((m, n), pre_dtype, g, 2.0).cuda()
        code = ACTIVATIONS.index(act)
        gp, db = torch.ops.llmpar.bias_act_backward(grad, pre, code)
        want_gp, want_db = bias_act_backward_reference(grad, pre, code)
        assert gp.dtype == pre_dtype and db.dtype == torch.float32
        torch.testing.assert_close(gp, want_gp, atol=1e-5, rtol=torch.finfo(pre_dtype).eps)  # <= 1 rounding apart
        torch.testing.assert_close(db, want_db, rtol=1e-5, atol=1e-5 * want_db.abs().max().item())
    strided = _rand((9, 80), grad_dtype, g).cuda()[:, 3:40]  # rows with a stride of 80: a column slice
    pre = _rand((9, 37), pre_dtype, g, 2.0).cuda()
    for got, want in zip(
        torch.ops.llmpar.bias_act_backward(strided, pre, code), bias_act_backward_reference(strided, pre, code)
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=torch.finfo(pre_dtype).eps)
    torch.library.opcheck(torch.ops.llmpar.bias_act_backward.default, (strided, pre, code))  # this block's pair


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA tests run in the main process")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act, res", [("none", True), ("gelu_tanh", False), ("relu", False)])
def test_cuda_backend_linear_act_vs_float64(monkeypatch, dtype, act, res):
    """LLMPAR_BACKEND=cuda: linear_lt / linear_lt_aux forward, bias_act_backward + cuBLAS backward."""
    _require_ext_ops("linear_lt", "linear_lt_aux", "bias_act_backward")
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    x, w, b, r, dy = (t.cuda() for t in _inputs(5, 4097, 123, dtype, seed=3))
    with pytest.MonkeyPatch.context() as mp:
        _check_op_gelu_epilogue(mp, x, w, b, r if res else None, dy, act)
    y, pre = torch.ops.llmpar.linear_lt_aux(x, w, b)
    z64 = F.linear(x.double(), w.double(), b.double())
    _assert_within(pre, z64, F.linear(x, w, b), dtype, "linear_lt_aux pre")


def _views(shapes, dtype, offset, seed):
    """Tensors of ``shapes`` as consecutive views into one flat buffer, starting ``offset`` elements in: pointers
    2 to 32 bytes past an allocation, as ZeRO's flat buffers and row slices hand them to the ops."""
    g = torch.Generator().manual_seed(seed)
    total = sum(torch.Size(s).numel() for s in shapes)
    flat = _rand((offset + total,), dtype, g).cuda()
    out, at = [], offset
    for s in shapes:
        n = torch.Size(s).numel()
        out.append(flat[at : at + n].view(s))
        at += n
    return out


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA tests run in the main process")
@pytest.mark.parametrize("offset", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cublaslt_on_offset_views(dtype, offset):
    """cuBLASLt is told each pointer's real alignment (or falls back): right results on misaligned views."""
    _require_ext_ops("linear_lt", "linear_lt_aux")
    m, k, n = 37, 1024, 123
    x, w, b, r = _views([(m, k), (n, k), (n,), (m, n)], dtype, offset, seed=offset)
    z64 = F.linear(x.double(), w.double(), b.double())
    for act, res in ((0, r), (1, None), (4, None), (0, None)):
        name = ACTIVATIONS[act]
        got = torch.ops.llmpar.linear_lt(x, w, b, act, res)
        ref = _composition(
            x.double(), w.double(), b.double(), res.double() if res is not None else None, name, torch.float64
        )
        check = (lambda *a: _assert_gelu_epilogue(*a, z64)) if name == "gelu_tanh" else _assert_within
        check(got, ref, _composition(x, w, b, res, name, dtype), dtype, f"linear_lt act={act} +{offset}")
    y, pre = torch.ops.llmpar.linear_lt_aux(x, w, b)
    _assert_within(pre, z64, F.linear(x, w, b), dtype, f"linear_lt_aux pre +{offset}")
    _assert_gelu_epilogue(
        y,
        F.gelu(z64, approximate="tanh"),
        F.gelu(F.linear(x, w, b), approximate="tanh"),
        dtype,
        f"linear_lt_aux y +{offset}",
        z64,
    )


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA tests run in the main process")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_act_on_offset_views(monkeypatch, backend, dtype):
    """The whole op (forward and backward) on misaligned views of one buffer, per backend."""
    if backend == "cuda":
        _require_ext_ops("linear_lt", "linear_lt_aux", "bias_act_backward")
    else:
        pytest.importorskip("triton")
    monkeypatch.setenv("LLMPAR_BACKEND", backend)
    x, w, b, r, dy = _views([(45, 256), (77, 256), (77,), (45, 77), (45, 77)], dtype, 3, seed=1)
    import gemm_helpers

    seen, op = [], gemm_helpers.linear_act
    monkeypatch.setattr(
        gemm_helpers,
        "linear_act",
        lambda xx, ww, bb, **kw: seen.append((xx.data_ptr(), ww.data_ptr(), bb.data_ptr())) or op(xx, ww, bb, **kw),
    )
    with pytest.MonkeyPatch.context() as mp:
        _check_op_gelu_epilogue(mp, x, w, b, None, dy, "gelu_tanh", views=True)
    _check_op(x, w, b, r, dy, "none", views=True)
    want = (x.data_ptr(), w.data_ptr(), b.data_ptr())
    assert seen == [want, want] and all(p % 16 for p in want), "the op must get the misaligned views themselves"


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA tests run in the main process")
def test_fp32_linear_act_routes_to_cublas_without_tf32(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "")
    x, w = torch.randn(64, 128, device="cuda"), torch.randn(32, 128, device="cuda")
    monkeypatch.setattr(gemm_backends, "tf32_allowed", lambda: False)
    assert select_forward_backend(x, w, "silu") == "torch"
    assert select_backward_backend(torch.randn(64, 32, device="cuda"), x) in ("cuda", "torch")
    monkeypatch.setattr(gemm_backends, "tf32_allowed", lambda: True)
    assert select_forward_backend(x, w, "silu") == "triton" or _dispatch.triton_unavailable_reason(x.device)


@pytest.mark.skipif(INTERPRET, reason="build-config checks run in the main process")
def test_cublaslt_source_is_optional(monkeypatch):
    import importlib.util
    from pathlib import Path

    csrc = Path(__file__).resolve().parents[1] / "csrc"
    spec = importlib.util.spec_from_file_location("llmpar_build_config_gemm", csrc / "build_config.py")
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)
    monkeypatch.setenv("LLMPAR_NO_CUBLASLT", "1")
    kw = cfg.extension_kwargs(csrc)
    assert not any(s.endswith("gemm_lt.cpp") for s in kw["sources"])
    assert "-idirafter" not in kw["extra_compile_args"]["cxx"]
    monkeypatch.delenv("LLMPAR_NO_CUBLASLT")
    found = cfg.cublaslt_include_dir()
    kw = cfg.extension_kwargs(csrc)
    assert any(s.endswith("gemm_lt.cpp") for s in kw["sources"]) == (found is not None)
    assert "TORCH_LIBRARY_IMPL(llmpar, CUDA, m)" in (csrc / "gemm_lt.cpp").read_text()
