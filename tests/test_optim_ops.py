"""llmpar.ops.adamw_step / grad_norm, every precision mode and backend that can run here, vs a float64 reference.

Backends: "torch" always; "triton" when Triton can run (CUDA, or CPU under TRITON_INTERPRET=1:
tests/test_optim_triton.py reruns this file's triton cases in such a subprocess); "cuda" when the extension loads (GPU
machines).
Criteria (docs/DESIGN habit 6): fp32 math within 2x the error of the same math in plain torch fp32 (plus one fp32 ulp);
a round-to-nearest write within half a bf16/fp16 ulp; a stochastic write on one of the two neighbours (within one ulp).
"""

from __future__ import annotations

import bisect
import math

import pytest
import torch

from llmpar.kernels import HAS_TRITON
from llmpar.ops import adamw_torch
from llmpar.ops._dispatch import cuda_unavailable_reason, triton_unavailable_reason
from llmpar.ops.adamw import adamw_step
from llmpar.ops.grad_norm import clip_coefficient, grad_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["torch"] + [
    b
    for b, why in (
        ("triton", triton_unavailable_reason(DEVICE)),
        ("cuda", cuda_unavailable_reason(DEVICE, build=False) if DEVICE.type == "cuda" else "no GPU"),
    )
    if why is None
]
SIZES = [(1,), (7,), (4097,), (65537,), (3, 41)] + [(k % 13 + 2,) for k in range(30)]  # odd sizes + many tensors
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
PARAM_DTYPE = {
    "fp32": torch.float32,
    "fp32_master": torch.bfloat16,
    "bf16_sr": torch.bfloat16,
    "bf16_kahan": torch.bfloat16,
}
MOMENT_DTYPE = {
    "fp32": torch.float32,
    "fp32_master": torch.float32,
    "bf16_sr": torch.bfloat16,
    "bf16_kahan": torch.bfloat16,
}


if HAS_TRITON:
    import triton
    import triton.language as tl

    from llmpar.kernels.multi_tensor import _owner

    @triton.jit
    def _owners_kernel(table_ptr, n, out_ptr):
        pid = tl.program_id(0)
        tl.store(out_ptr + pid, _owner(table_ptr, n, pid))


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", request.param)
    return request.param


def make_state(precision, sizes=SIZES, *, seed=0, step=4.0, param_dtype=None):
    """Fresh random state over a few magnitudes (never zeros), mid-training (step 4, nonzero moments)."""
    g = torch.Generator().manual_seed(seed)
    pd = param_dtype or PARAM_DTYPE[precision]
    md = MOMENT_DTYPE[precision]
    st = {k: [] for k in ("p", "g", "m", "v", "x", "s")}
    for i, shape in enumerate(sizes):
        mag = 10.0 ** (i % 3 - 1)
        master = torch.randn(shape, generator=g, dtype=torch.float64) * mag + 0.01
        grad = torch.randn(shape, generator=g, dtype=torch.float64) * mag
        st["p"].append(master.to(pd).to(DEVICE))
        st["g"].append(grad.to(pd).to(DEVICE))
        st["m"].append((0.1 * torch.randn(shape, generator=g, dtype=torch.float64) * mag).to(md).to(DEVICE))
        st["v"].append(((torch.rand(shape, generator=g, dtype=torch.float64) + 0.1) * mag * mag).to(md).to(DEVICE))
        if precision == "fp32_master":
            st["x"].append(master.float().to(DEVICE))
        elif precision == "bf16_kahan":
            comp = master - master.to(pd).double()
            st["x"].append(comp.to(torch.bfloat16).to(DEVICE))
        st["s"].append(torch.tensor(step, dtype=torch.float32, device=DEVICE))
    return st


def run(precision, st, **kw):
    args = {**HYPER, **kw}
    adamw_step(st["p"], st["g"], st["m"], st["v"], st["s"], precision=precision, extras=st["x"] or None, **args)


def reference(p, g, m, v, t, *, lr, beta1, beta2, eps, weight_decay, gscale=1.0, dtype=torch.float64):
    """The AdamW step in ``dtype`` with plain torch ops; inputs any dtype. Returns (p, m, v)."""
    p, g, m, v = (x.detach().to(dtype).cpu() for x in (p, g, m, v))
    g = g * gscale
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    p = p - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v


