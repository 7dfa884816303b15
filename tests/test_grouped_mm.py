"""llmpar.ops.grouped_mm: the grouped GEMM of the MoE experts (llmpar::grouped_mm and its backward ops).

Checked against float64 on random data with odd shapes (groups of 0, 1, 37 and 128 rows, K and N not multiples of
any block), forward and both gradients, with the elementwise bounds of tests/grouped_mm_helpers.py (they count the
roundings of each path: the fused Triton epilogue rounds once, the unfused paths three times):
  - the torch path (the CPU default): also equal bitwise to ``F.linear`` per expert under autograd, for packed
    ([E, N, K] viewed as [E, K, N]) and plain [E, K, N] weights; empty groups, one group taking every row, zero rows,
    non-contiguous gradients and inputs;
  - the Triton kernels under TRITON_INTERPRET=1 (one subprocess, tests/interp.py; small shapes, 16 x 16 x 16 tiles
    so that every loop runs more than once), bf16 bounds with the interpreter's truncating fp32 -> bf16 cast;
  - the ops' fake impls (meta device), torch.library.opcheck, torch.compile(fullgraph=True) through forward and
    backward, the backend choice and bad inputs raising errors that name the argument;
  - on a GPU (``-m gpu``): Triton, torch._grouped_mm (where fused: sm_90, bf16) and the per-expert cuBLAS loop, each
    against float64 and against each other.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from grouped_mm_helpers import assert_within, bounds, leaves, make_case, reference, run_op

import llmpar.ops.grouped_gemm_backends as backends
from llmpar.ops import grouped_mm, grouped_swiglu

from interp import run_interpreted

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
in_main = pytest.mark.skipif(INTERPRET, reason="runs in the main process")
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
ODD = [0, 1, 37, 128, 0]  # empty groups first and last, one row, odd rows, a full 128-row group
L = torch.ops.llmpar


def _torch_path(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")


# ------------------------------------------------------------------------------------------- the torch path


@in_main
@pytest.mark.parametrize(
    "act, n, packed, recompute",
    [("none", 29, True, None), ("none", 29, False, None), ("swiglu", 46, True, False), ("swiglu", 46, False, True)],
    ids=["none-packed", "none-plain", "swiglu-packed-kept", "swiglu-plain-recomputed"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path_vs_float64(monkeypatch, dtype, act, n, packed, recompute):
    _torch_path(monkeypatch)
    case = make_case(ODD, 45, n, act, dtype, packed=packed, seed=1, recompute=recompute)
    assert_within(case, run_op(case), fused=False, what=f"torch {dtype} {act}")


def _per_expert_linear(x, w, counts, act):
    """What the MoE layer ran before the op: F.linear per expert on the packed weight, torch.cat."""
    outs = []
    for xe, we in zip(torch.split(x, counts), w.transpose(1, 2).unbind(0)):
        y = F.linear(xe, we)
        if act == "swiglu":
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        outs.append(y)
    return torch.cat(outs)


@in_main
@pytest.mark.parametrize("counts", [ODD, [0, 0, 166, 0], [0, 0, 0]], ids=["odd", "one-takes-all", "zero-rows"])
@pytest.mark.parametrize("act, recompute", [("none", None), ("swiglu", None), ("swiglu", True)])
@pytest.mark.parametrize("k, n", [(45, 46), (48, 64)], ids=["python-loop", "aligned"])
def test_torch_path_equals_per_expert_linear_bitwise(monkeypatch, k, n, counts, act, recompute):
    """Odd K / N: the Python loop of GEMMs; 16-byte aligned: torch._grouped_mm's CPU loop (where torch has it)."""
    monkeypatch.delenv("LLMPAR_BACKEND", raising=False)  # the CPU default is the torch path
    calls = []
    real = getattr(torch, "_grouped_mm", None)
    if real is not None:
        monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    case = make_case(counts, k, n, act, torch.float32, seed=2, recompute=recompute)
    got = run_op(case)
    assert bool(calls) == (k == 48 and real is not None and sum(counts) > 0), calls
    want = run_op(case, _per_expert_linear)
    for name, a, b in zip(("out", "dx", "dw"), got, want):
        assert torch.equal(a, b), f"{name} differs by {(a - b).abs().max()}"
    for e, rows in enumerate(counts):
        if rows == 0:
            assert got[2][e].abs().sum() == 0  # an empty group's weight gradient is exactly zero (not missing)


