"""The llmpar:: op library (llmpar/ops/_library.py): every op's schema, fake impl and CPU reference, on CPU.

``torch.library.opcheck`` runs all four of its checks on every op, on odd shapes of random data (never zeros):
  test_schema                 the op mutates exactly what its schema marks (a!)/(b!)... (pack_bucket's out,
                              unpack_bucket's outs, adamw_step's params/exp_avgs/exp_avg_sqs/extras) and returns no
                              alias of an input; random data makes every mutation visible
  test_autograd_registration  passes trivially: none of the ops is differentiable, and no input requires grad
                              (linear_act's autograd Function wraps them)
  test_faketensor             the fake impl's outputs have the shapes, dtypes and strides of the CPU reference's
  test_aot_dispatch_dynamic   torch.compile's path (AOTAutograd with dynamic shapes; the mutating ops go through
                              auto_functionalized) gives the eager results
The CPU references are also checked against float64 math here; the CUDA kernels against them on GPUs (pytest -m gpu).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmpar.ops import _dispatch, _ext
from llmpar.ops._library import ADAMW_CHUNK, OPS
from llmpar.ops.adamw import MODES, PRECISIONS, adamw_step, mode_code
from llmpar.ops.gemm import ACTIVATIONS
from llmpar.ops.quant import row_bytes

L = torch.ops.llmpar


def _rand(shape, dtype=torch.float32, *, seed=0, scale=1.0, positive=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    x = torch.where(x == 0, torch.full_like(x, 0.5 * scale), x)
    return (x.abs() + 0.1 * scale if positive else x).to(dtype)


def _adamw_args(precision, *, seed=0, gscale=0.7, found_inf=0.0, lr_tensor=False):
    shapes = [(5,), (3, 41), (123,)]
    spec = MODES[precision]
    pd = spec.param_dtypes[0]
    md = spec.moment_dtype or pd
    rnd = [lambda s, d, k=k, **kw: _rand(s, d, seed=seed * 10 + k, **kw) for k in range(5)]
    params = [rnd[0](s, pd) for s in shapes]
    grads = [rnd[1](s, pd) for s in shapes]
    exp_avgs = [rnd[2](s, md, scale=0.1) for s in shapes]
    exp_avg_sqs = [rnd[3](s, md, positive=True) for s in shapes]
    extras = [rnd[4](s, spec.extra[1], scale=1e-3) for s in shapes] if spec.extra else []
    steps = [torch.tensor(float(3 + i), dtype=torch.float32) for i in range(len(shapes))]
    lr = torch.tensor(3e-2) if lr_tensor else None
    return (
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        extras,
        steps,
        [7, 8, 9],
        mode_code(precision),
        0.0 if lr_tensor else 3e-2,
        lr,
        torch.tensor(gscale) if gscale is not None else None,
        torch.tensor(found_inf) if found_inf is not None else None,
        0.9,
        0.999,
        1e-8,
        0.1,
        11,
    )


def _bucket(dtype_in, dtype_out):
    tensors = [_rand((5,), dtype_in, seed=1), _rand((3, 41), dtype_in, seed=2), _rand((123,), dtype_in, seed=3)]
    return tensors, _rand((5 + 123 + 123 + 7,), dtype_out, seed=4)


def _cases():
    """op name -> list of (case id, args)."""
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    cases = {name: [] for name in OPS}
    for din, dout in ((f32, bf16), (bf16, f32), (f16, f16)):
        tensors, out = _bucket(din, dout)
        cases["pack_bucket"].append((f"{din}->{dout}", (tensors, out, 0.37)))
        cases["unpack_bucket"].append((f"{dout}->{din}", (out, [t.clone() for t in tensors], 1.7)))
    for precision in PRECISIONS:
        cases["adamw_step"].append((precision, _adamw_args(precision)))
    cases["adamw_step"].append(
        ("fp32 lr_tensor no-clip", _adamw_args("fp32", lr_tensor=True, gscale=None, found_inf=None))
    )
    for dtype in (f32, bf16):
        cases["sum_squares"].append(
            (str(dtype), ([_rand((5,), dtype), _rand((4097,), dtype, seed=1), _rand((3, 41), dtype, seed=2)],))
        )
    for act in range(len(ACTIVATIONS)):
        cases["bias_act_backward"].append(
            (ACTIVATIONS[act], (_rand((37, 19), bf16), _rand((37, 19), bf16, seed=1, scale=2.0), act))
        )
    cases["bias_act_backward"].append(("fp32 grad, bf16 pre", (_rand((9, 21)), _rand((9, 21), bf16, seed=1), 3)))
    x, w, b, r = _rand((5, 33)), _rand((23, 33), seed=1, scale=0.2), _rand((23,), seed=2), _rand((5, 23), seed=3)
    cases["linear_lt"] += [
        ("none bias residual", (x, w, b, 0, r)),
        ("gelu_tanh bias", (x, w, b, 1, None)),
        ("relu bf16 no bias", (x.bfloat16(), w.bfloat16(), None, 4, None)),
    ]
    cases["linear_lt_aux"] += [("fp32", (x, w, b)), ("bf16 no bias", (x.bfloat16(), w.bfloat16(), None))]
    for bits, block in ((8, 64), (4, 32)):  # wire buffers start as random bytes: every write is visible
        rb = row_bytes(123, bits, block)
        wire = torch.randint(0, 256, (3, rb), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
        cases["quantize_rows"].append((f"int{bits} bf16", (_rand((3, 123), bf16), wire.clone(), 123, bits, block)))
        tensors = [_rand((5,), seed=1), _rand((3, 41), seed=2), _rand((200,), seed=3)]
        cases["pack_quantize"] += [
            (
                f"int{bits} residual",
                (tensors, wire.clone(), 3, 123, bits, block, 0.37, _rand((369,), seed=4, scale=0.01)),
            ),
            (f"int{bits} no residual", (tensors, wire.clone(), 3, 123, bits, block, 1.0, None)),
        ]
        cases["dequantize_rows"].append((f"int{bits} -> bf16", (wire, _rand((3, 123), bf16, seed=5), 123, bits, block)))
        cases["dequantize_sum"] += [
            (f"int{bits} accumulate", (wire, _rand((123,), seed=6), 123, bits, block, True)),
            (f"int{bits} fp16", (wire, _rand((123,), f16, seed=7), 123, bits, block, False)),
        ]
    for bits in (8, 4):  # the float64 reference written back: params fp32, and bf16 params with fp32 masters
        for master in (False, True):
            cases["adamw_lowbit_step"].append(
                (f"int{bits}" + (" bf16+master" if master else ""), _lowbit_args(bits, master))
            )
    return cases


def _lowbit_args(bits, master):
    from llmpar.ops import lowbit

    sizes = (5, 300)
    ms = [lowbit.quantize(_rand((n,), seed=10 + n, scale=0.01), bits, True) for n in sizes]
    vs = [lowbit.quantize(_rand((n,), seed=20 + n, scale=1e-4).abs(), bits, False) for n in sizes]
    masters = [_rand((n,), seed=30 + n) for n in sizes]
    params = [m.bfloat16() for m in masters] if master else masters
    return (
        params,
        [_rand((n,), seed=40 + n) for n in sizes],
        [c for c, _ in ms],
        [sc for _, sc in ms],
        [c for c, _ in vs],
        [sc for _, sc in vs],
        masters if master else [],
        [torch.tensor(3.0), torch.tensor(4.0)],
        lowbit.qmap(bits, True),
        lowbit.qmap(bits, False),
        bits,
        1e-2,
        None,
        torch.tensor(0.5),
        None,
        0.9,
        0.999,
        1e-8,
        0.1,
    )


CASES = _cases()
OPCHECK = [pytest.param(name, args, id=f"{name}[{cid}]") for name, lst in CASES.items() for cid, args in lst]


def test_every_op_has_cases():
    assert all(CASES[name] for name in OPS), [name for name in OPS if not CASES[name]]


@pytest.mark.parametrize("name, args", OPCHECK)
def test_opcheck(name, args):
    results = torch.library.opcheck(getattr(L, name).default, args)
    assert set(results.values()) == {"SUCCESS"}, results


def test_schemas_and_cpu_kernels_are_registered():
    for name, op in OPS.items():
        schema = getattr(L, name).default._schema
        assert str(schema) == str(torch._C.parse_schema(f"llmpar::{op.schema}"))
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"llmpar::{name}", "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"llmpar::{name}", "Meta"), "the fake serves Meta"
    mutable = {
        name
        for name in OPS
        if any(
            a.is_write
            for s in [getattr(L, name).default._schema]
            for a in [x.alias_info for x in s.arguments]
            if a is not None
        )
    }
    assert mutable == {
        "pack_bucket",
        "unpack_bucket",
        "adamw_step",
        "quantize_rows",
        "pack_quantize",
        "dequantize_rows",
        "dequantize_sum",
        "adamw_lowbit_step",
    }


def test_adamw_step_traces_under_torch_compile():
    """A schema argument named ``mode`` broke auto_functionalized (torch.compile of the mutating op): it is
    ``mode_code``."""
    args = _adamw_args("fp32", found_inf=None)
    eager = [[t.clone() for t in lst] for lst in args[:4]]
    L.adamw_step(*eager, *args[4:])

    def step(p, g, m, v):
        L.adamw_step(p, g, m, v, *args[4:])

    torch.compile(step, backend="aot_eager", fullgraph=True)(*args[:4])
    for got, want in zip(args[:4], eager):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fake_impls_on_the_meta_device():
    """The Meta device (and FakeTensor: test_opcheck) runs the fake impls: shapes, dtypes and the aux layout."""
    meta = dict(device="meta")
    partials = L.sum_squares([torch.empty(4097, **meta), torch.empty(0, **meta), torch.empty(3, 5, **meta)])
    assert partials.shape == (2 + 0 + 1,) and partials.dtype == torch.float32
    assert L.sum_squares([torch.empty(0, **meta)]).shape == (1,)
    gp, db = L.bias_act_backward(torch.empty(7, 9, **meta), torch.empty(7, 9, dtype=torch.bfloat16, **meta), 2)
    assert (gp.shape, gp.dtype, db.shape, db.dtype) == ((7, 9), torch.bfloat16, (9,), torch.float32)
    x, w = torch.empty(5, 33, dtype=torch.bfloat16, **meta), torch.empty(21, 33, dtype=torch.bfloat16, **meta)
    y, pre = L.linear_lt_aux(x, w, None)
    assert y.shape == pre.shape == (5, 21) and pre.stride() == (24, 1) and y.is_contiguous()
    assert L.linear_lt(x, w, None, 4, None).shape == (5, 21)
    with pytest.raises(
        ValueError,
        match=r"linear_lt: act=3 has no cuBLASLt epilogue; it takes 0 \(none\), "
        r"1 \(gelu_tanh\), 4 \(relu\)",
    ):
        L.linear_lt(x, w, None, 3, None)
    with pytest.raises(ValueError, match="only act 0 takes one"):
        L.linear_lt(x, w, None, 1, torch.empty(5, 21, dtype=torch.bfloat16, **meta))
    with pytest.raises(ValueError, match=r"bias_act_backward: pre \(7, 8\) must match grad \(7, 9\)"):
        L.bias_act_backward(torch.empty(7, 9, **meta), torch.empty(7, 8, **meta), 0)


# ------------------------------------------------------------------- the CPU references vs float64 math


@pytest.mark.parametrize(
    "din, dout", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)]
)
def test_pack_unpack_reference_vs_float64(din, dout):
    tensors, out = _bucket(din, dout)
    tail = out[-7:].clone()
    scale = 0.37
    s32 = float(torch.tensor(scale, dtype=torch.float32))
    L.pack_bucket(tensors, out, scale)
    exact = torch.cat([t.double().reshape(-1) for t in tensors]) * s32
    torch.testing.assert_close(out[:-7].double(), exact, rtol=torch.finfo(dout).eps, atol=0)  # one rounding
    assert torch.equal(out[-7:], tail), "elements past the packed ones stay as they were"
    outs = [_rand(t.shape, din, seed=9) for t in tensors]
    L.unpack_bucket(out, outs, 1 / scale)
    back = out[:-7].double() * float(torch.tensor(1 / scale, dtype=torch.float32))
    torch.testing.assert_close(
        torch.cat([o.double().reshape(-1) for o in outs]), back, rtol=torch.finfo(din).eps, atol=0
    )
    with pytest.raises(ValueError, match="tensors hold 251 elements, the flat buffer only 250"):
        L.pack_bucket(tensors, out[:250], 1.0)


def test_sum_squares_reference_blocks_vs_float64():
    ts = [_rand((5,)), _rand((4097,), seed=1), _rand((3, 41), seed=2, scale=10.0)]
    got = L.sum_squares(ts)
    flat1 = ts[1].double()
    want = torch.stack(
        [
            ts[0].double().square().sum(),
            flat1[:ADAMW_CHUNK].square().sum(),
            flat1[ADAMW_CHUNK:].square().sum(),
            ts[2].double().square().sum(),
        ]
    )
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(L.sum_squares([torch.empty(0)]), torch.zeros(1), rtol=0, atol=0)


@pytest.mark.parametrize("act", [0, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_lt_references_vs_float64(act, dtype):
    x, w, b = _rand((7, 45), dtype), _rand((21, 45), dtype, seed=1, scale=0.2), _rand((21,), dtype, seed=2)
    r = _rand((7, 21), dtype, seed=3) if act == 0 else None
    name = ACTIVATIONS[act]
    fn = {"none": lambda z: z, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "relu": F.relu}[name]
    z64 = F.linear(x.double(), w.double(), b.double())
    want = fn(z64) + (r.double() if r is not None else 0)
    y = L.linear_lt(x, w, b, act, r)
    assert y.dtype == dtype and y.shape == (7, 21)
    tol = 2 * torch.finfo(dtype).eps if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    if act == 1:
        y2, pre = L.linear_lt_aux(x, w, b)
        assert pre.stride() == (24, 1)  # a view of the [M, ceil8(N)] aux buffer, as cuBLASLt returns it
        torch.testing.assert_close(y2, y, rtol=0, atol=0)
        torch.testing.assert_close(pre.double(), z64, rtol=tol, atol=tol * z64.abs().max().item())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_adamw_reference_is_the_torch_path_and_reads_grads_only(precision, monkeypatch):
    """llmpar::adamw_step on CPU == llmpar.ops.adamw_step's torch backend (same math, same random stream), with the
    grads left untouched (the op's schema reads them only) and the steps not incremented (the caller's job)."""
    args = _adamw_args(precision, seed=3)
    params, grads, m, v, extras, steps = [[t.clone() for t in lst] for lst in args[:6]]
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    before = [s.clone() for s in steps]
    torch._foreach_sub_(before, 1.0)  # adamw_step increments them before the update
    adamw_step(
        params,
        [g.clone() for g in grads],
        m,
        v,
        before,
        precision=precision,
        extras=extras or None,
        lr=3e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        gscale=torch.tensor(0.7),
        found_inf=torch.tensor(0.0),
        seed=11,
        salts=[7, 8, 9],
    )
    grads0 = [g.clone() for g in args[1]]
    L.adamw_step(*args)
    for got, want in zip(args[0] + args[2] + args[3] + args[4], params + m + v + extras):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, g0 in zip(args[1], grads0):
        assert torch.equal(g, g0), "the reference must not scale the grads in place"
    assert [float(s) for s in args[5]] == [3.0, 4.0, 5.0]


def test_adamw_reference_found_inf_and_bad_mode():
    args = _adamw_args("bf16_kahan", found_inf=1.0)
    before = [[t.clone() for t in lst] for lst in args[:5]]
    L.adamw_step(*args)
    for lst, old in zip(args[:5], before):
        assert all(torch.equal(a, b) for a, b in zip(lst, old)), "a nonzero found_inf skips the step"
    bad = list(_adamw_args("fp32"))
    bad[7] = len(PRECISIONS)
    with pytest.raises(ValueError, match=r"mode_code=4 is not a mode code \(0..3: fp32, fp32_master, bf16_sr"):
        L.adamw_step(*bad)


# ------------------------------------------------------------------- what the dispatcher says about the build


def test_defined_ops_without_cuda_kernels_are_not_ext_ops(monkeypatch):
    """The schemas exist without the extension; has_ext_op asks for the CUDA kernel, which only llmpar._C adds."""
    if _ext.load(build=False).available:
        pytest.skip("llmpar._C is loaded here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_ext, "load", lambda build=True: _ext.ExtStatus(available=True, source="wheel", reason="x"))
    for name in OPS:
        assert hasattr(L, name) and not _dispatch.has_ext_op(name)
        assert (
            _dispatch.cuda_unavailable_reason(torch.device("cuda"), op=name)
            == f"llmpar._C (wheel) has no op llmpar::{name}: built from older sources? rebuild it"
        )