def snapshot(st):
    return {k: [t.detach().clone() for t in v] for k, v in st.items()}


def assert_within_2x_plain(got, inputs, i, which, **kw):
    """got (float32) vs float64: error <= 2 x plain-torch-float32 error + one float32 ulp of the largest value."""
    ref = reference(*inputs, **kw)[which]
    plain = reference(*inputs, dtype=torch.float32, **kw)[which].double()
    err = (got.double().cpu() - ref).abs().max().item()
    floor = torch.finfo(torch.float32).eps * ref.abs().max().item()
    bound = 2 * (plain - ref).abs().max().item() + floor
    assert err <= bound, f"tensor {i} {['p', 'm', 'v'][which]}: error {err:.3g} > {bound:.3g}"


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` values around float64 x (normal range)."""
    fi = torch.finfo(dtype)
    e = torch.floor(torch.log2(x.abs().clamp(min=fi.tiny)))
    return torch.exp2(e - (fi.bits - 1 - (8 if dtype == torch.bfloat16 else 5)))


@pytest.mark.parametrize("gscale", [None, 0.37])
@pytest.mark.parametrize("precision", ["fp32", "fp32_master"])
def test_fp32_math_vs_float64(backend, precision, gscale):
    st = make_state(precision)
    before = snapshot(st)
    gs = None if gscale is None else torch.tensor(gscale, device=DEVICE)
    run(precision, st, gscale=gs)
    kw = dict(HYPER, gscale=float(torch.tensor(gscale or 1.0, dtype=torch.float32)))
    for i in range(len(SIZES)):
        p0 = before["x"][i] if precision == "fp32_master" else before["p"][i]
        inputs = (p0, before["g"][i], before["m"][i], before["v"][i], 5.0)
        p_new = st["x"][i] if precision == "fp32_master" else st["p"][i]
        for which, got in enumerate((p_new, st["m"][i], st["v"][i])):
            assert_within_2x_plain(got, inputs, i, which, **kw)
        if precision == "fp32_master":
            assert torch.equal(st["p"][i], st["x"][i].to(torch.bfloat16)), "param = master rounded to nearest"
        assert st["s"][i].item() == 5.0


def test_fp32_master_fp16_params(backend):
    st = make_state("fp32_master", SIZES[:4], param_dtype=torch.float16)
    before = snapshot(st)
    run("fp32_master", st)
    for i in range(4):
        inputs = (before["x"][i], before["g"][i], before["m"][i], before["v"][i], 5.0)
        assert_within_2x_plain(st["x"][i], inputs, i, 0, **HYPER)
        assert torch.equal(st["p"][i], st["x"][i].half())


def test_bf16_sr_one_step_on_a_neighbour(backend):
    st = make_state("bf16_sr")
    before = snapshot(st)
    run("bf16_sr", st, seed=123)
    rounded_up = total = 0
    for i in range(len(SIZES)):
        refs = reference(before["p"][i], before["g"][i], before["m"][i], before["v"][i], 5.0, **HYPER)
        p0, g0, m0, v0 = (
            t.double().cpu().abs() for t in (before["p"][i], before["g"][i], before["m"][i], before["v"][i])
        )
        # the float32 math before the rounding: a few float32 ulps of the terms (matters where they cancel)
        floors = (p0 + 1e-2, m0 + g0, v0 + g0 * g0)
        for got, ref, floor in zip((st["p"][i], st["m"][i], st["v"][i]), refs, floors):
            got = got.double().cpu()
            err = (got - ref).abs()
            bound = ulp(ref, torch.bfloat16) * (1 + 1e-3) + 4 * 2.0**-24 * floor
            assert bool((err <= bound).all()), (
                f"tensor {i}: SR result off its neighbours by {(err / bound).max():.3g} ulp"
            )
            rounded_up += int((got.abs() > ref.abs()).sum())
            total += got.numel()
    assert 0.3 < rounded_up / total < 0.7, "stochastic rounding should round up about half the time on random data"


def test_bf16_sr_reproducible_per_seed(backend):
    outs = []
    for seed in (7, 7, 8):
        st = make_state("bf16_sr", SIZES[:4])
        run("bf16_sr", st, seed=seed)
        outs.append(torch.cat([torch.cat([t.float().cpu().reshape(-1) for t in st[k]]) for k in "pmv"]))
    assert torch.equal(outs[0], outs[1]), "same seed and step must give the same bits"
    assert not torch.equal(outs[0], outs[2]), "another seed must give other roundings"


@pytest.mark.parametrize("precision", ["bf16_sr", "bf16_kahan", "fp32_master", "fp32"])
def test_same_bits_however_the_tensors_are_split_into_calls(backend, precision, monkeypatch):
    """One call over all tensors == one call per tensor with its salt: the stochastic-rounding stream is a function of
    (seed, step, salt, element), not of the batching (ZeRO steps its units one call each). The torch path's batches
    made small (1000 elements) so that they span tensors and split them."""
    monkeypatch.setattr(adamw_torch, "_CHUNK", 1000)
    sizes = [(3, 41), (2501,), (7,), (1999,), (5,)]
    whole, split = make_state(precision, sizes, seed=3), make_state(precision, sizes, seed=3)
    run(precision, whole, seed=11)
    for i in range(len(sizes)):
        one = {k: v[i : i + 1] for k, v in split.items()}
        adamw_step(
            one["p"],
            one["g"],
            one["m"],
            one["v"],
            one["s"],
            precision=precision,
            extras=one["x"] or None,
            seed=11,
            salts=[i],
            **HYPER,
        )
    for k in "pmvx":
        for a, b in zip(whole[k], split[k]):
            assert torch.equal(a, b), f"{k} differs between one call and one call per tensor"
    assert not torch.equal(whole["p"][1], make_state(precision, sizes, seed=3)["p"][1])


def test_bf16_kahan_one_step(backend):
    st = make_state("bf16_kahan")
    before = snapshot(st)
    run("bf16_kahan", st)
    for i in range(len(SIZES)):
        p0 = before["p"][i].double().cpu() + before["x"][i].double().cpu()  # the compensated value going in
        ref_p, ref_m, ref_v = reference(before["p"][i], before["g"][i], before["m"][i], before["v"][i], 5.0, **HYPER)
        delta = ref_p - before["p"][i].double().cpu()
        got = st["p"][i].double().cpu() + st["x"][i].double().cpu()
        err = (got - (p0 + delta)).abs()
        bound = ulp(st["x"][i].double().cpu(), torch.bfloat16) + 4e-7 * p0.abs() + 1e-30
        assert bool((err <= bound).all()), f"tensor {i}: Kahan sum off by {(err / bound).max():.3g} bounds"
        g0, m0, v0 = (t.double().cpu().abs() for t in (before["g"][i], before["m"][i], before["v"][i]))
        for got_s, ref, floor in ((st["m"][i], ref_m, m0 + g0), (st["v"][i], ref_v, v0 + g0 * g0)):
            e = (got_s.double().cpu() - ref).abs()
            assert bool((e <= 0.5 * ulp(ref, torch.bfloat16) * (1 + 1e-3) + 4 * 2.0**-24 * floor).all())


@pytest.mark.parametrize("precision", ["fp32", "fp32_master", "bf16_sr", "bf16_kahan"])
def test_found_inf_skips_everything(backend, precision):
    st = make_state(precision, SIZES[:4])
    before = snapshot(st)
    run(precision, st, found_inf=torch.tensor(1.0, device=DEVICE), gscale=torch.tensor(0.5, device=DEVICE))
    for k in ("p", "m", "v", "x", "s"):
        for a, b in zip(st[k], before[k]):
            assert torch.equal(a, b), f"{k} changed although found_inf=1"
    run(precision, st, found_inf=torch.tensor(0.0, device=DEVICE))
    assert all(s.item() == 5.0 for s in st["s"]) and not torch.equal(st["p"][2], before["p"][2])


def test_lr_on_device_and_step_one(backend):
    st = make_state("fp32", SIZES[:4], step=0.0)
    before = snapshot(st)
    run("fp32", st, lr=torch.tensor(HYPER["lr"], device=DEVICE))
    for i in range(4):
        inputs = (before["p"][i], before["g"][i], before["m"][i], before["v"][i], 1.0)
        assert_within_2x_plain(st["p"][i], inputs, i, 0, **HYPER)


@pytest.mark.parametrize("precision", ["bf16_sr", "fp32_master"])
def test_stochastic_rounding_is_unbiased(backend, precision):
    """65537 copies of one value: the mean of the stored m (and p) matches the float32 value for SR, not for nearest.

    m_new = 0.9 m + 0.1 g lands 0.3 ulp above a bf16 value; nearest rounds every copy down, SR rounds ~30% up."""
    n = 65537
    base = torch.tensor(1.0 + 2.0**-7 * 5, dtype=torch.float64)  # a bf16 value; ulp there is 2**-7
    target = base + 0.3 * 2.0**-7
    g_val = (target - 0.9 * base) / 0.1  # so that 0.9 * base + 0.1 * g = target (in float32, up to its rounding)
    md = MOMENT_DTYPE[precision]
    st = {
        "p": [torch.full((n,), 1.0, dtype=torch.bfloat16, device=DEVICE)],
        "g": [
            torch.full(
                (n,), float(g_val), dtype=torch.bfloat16 if precision == "bf16_sr" else torch.bfloat16, device=DEVICE
            )
        ],
        "m": [torch.full((n,), float(base), dtype=md, device=DEVICE)],
        "v": [torch.ones(n, dtype=md, device=DEVICE)],
        "x": [torch.ones(n, device=DEVICE)] if precision == "fp32_master" else [],
        "s": [torch.tensor(9.0, device=DEVICE)],
    }
    g32 = st["g"][0][0].double()
    exact = float(
        torch.tensor(0.9, dtype=torch.float32).double() * base + torch.tensor(0.1, dtype=torch.float32).double() * g32
    )
    run(precision, st, beta1=0.9, weight_decay=0.0, lr=1e-3, seed=1)
    stored = st["m"][0].double().cpu()
    sigma = 0.5 * 2.0**-7 / math.sqrt(n)  # an SR result has std <= ulp / 2
    if precision == "bf16_sr":
        assert abs(stored.mean().item() - exact) < 5 * sigma, "SR mean differs from the exact value"
        assert 0.2 < (stored > exact).double().mean().item() < 0.4
    nearest = torch.full((n,), exact, dtype=torch.float32).to(torch.bfloat16).double()
    assert abs(nearest.mean().item() - exact) > 20 * sigma, "round to nearest must fail the same test"


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float32), (torch.float16,)])
def test_grad_norm_vs_float64(backend, dtypes):
    g = torch.Generator().manual_seed(3)
    grads = [
        (torch.randn(s, generator=g, dtype=torch.float64) * 10.0 ** (i % 3 - 1)).to(dtypes[i % len(dtypes)]).to(DEVICE)
        for i, s in enumerate(SIZES)
    ]
    norm = grad_norm(grads)
    assert norm.dtype == torch.float32 and norm.device.type == DEVICE.type and norm.dim() == 0
    ref = math.sqrt(sum(float((t.double().cpu() ** 2).sum()) for t in grads))
    assert abs(norm.item() - ref) <= 1e-5 * ref
    gscale, found_inf = clip_coefficient(norm, 1.0)
    assert gscale.item() == pytest.approx(min(1.0, 1.0 / (ref + 1e-6)), rel=1e-5) and found_inf.item() == 0.0
    gscale, _ = clip_coefficient(norm, 1e9)
    assert gscale.item() == 1.0
    grads[2][5] = float("inf")
    assert clip_coefficient(grad_norm(grads), 1.0)[1].item() == 1.0


def test_grad_norm_mixed_dtypes_through_the_cuda_dispatch(monkeypatch):
    """The CUDA op takes one dtype per call (its CPU reference rejects a mixed list as the kernel does): grad_norm and
    FusedAdamW(max_grad_norm=...) group fp32 and bf16 grads by dtype on the CUDA path, as on the Triton one."""
    import importlib

    from llmpar.optim import FusedAdamW

    grad_norm_mod = importlib.import_module("llmpar.ops.grad_norm")  # the package exports a function of that name

    with pytest.raises(TypeError, match="mix dtypes"):
        torch.ops.llmpar.sum_squares([torch.ones(3), torch.ones(3, dtype=torch.bfloat16)])
    calls = []
    real = torch.ops.llmpar.sum_squares

    def sum_squares(tensors):
        calls.append({t.dtype for t in tensors})
        return real(tensors)

    monkeypatch.setattr(grad_norm_mod, "select_backend", lambda device, **kw: "cuda")
    monkeypatch.setattr(torch.ops.llmpar, "sum_squares", sum_squares)
    g = torch.Generator().manual_seed(5)
    grads = [
        torch.randn(s, generator=g, dtype=torch.float64).to(dt)
        for s, dt in (((7,), torch.float32), ((4097,), torch.bfloat16), ((3, 5), torch.float32), ((9,), torch.bfloat16))
    ]
    ref = math.sqrt(sum(float((t.double() ** 2).sum()) for t in grads))
    assert abs(grad_norm(grads).item() - ref) <= 1e-5 * ref
    assert sorted(map(str, calls)) == [str({torch.bfloat16}), str({torch.float32})]
    params = [torch.nn.Parameter(t.clone()) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t * 10
    calls.clear()
    opt = FusedAdamW(params, lr=1e-3, max_grad_norm=1.0)
    opt.step()
    assert len(calls) == 2 and abs(opt.last_grad_norm.item() - 10 * ref) <= 1e-4 * ref
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)


def test_zero_betas_and_found_inf_counts(backend):
    """beta1 = 0 or beta2 = 0 are valid AdamW (1 - 0**t = 1); a found_inf of any nonzero value skips the step and
    leaves the step counts alone (it is a flag, not a count)."""
    for beta1, beta2 in ((0.0, 0.999), (0.9, 0.0)):
        st = make_state("fp32", SIZES[:4])
        before = snapshot(st)
        run("fp32", st, beta1=beta1, beta2=beta2)
        hyper = dict(HYPER, beta1=beta1, beta2=beta2)
        for i in range(4):
            inputs = (before["p"][i], before["g"][i], before["m"][i], before["v"][i], 5.0)
            assert_within_2x_plain(st["p"][i], inputs, i, 0, **hyper)
    for precision in ("fp32", "bf16_sr"):
        st = make_state(precision, SIZES[:3])
        before = snapshot(st)
        run(precision, st, found_inf=torch.tensor(3.0, device=DEVICE))
        for k in ("p", "s"):
            for a, b in zip(st[k], before[k]):
                assert torch.equal(a, b), f"{k} changed although found_inf=3"


def test_bad_inputs_name_the_argument(monkeypatch):
    st = make_state("fp32", SIZES[:2])
    with pytest.raises(ValueError, match="precision='fp16' is not a mode"):
        run("fp16", st)
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.float32; precision='bf16_sr'"):
        run("bf16_sr", st)
    with pytest.raises(ValueError, match="needs extras="):
        adamw_step(st["p"], st["g"], st["m"], st["v"], st["s"], precision="fp32_master", **HYPER)
    with pytest.raises(ValueError, match=r"grads has 1 tensors but params has 2"):
        adamw_step(st["p"], st["g"][:1], st["m"], st["v"], st["s"], precision="fp32", **HYPER)
    with pytest.raises(ValueError, match="max_norm must be a positive"):
        clip_coefficient(torch.tensor(1.0), -1.0)
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="LLMPAR_BACKEND=cuda but the cuda backend cannot run adamw_step"):
        run("fp32", make_state("fp32", SIZES[:2])) if DEVICE.type == "cpu" else pytest.skip("GPU present")


@pytest.mark.skipif(
    "triton" not in BACKENDS, reason="Triton cannot run here (tests/test_optim_triton.py interprets it)"
)
def test_multi_tensor_table_names_each_programs_tensor_triton():
    """The table both AdamW kernels and the grad-norm pass index (kernels/multi_tensor.py): every program finds the
    tensor whose blocks it runs, the last one starting at or before it, so empty tensors (no program of their own) are
    passed over, and each tensor's blocks are run by exactly its programs."""
    from llmpar.kernels import multi_tensor

    numels, block = [5, 0, 1, 2049, 0, 0, 1024, 3, 4097], 1024
    first, programs = multi_tensor.first_programs(numels, block)
    blocks = [-(-k // block) for k in numels]
    assert first == [sum(blocks[:t]) for t in range(len(numels))] and programs == sum(blocks) == 12
    table = multi_tensor.table_to_device(first, DEVICE, "test")
    owners = torch.full((programs,), -1, dtype=torch.int64, device=DEVICE)
    _owners_kernel[(programs,)](table, len(numels), owners)
    got = owners.cpu().tolist()
    assert got == [bisect.bisect_right(first, pid) - 1 for pid in range(programs)]
    assert got == [t for t, b in enumerate(blocks) for _ in range(b)]