@in_main
def test_noncontiguous_inputs_and_gradients(monkeypatch):
    _torch_path(monkeypatch)
    case = make_case(ODD, 45, 46, "swiglu", torch.float32, seed=3)
    x_wide = torch.randn(case.x.shape[0], 2 * case.x.shape[1])[:, ::2].detach()  # a strided x
    x_wide.copy_(case.x)
    assert not x_wide.is_contiguous()
    _, param, w = leaves(case)
    ref = reference(case)
    y = grouped_mm(x_wide.requires_grad_(), w, counts=case.counts, act="swiglu")
    dy_t = case.dy.t().contiguous().t()  # a column-major gradient
    y.backward(dy_t)
    assert not dy_t.is_contiguous()
    bnd = bounds(case, torch.float32, fused=False)
    for name, got, want in (("dx", x_wide.grad, ref[1]), ("dw", param.grad.transpose(1, 2), ref[2])):
        assert ((got.double() - want).abs() <= bnd[name]).all(), name
    # y.sum(): the gradient is an expanded (stride 0) tensor
    x, param, w = leaves(case)
    grouped_mm(x, w, counts=case.counts, act="none").sum().backward()
    ones = torch.ones(x.shape[0], w.shape[2], dtype=torch.float64)
    torch.testing.assert_close(
        x.grad.double(),
        torch.cat([o @ we.t() for o, we in zip(ones.split(case.counts), w.double().unbind(0))]),
        rtol=1e-5,
        atol=1e-5,
    )


@in_main
def test_offsets_and_counts_agree(monkeypatch):
    _torch_path(monkeypatch)
    case = make_case(ODD, 9, 10, "swiglu", torch.float32, seed=4)
    offs = torch.tensor(ODD).cumsum(0)
    x, _, w = leaves(case)
    a = grouped_mm(x, w, offs, act="swiglu")
    assert torch.equal(a, grouped_mm(x, w, counts=torch.tensor(ODD), act="swiglu"))
    assert torch.equal(a, grouped_mm(x, w, offs.to(torch.int32), act="swiglu"))


@in_main
def test_grouped_swiglu_is_the_two_ops(monkeypatch):
    _torch_path(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x, gate_up, down = torch.randn(166, 13, generator=g), torch.randn(5, 22, 13, generator=g), torch.randn(5, 13, 11)
    two = grouped_mm(grouped_mm(x, gate_up.transpose(1, 2), counts=ODD, act="swiglu"), down.transpose(1, 2), counts=ODD)
    assert torch.equal(grouped_swiglu(x, ODD, gate_up, down), two)
    with pytest.raises(ValueError, match="does not match gate_up"):
        grouped_swiglu(x, ODD, gate_up, down[:, :, :5])


# ------------------------------------------------------------------------------- ops: fakes, opcheck, compile


@in_main
def test_fake_impls_on_the_meta_device():
    x, w = torch.empty(7, 5, device="meta"), torch.empty(3, 6, 5, device="meta").transpose(1, 2)
    offs = torch.empty(3, dtype=torch.int32, device="meta")
    assert [t.shape for t in L.grouped_mm(x, w, offs, 0, True)] == [(7, 6), (0, 6)]
    assert [t.shape for t in L.grouped_mm(x, w, offs, 1, False)] == [(7, 3), (0, 6)]
    assert [t.shape for t in L.grouped_mm(x, w, offs, 1, True)] == [(7, 3), (7, 6)]  # the kept [g, u]
    assert L.grouped_mm_swiglu_backward(torch.empty(7, 3, device="meta"), x, w, offs).shape == (7, 6)
    assert L.grouped_mm_wgrad(torch.empty(7, 6, device="meta"), x, offs).shape == (3, 6, 5)
    assert grouped_mm(x, w, counts=[2, 0, 5], act="swiglu").shape == (7, 3)
    with pytest.raises(ValueError, match="disagree on K"):
        L.grouped_mm(x, torch.empty(3, 4, 6, device="meta"), offs, 0, False)


def _opcheck_cases():
    g = torch.Generator().manual_seed(6)
    counts = [0, 3, 5, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(9, 7, generator=g)
    w = torch.randn(4, 10, 7, generator=g).transpose(1, 2)
    dh = torch.randn(9, 5, generator=g)
    return [
        ("grouped_mm", "none", (x.requires_grad_(), w.detach().requires_grad_(), offs, 0, False)),
        ("grouped_mm", "swiglu", (x.detach().requires_grad_(), w.detach().requires_grad_(), offs, 1, False)),
        ("grouped_mm", "swiglu-kept", (x.detach().requires_grad_(), w.detach().requires_grad_(), offs, 1, True)),
        ("grouped_mm", "plain-w", (x.detach().requires_grad_(), w.contiguous().requires_grad_(), offs, 1, False)),
        ("grouped_mm_swiglu_backward", "odd", (dh, x.detach(), w.detach(), offs)),
        ("grouped_mm_wgrad", "odd", (torch.randn(9, 10, generator=g), x.detach(), offs.to(torch.int64))),
    ]


@in_main
@pytest.mark.parametrize("name, cid, args", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, cid, args):
    results = torch.library.opcheck(getattr(L, name).default, args)
    assert set(results.values()) == {"SUCCESS"}, results


@in_main
def test_compiles_without_graph_breaks(monkeypatch):
    _torch_path(monkeypatch)
    g = torch.Generator().manual_seed(7)
    x, gate_up, down = torch.randn(40, 13, generator=g), torch.randn(3, 22, 13, generator=g), torch.randn(3, 13, 11)

    def step(x, gate_up, down):
        return grouped_swiglu(x, [7, 0, 33], gate_up, down).square().sum()

    leaves_e = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    leaves_c = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    step(*leaves_e).backward()
    torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves_c).backward()
    for a, b in zip(leaves_e, leaves_c):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------- backend, bad inputs


@in_main
def test_backend_choice_on_cpu(monkeypatch):
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    monkeypatch.delenv("LLMPAR_BACKEND", raising=False)
    assert backends.select("grouped_mm", x, w) == "torch"  # no interpreter: CPU work goes to torch
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="LLMPAR_BACKEND=cuda but grouped_mm cannot use torch._grouped_mm: tensors"):
        grouped_mm(x, w, counts=[1, 3])
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="LLMPAR_BACKEND=triton but the triton backend cannot run grouped_mm"):
        grouped_mm(x, w, counts=[1, 3])


@in_main
def test_bad_inputs_name_the_argument():
    x, w = torch.randn(6, 3), torch.randn(3, 3, 4)
    cases = [
        (dict(offs=torch.tensor([2, 1, 6])), ValueError, r"offs must be non-decreasing .*offs\[1\]=1 < 2"),
        (dict(offs=torch.tensor([2, 3, 5])), ValueError, "offs end at row 5 but x has 6 rows"),
        (dict(offs=torch.tensor([-1, 3, 6])), ValueError, r"offs\[0\]=-1 < 0"),
        (dict(offs=torch.tensor([1.0, 3.0, 6.0])), TypeError, "offs must be an integer tensor"),
        (dict(offs=torch.tensor([3, 6])), ValueError, "offs must be a vector of E=3"),
        (dict(counts=[1, 2, 2]), ValueError, "counts sum to 5 but x has 6 rows"),
        (dict(counts=[3, 3]), ValueError, "counts must hold 3 non-negative"),
        (dict(counts=[7, -1, 0]), ValueError, "counts must hold 3 non-negative"),
        (dict(counts=[1.0, 2, 3]), TypeError, "counts must be ints"),
        (dict(), TypeError, "exactly one of offs"),
        (dict(offs=torch.tensor([1, 2, 6]), counts=[1, 1, 4]), TypeError, "exactly one of offs"),
        (dict(counts=[1, 2, 3], act="gelu"), ValueError, "act='gelu' is not one of none, swiglu"),
        (dict(counts=[1, 2, 3], act="swiglu", w=torch.randn(3, 3, 5)), ValueError, "even N = 2I"),
        (dict(counts=[1, 2, 3], w=torch.randn(3, 3, 4).bfloat16()), TypeError, r"x \(torch.float32\) and w"),
        (dict(counts=[1, 2, 3], w=torch.randn(3, 4, 4)), ValueError, "disagree on K"),
        (dict(counts=[1, 2, 3], w=torch.randn(3, 4)), ValueError, r"w must be a \[E, K, N\] tensor"),
    ]
    for kw, err, match in cases:
        kw = dict(kw)
        ww = kw.pop("w", w)
        with pytest.raises(err, match=match):
            grouped_mm(x, ww, **kw)
    with pytest.raises(ValueError, match="offs must be an int32/int64 vector of E=3"):
        L.grouped_mm(x, w, torch.tensor([1, 6], dtype=torch.int32), 0, False)


# --------------------------------------------------------------------------------- Triton, interpreted on CPU


@in_main
def test_triton_kernels_under_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, timeout=500, select="interp", what="interpreted grouped GEMM kernels")


@interpreted
@pytest.mark.parametrize(
    "dtype, act, n, packed, recompute",
    [
        (torch.bfloat16, "none", 19, True, None),
        (torch.bfloat16, "none", 19, False, None),
        (torch.bfloat16, "swiglu", 18, True, True),
        (torch.bfloat16, "swiglu", 18, False, False),
        (torch.float32, "none", 19, False, None),
        (torch.float32, "swiglu", 18, True, True),
    ],
    ids=[
        "bf16-none-packed",
        "bf16-none-plain",
        "bf16-swiglu-packed-recomputed",
        "bf16-swiglu-plain-kept",
        "fp32-none-plain",
        "fp32-swiglu-packed-recomputed",
    ],
)
def test_interp_kernels_vs_float64(monkeypatch, dtype, act, n, packed, recompute):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    case = make_case(ODD, 21, n, act, dtype, packed=packed, seed=8, recompute=recompute)
    assert backends.select("grouped_mm", case.x, case.w) == "triton"
    assert_within(case, run_op(case), fused=True, truncates=True, what=f"triton {dtype} {act}")


@interpreted
@pytest.mark.parametrize("counts", [[0, 40, 0], [0, 0, 0], [17]], ids=["one-takes-all", "zero-rows", "one-group"])
def test_interp_one_group_and_zero_rows(monkeypatch, counts):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    case = make_case(counts, 18, 34, "swiglu", torch.float16, seed=9, recompute=True)
    got = run_op(case)
    assert_within(case, got, fused=True, truncates=True, what=str(counts))
    for e, rows in enumerate(counts):
        if rows == 0:
            assert got[2][e].abs().sum() == 0


@interpreted
def test_interp_noncontiguous_gradient(monkeypatch):
    """A column-major output gradient reaches the kernels as it is (they take any strides)."""
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    case = make_case([5, 0, 20], 18, 34, "swiglu", torch.bfloat16, seed=12, recompute=True)
    case.dy = case.dy.t().contiguous().t()
    assert not case.dy.is_contiguous()
    assert_within(case, run_op(case), fused=True, truncates=True, what="column-major dy")


@interpreted
def test_interp_moe_experts_seam_runs_the_kernels(monkeypatch):
    """llmpar.moe.experts.grouped_mlp (the MoE layer's seam) on the Triton kernels: every GEMM of its forward and
    backward launches them; its output within the composed float64 bound of its two GEMMs (the first's bound, carried
    through the second: |dh| |W2| + (u + (I + 2) U) (|h| + |dh|) |W2|)."""
    from grouped_mm_helpers import U32, unit

    from llmpar.kernels import grouped_gemm as kernels
    from llmpar.moe.experts import grouped_mlp

    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    launches = []
    for name in ("grouped_mm", "grouped_wgrad"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, real=real, name=name, **kw: launches.append(name) or real(*a, **kw)
        )
    counts, hidden, inter = [0, 9, 30, 0, 2], 19, 11
    first = make_case(counts, hidden, 2 * inter, "swiglu", torch.bfloat16, seed=13, recompute=False)  # the default
    gate_up = first.w.transpose(1, 2).contiguous().requires_grad_()
    g = torch.Generator().manual_seed(14)
    down = (torch.randn(len(counts), hidden, inter, generator=g, dtype=torch.float64) * inter**-0.5).bfloat16()
    down.requires_grad_()
    y = grouped_mlp(first.x.clone().requires_grad_(), counts, gate_up, down)
    y.float().square().sum().backward()
    # forward: SwiGLU GEMM + down GEMM; backward: dX of each (G from the kept [g, u]), dW of each
    assert launches.count("grouped_mm") == 4 and launches.count("grouped_wgrad") == 2, launches
    h64, w2 = reference(first)[0], down.detach().double().transpose(1, 2)
    b_h = bounds(first, torch.bfloat16, fused=True, truncates=True)["out"]
    u = unit(torch.bfloat16, truncates=True)
    start = 0
    for e, rows in enumerate(counts):
        r = slice(start, start + rows)
        start += rows
        want = h64[r] @ w2[e]
        bound = b_h[r] @ w2[e].abs() + (u + (inter + 2) * U32) * ((h64[r].abs() + b_h[r]) @ w2[e].abs())
        assert bool(((y[r].double() - want).abs() <= bound).all()), e


@interpreted
def test_interp_dispatch(monkeypatch):
    monkeypatch.delenv("LLMPAR_BACKEND", raising=False)
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    assert backends.select("grouped_mm", x, w) == "triton"  # under the interpreter CPU tensors go to Triton
    assert backends.select("grouped_mm", x.double(), w.double()) == "torch"
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    with pytest.raises(TypeError, match="cannot use the triton kernel: dtype torch.float64"):
        grouped_mm(x.double(), w.double(), counts=[1, 3])


# ------------------------------------------------------------------------------------------------------ GPU

GPU_BACKENDS = ("triton", "cuda", "torch")


def _gpu_case(dtype, act, seed=10, *, aligned=False):
    """Odd K / N (every tile edge masked), or 16-byte aligned ones (what torch._grouped_mm's kernel takes)."""
    counts = [0, 1, 37, 128, 300, 0, 513, 2]  # empty, tiny, odd, and one group of several row tiles
    k, n = (264, 2 * 192 if act == "swiglu" else 392) if aligned else (257, 2 * 193 if act == "swiglu" else 389)
    return make_case(counts, k, n, act, dtype, seed=seed, device="cuda")


def _forced_or_refused(monkeypatch, backend, case):
    """Force ``backend``; None when it cannot take this case (the refusal checked), else the backend that runs."""
    monkeypatch.setenv("LLMPAR_BACKEND", backend)
    if backend == "cuda" and backends.torch_gmm_unfit((case.x, case.w)) is not None:
        with pytest.raises((RuntimeError, TypeError), match="cannot use torch._grouped_mm"):
            grouped_mm(case.x, case.w, counts=case.counts, act=case.act)
        return None
    return backends.select("grouped_mm", case.x, case.w)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("act", ["none", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_gpu_backends_vs_float64(monkeypatch, dtype, act, backend):
    case = _gpu_case(dtype, act, aligned=backend == "cuda")
    ran = _forced_or_refused(monkeypatch, backend, case)
    if ran is None:
        return
    got = run_op(case)
    assert got[0].is_cuda or ran == "torch"
    assert_within(case, got, fused=ran == "triton", what=f"{ran} {dtype} {act}")
    for e, rows in enumerate(case.counts):
        if rows == 0:
            assert got[2][e].abs().sum() == 0, f"{ran}: empty group {e} has a nonzero weight gradient"


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("act", ["none", "swiglu"])
def test_gpu_triton_grouped_mm_and_cublas_loop_agree(monkeypatch, act):
    """bf16: the three backends pairwise within the sum of their float64 bounds."""
    case = _gpu_case(torch.bfloat16, act, seed=11, aligned=True)
    results = {}
    for backend in GPU_BACKENDS:
        ran = _forced_or_refused(monkeypatch, backend, case)
        if ran is not None:
            results[ran] = (run_op(case), bounds(case, torch.bfloat16, fused=ran == "triton"))
    names = sorted(results)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for k, key in enumerate(("out", "dx", "dw")):
                err = (results[a][0][k].double() - results[b][0][k].double()).abs().cpu()
                assert (err <= results[a][1][key] + results[b][1][key]).all(), f"{a} vs {b}: {key}"
