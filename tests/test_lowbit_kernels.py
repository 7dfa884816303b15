"""The fused low-bit AdamW kernels (llmpar/ops/lowbit_kernels.py) against the float64 reference of the contract
(llmpar.ops.lowbit.adamw_lowbit_reference), on random data of odd sizes (5, 123, 4097, 2B+1 and a multi-block one,
all in one call), 8 and 4 bits, float32 params and bf16 params with float32 masters, several steps, a grad scale:
- params (masters) within float32 rounding of the reference (a few ulps of the operands p * decay and the update)
- codes equal to the reference's except where its y lies within 4 float32 ulps of a midpoint (the kernel's m, v and
  absmax are float32, each a rounding from the float64 ones), scales within float32 rounding
- bf16 params exactly the round-to-nearest-even of the kernel's own masters
- found_inf skips everything (steps too); an all-zero block gets the zero code; the odd tail's pad nibble is 0
- CPU: AVX-512 and the scalar build give the same bits; bad inputs raise TypeError naming the argument
- Triton: the same checks under TRITON_INTERPRET=1 (a subprocess, small sizes); the interpreter casts float32 to
  bfloat16 by truncation, but the kernel rounds on the bits itself, so bf16 params are checked exactly there too
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from llmpar.ops import _cpu_ext, lowbit
from llmpar.ops import lowbit_kernels as lk

from interp import INTERPRET, run_interpreted

ROOT = Path(__file__).resolve().parents[1]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
EPS32 = torch.finfo(torch.float32).eps


def sizes(bits: int, small: bool = False) -> tuple[int, ...]:
    b = lowbit.BLOCK[bits]
    return (5, 123, 2 * b + 1) if small else (5, 123, 4097, 2 * b + 1, 150 * b + 77)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_state(ns, bits, *, master: bool, seed=0):
    """Random params / grads / moments (quantized from random data with per-block magnitudes spread over decades;
    block 1 of the 4th tensor all zero, state and grad: the s == 0 path) and steps 3, 4, ..."""
    st = dict(
        params=[], grads=[], masters=[] if master else None, m_codes=[], m_scales=[], v_codes=[], v_scales=[], steps=[]
    )
    for i, n in enumerate(ns):
        g = _gen(seed + 7 * i)
        block = lowbit.BLOCK[bits]
        nb = -(-n // block)
        mag = 10.0 ** (-torch.rand(nb, generator=g) * 4)  # per-block magnitudes 1e-4 .. 1
        spread = mag.repeat_interleave(block)[:n]
        p = torch.randn(n, generator=g)
        grad = torch.randn(n, generator=g) * spread
        m = torch.randn(n, generator=g) * spread * 0.1
        v = torch.rand(n, generator=g) * spread**2 * 0.01
        if i == 3 and nb > 1:
            for x in (grad, m, v):
                x[block : 2 * block] = 0.0
        mc, ms = lowbit.quantize(m, bits, True)
        vc, vs = lowbit.quantize(v, bits, False)
        if master:
            st["masters"].append(p.clone())
            st["params"].append(p.to(torch.bfloat16))
        else:
            st["params"].append(p)
        st["grads"].append(grad)
        st["m_codes"].append(mc)
        st["m_scales"].append(ms)
        st["v_codes"].append(vc)
        st["v_scales"].append(vs)
        st["steps"].append(torch.tensor(float(3 + i)))
    return st


def clone_state(st):
    return {k: (None if v is None else [t.clone() for t in v]) for k, v in st.items()}


def run(fn, st, bits, **kw):
    args = {**HYPER, **kw}
    return fn(
        st["params"],
        st["grads"],
        st["m_codes"],
        st["m_scales"],
        st["v_codes"],
        st["v_scales"],
        st["steps"],
        st["masters"],
        bits=bits,
        qmap_m=lowbit.qmap(bits, True),
        qmap_v=lowbit.qmap(bits, False),
        **args,
    )


def _codes(c, bits, n):
    return c.view(-1) if bits == 8 else lowbit.unpack4(c.view(-1), n)


def check_against_reference(before, after, bits, *, gscale=1.0, zero_block=False):
    """after = the kernel's step from ``before``: compare with the float64 reference, tensor by tensor."""
    for i, p0 in enumerate(before["params"]):
        n = p0.numel()
        master0 = None if before["masters"] is None else before["masters"][i]
        t = int(float(after["steps"][i]))
        assert t == int(float(before["steps"][i])) + 1
        ref = lowbit.adamw_lowbit_reference(
            p0,
            before["grads"][i],
            before["m_codes"][i],
            before["m_scales"][i],
            before["v_codes"][i],
            before["v_scales"][i],
            t,
            master0,
            bits=bits,
            gscale=gscale,
            **HYPER,
        )
        w0 = (master0 if master0 is not None else p0).double() * (1 - HYPER["lr"] * HYPER["weight_decay"])
        w_ref = ref.master if master0 is not None else ref.param
        w = (after["masters"][i] if master0 is not None else after["params"][i]).double()
        # float32 rounding of the operands: p * decay, the update, and m's two terms (they may cancel)
        m0 = lowbit.dequantize(before["m_codes"][i], before["m_scales"][i], bits, True, n, dtype=torch.float64)
        g = before["grads"][i].double() * gscale
        denom = ref.v.sqrt() / (1 - HYPER["beta2"] ** t) ** 0.5 + HYPER["eps"]
        m_ops = (HYPER["beta1"] * m0).abs() + ((1 - HYPER["beta1"]) * g).abs()
        step_size = HYPER["lr"] / (1 - HYPER["beta1"] ** t)
        tol = 4 * EPS32 * (w0.abs() + (w0 - w_ref).abs() + step_size * m_ops / denom)
        bad = (w - w_ref).abs() > tol
        assert not bad.any(), (
            f"tensor {i} (n={n}): {int(bad.sum())} params off, max err "
            f"{((w - w_ref).abs() / tol).max():.2f} x tolerance"
        )
        if master0 is not None:
            assert torch.equal(after["params"][i], after["masters"][i].to(torch.bfloat16)), "bf16 != rn(master)"
        for name, signed, y in (("m", True, ref.y_m), ("v", False, ref.y_v)):
            got = _codes(after[f"{name}_codes"][i], bits, n)
            want = _codes(getattr(ref, f"{name}_codes"), bits, n)
            diff = got != want
            ties = lowbit.near_tie(y, bits, signed, ulps=4.0)
            assert not (diff & ~ties).any(), f"tensor {i} {name}: {int((diff & ~ties).sum())} codes differ off ties"
            assert int(diff.sum()) <= max(2, n // 1000), f"tensor {i} {name}: {int(diff.sum())} tie flips"
            s_got, s_ref = after[f"{name}_scales"][i].double(), getattr(ref, f"{name}_scale").double()
            torch.testing.assert_close(s_got, s_ref, rtol=4 * EPS32, atol=0.0)
            if bits == 4 and n % 2:
                assert int(after[f"{name}_codes"][i].view(-1)[-1]) >> 4 == 0, "pad nibble not 0"
        if zero_block and i == 3 and n > 2 * lowbit.BLOCK[bits]:  # the all-zero block (first step only)
            block = lowbit.BLOCK[bits]
            assert float(after["m_scales"][i][1]) == 0.0 and float(after["v_scales"][i][1]) == 0.0
            zc_m = int(torch.searchsorted(lowbit.midpoints(lowbit.qmap(bits, True)), torch.tensor([0.0])))
            zc_v = int(torch.searchsorted(lowbit.midpoints(lowbit.qmap(bits, False)), torch.tensor([0.0])))
            assert (_codes(after["m_codes"][i], bits, n)[block : 2 * block] == zc_m).all()
            assert (_codes(after["v_codes"][i], bits, n)[block : 2 * block] == zc_v).all()


def steps_against_reference(fn, bits, master, ns, *, nsteps=3, gscale=None):
    st = make_state(ns, bits, master=master)
    for k in range(nsteps):
        before = clone_state(st)
        assert run(fn, st, bits, gscale=gscale) is True
        check_against_reference(before, st, bits, gscale=1.0 if gscale is None else gscale, zero_block=k == 0)
        for i, g in enumerate(st["grads"]):  # fresh grads, the same magnitudes
            st["grads"][i] = g[torch.randperm(g.numel(), generator=_gen(i))]


def found_inf_skips(fn, bits):
    st = make_state(sizes(bits, small=True), bits, master=True)
    before = clone_state(st)
    assert run(fn, st, bits, found_inf=torch.tensor(1.0)) is True
    for k, v in before.items():
        for a, b in zip(v, st[k]):
            assert torch.equal(a, b), f"{k} changed under found_inf"


# ----------------------------------------------------------------------------------------------------- CPU C++


@pytest.fixture(scope="module")
def cpu_kernel():
    status = _cpu_ext.load()
    if not status.available:
        if _cpu_ext.jit_unavailable_reason() is None:
            pytest.fail(f"the CPU extension did not build: {status.reason}")
        pytest.skip(f"no CPU extension: {status.reason}")
    return status


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("master", (False, True), ids=("fp32", "bf16_master"))
def test_cpu_matches_reference(cpu_kernel, bits, master):
    steps_against_reference(lk.cpu_step, bits, master, sizes(bits), gscale=0.37 if master else None)


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
@pytest.mark.parametrize("bits", (8, 4))
def test_cpu_isas_same_bits(cpu_kernel, monkeypatch, bits):
    """Every CPU build gives the scalar build's bits, also where a grad is NaN or inf in a step that is not skipped
    (a block's absmax skips a NaN moment on every build)."""
    st = make_state(sizes(bits), bits, master=True, seed=5)
    b = 3 * lowbit.BLOCK[bits]  # block 3: its largest grad in lane 5 of the first vector, a NaN later in that lane
    st["grads"][4][[b + 5, b + 16 * 5 + 5, 700, 701]] = torch.tensor([1e3, float("nan"), float("inf"), -float("inf")])
    outs = []
    for isa in ("scalar", "avx2", "avx512", "avx512vbmi"):  # (a CPU without one runs the next narrower: the same bits)
        monkeypatch.setenv("LLMPAR_CPU_ISA", isa)
        s = clone_state(st)
        run(lk.cpu_step, s, bits, gscale=0.5)
        outs.append(s)
    for k in outs[0]:
        for o, isa in zip(outs[1:], ("AVX2", "AVX-512", "AVX-512 + VBMI")):
            for a, b in zip(outs[0][k], o[k]):
                bits_of = lambda t: (
                    t.view(torch.int16 if t.element_size() == 2 else torch.int32) if t.is_floating_point() else t
                )
                assert torch.equal(bits_of(a), bits_of(b)), f"{k}: scalar and {isa} builds differ"


def _edge_ys(bits: int, qm: torch.Tensor, qv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y values for m (signed) and v on and around every midpoint: the midpoint, one float32 ulp either side, the
    edges of the 8-bit quantizer's buckets around it (|y|'s bits with the low 16 bits 0 / 0xFFFF, and the next bucket's
    start), both signs for m; +-0, denormals, 2^-24 and the first bucket's end, +-1. All within [-1, 1]."""

    def around(mids):
        hi = mids.abs().view(torch.int32) & ~0xFFFF
        edges = torch.cat([hi, hi | 0xFFFF, hi + 0x10000]).view(torch.float32)
        up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
        return torch.cat([mids, mids.nextafter(up), mids.nextafter(down), edges])

    special = torch.tensor([0.0, 1e-40, 2.0**-24, 2.0**-24 * (1 + 1 / 128), 5.9e-8, 1.0])
    ym = torch.cat([around(lowbit.midpoints(qm)), special])
    ym = torch.cat([ym, -ym])
    yv = torch.cat([around(lowbit.midpoints(qv)).abs(), special])
    return ym[ym.abs() <= 1.0], yv[yv <= 1.0]


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
@pytest.mark.parametrize("bits,custom", ((8, False), (4, False), (8, True)), ids=("8", "4", "8-unbucketed-map"))
def test_cpu_codes_on_midpoints_and_edges(cpu_kernel, monkeypatch, bits, custom):
    """y on and around every midpoint and the 8-bit bucket edges: every CPU build gives the contract's codes exactly
    (the number of midpoints < y). With beta1 = beta2 = 2^-30 (1 - beta rounds to 1.0) and a zero state, m = g and
    v = g * g exactly; each block starts with a 1.0, so s = 1 and y = m (v). Grads for v are square roots of the
    wanted y, so v lands within ulps of the v map's midpoints. custom: a linear 8-bit m map, whose zero midpoint keeps
    it off the bucket tables (the search runs): the same codes."""
    qm = torch.linspace(-1.0, 1.0, 256) if custom else lowbit.qmap(bits, True)
    qv = lowbit.qmap(bits, False)
    ym, yv = _edge_ys(bits, qm, qv)
    block = lowbit.BLOCK[bits]

    def blocks(y):  # a 1.0 first in every block of B - 1 values
        y = torch.cat([y, y.new_zeros(-y.numel() % (block - 1))]).view(-1, block - 1)
        return torch.cat([torch.ones(y.shape[0], 1), y], dim=1).reshape(-1)

    grads = [blocks(ym), blocks(yv).sqrt()]
    hyper = dict(lr=1e-3, beta1=2.0**-30, beta2=2.0**-30, eps=1e-8, weight_decay=0.0)
    for isa in ("scalar", "avx2", "avx512", "avx512vbmi"):
        monkeypatch.setenv("LLMPAR_CPU_ISA", isa)
        st = {k: [] for k in ("m_codes", "m_scales", "v_codes", "v_scales")}
        for g in grads:
            for key, signed in (("m", True), ("v", False)):
                fresh = lowbit.new_state(g.numel(), bits)
                st[f"{key}_codes"].append(fresh["m_codes" if signed else "v_codes"])
                st[f"{key}_scales"].append(fresh["m_scale" if signed else "v_scale"])
        params = [torch.randn(g.numel()) for g in grads]
        lk.cpu_step(
            params,
            grads,
            st["m_codes"],
            st["m_scales"],
            st["v_codes"],
            st["v_scales"],
            [torch.zeros(()) for _ in grads],
            None,
            bits=bits,
            qmap_m=qm,
            qmap_v=qv,
            **hyper,
        )
        for i, g in enumerate(grads):
            assert float(st["m_scales"][i].min()) == 1.0 and float(st["v_scales"][i].min()) == 1.0
            for key, q, yy in (("m", qm, g), ("v", qv, g * g)):  # y = m / 1, v / 1
                got = _codes(st[f"{key}_codes"][i], bits, g.numel()).long()
                expect = torch.searchsorted(lowbit.midpoints(q), yy, side="left")
                bad = (got != expect).nonzero().flatten()
                assert bad.numel() == 0, (
                    f"{isa}: {key} codes differ at y={yy[bad[:5]].tolist()}: "
                    f"{got[bad[:5]].tolist()} != {expect[bad[:5]].tolist()}"
                )


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
def test_cpu_bf16_copies_of_edge_masters(cpu_kernel, monkeypatch):
    """The bf16 params written in the pass are the masters rounded to nearest even, on every CPU build, for masters
    that are denormal (the AVX512-BF16 conversion would flush them: the kernel rounds those lanes itself), +-0, ties
    of bf16 rounding, FLT_MIN / FLT_MAX neighbours, scattered through blocks of ordinary values."""
    special = torch.tensor(
        [
            1e-40,
            -1e-40,
            1.4e-45,
            -2.3e-39,
            0.0,
            -0.0,
            1.1754944e-38,
            -1.1754942e-38,
            3.4e38,
            1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8,
            -(1.0 + 2.0**-8),
            2.0**-126 * (1 + 2.0**-8),
        ]
    )
    n = 3 * 128 + 5
    for isa in ("scalar", "avx2", "avx512", "avx512vbmi"):
        monkeypatch.setenv("LLMPAR_CPU_ISA", isa)
        master = torch.randn(n, generator=_gen(11))
        master[::29][: special.numel()] = special[: master[::29].numel()]
        master[3 : 3 + special.numel()] = special  # several in one vector
        param = master.to(torch.bfloat16)
        grad = torch.randn(n, generator=_gen(12)) * 1e-3
        for bits in (8, 4):
            st = lowbit.new_state(n, bits)
            lk.cpu_step(
                [param],
                [grad],
                [st["m_codes"]],
                [st["m_scale"]],
                [st["v_codes"]],
                [st["v_scale"]],
                [torch.zeros(())],
                [master],
                bits=bits,
                qmap_m=lowbit.qmap(bits, True),
                qmap_v=lowbit.qmap(bits, False),
                lr=0.0,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.0,
            )
            want = master.to(torch.bfloat16)
            assert torch.equal(param.view(torch.int16), want.view(torch.int16)), f"{isa}, {bits} bits"


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
def test_cpu_found_inf_and_dispatch(cpu_kernel, monkeypatch):
    found_inf_skips(lk.cpu_step, 8)
    # adamw_lowbit_step picks the C++ kernel for CPU tensors it takes; the torch path for others (False)
    st = make_state((300,), 4, master=False)
    assert run(lk.adamw_lowbit_step, clone_state(st), 4) is True
    half = clone_state(st)
    half["grads"] = [g.half() for g in half["grads"]]
    assert run(lk.adamw_lowbit_step, half, 4) is False
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    assert run(lk.adamw_lowbit_step, clone_state(st), 4) is False


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
def test_cpu_bad_inputs_name_the_argument(cpu_kernel):
    st = make_state((300,), 8, master=False)
    bad = clone_state(st)
    bad["grads"] = [bad["grads"][0].double()]
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype torch.float64"):
        run(lk.cpu_step, bad, 8)
    with pytest.raises(TypeError, match=r"qmap_m must be float32 \[256\]"):
        lk.cpu_step(
            *[st[k] for k in ("params", "grads", "m_codes", "m_scales", "v_codes", "v_scales", "steps")],
            None,
            bits=8,
            qmap_m=lowbit.qmap(4, True),
            qmap_v=lowbit.qmap(8, False),
            **HYPER,
        )
    bad = clone_state(st)
    bad["m_scales"] = [bad["m_scales"][0][:1].clone()]
    with pytest.raises(ValueError, match=r"m_scales\[0\] has 1 elements; expected 2"):
        run(lk.cpu_step, bad, 8)


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
@pytest.mark.parametrize("bits", (8, 4))
def test_opcheck(cpu_kernel, bits):
    """Schemas, fake impls and the CPU kernels agree (llmpar::cpu_adamw_lowbit_step: the C++ kernel;
    llmpar::adamw_lowbit_step: its CPU impl is the float64 reference written back, what the CUDA kernel is held to)."""
    st = make_state((300, 77), bits, master=True)
    maps = (lowbit.qmap(bits, True), lowbit.qmap(bits, False))
    lists = [st[k] for k in ("m_codes", "m_scales", "v_codes", "v_scales")]
    torch.library.opcheck(
        torch.ops.llmpar.cpu_adamw_lowbit_step.default,
        (st["masters"], st["grads"], *lists, st["params"], *maps, [4, 5], bits, 1e-2, 0.9, 0.999, 1e-8, 0.1, 0.5, 2),
    )
    torch.library.opcheck(
        torch.ops.llmpar.adamw_lowbit_step.default,
        (
            st["params"],
            st["grads"],
            *lists,
            st["masters"],
            st["steps"],
            *maps,
            bits,
            1e-2,
            None,
            torch.tensor(0.5),
            None,
            0.9,
            0.999,
            1e-8,
            0.1,
        ),
    )


# ------------------------------------------------------------------------------------ Triton (interpreter)

needs_interp = pytest.mark.skipif(not INTERPRET, reason="runs under TRITON_INTERPRET=1 (test_triton_interpreted)")


@needs_interp
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("master", (False, True), ids=("fp32", "bf16_master"))
def test_triton_matches_reference(bits, master):
    steps_against_reference(
        lk.triton_step, bits, master, sizes(bits, small=True), nsteps=2, gscale=torch.tensor(0.37) if master else None
    )


@needs_interp
def test_triton_found_inf_and_lr_tensor():
    found_inf_skips(lk.triton_step, 4)
    st = make_state(sizes(8, small=True), 8, master=False)
    a, b = clone_state(st), clone_state(st)
    run(lk.triton_step, a, 8)
    run(lk.triton_step, b, 8, lr=torch.tensor(HYPER["lr"]))
    for k in a:
        for x, y in zip(a[k] or (), b[k] or ()):
            assert torch.equal(x, y), f"{k}: lr as a tensor differs from lr as a float"


@needs_interp
def test_triton_bf16_grads():
    """bf16 grads (the GPU kernels take them): the same step as their float32 values."""
    st = make_state(sizes(4, small=True), 4, master=True)
    st["grads"] = [g.to(torch.bfloat16) for g in st["grads"]]
    before = clone_state(st)
    run(lk.triton_step, st, 4)
    before["grads"] = [g.float() for g in before["grads"]]
    check_against_reference(before, st, 4, zero_block=True)


@pytest.mark.skipif(INTERPRET, reason="launches the interpreted tests")
def test_triton_interpreted():
    from llmpar.kernels import adamw_lowbit as tk

    if not tk.HAS_TRITON:
        pytest.skip(tk.TRITON_IMPORT_ERROR)
    assert tk.BLOCK == lowbit.BLOCK
    run_interpreted(__file__, timeout=900, select="triton and not interpreted", what="interpreted low-bit Triton")


@pytest.mark.skipif(INTERPRET, reason="compiles the real kernel")
@pytest.mark.parametrize(
    "arch, bits, master", [(90, 8, False), (90, 8, True), (90, 4, False), (90, 4, True), (80, 8, True)]
)
def test_triton_compiles_for_gpu(arch, bits, master, monkeypatch):
    """The Triton kernel compiles to sm_90 / sm_80 machine code as its launcher specialises it (tests/triton_aot.py):
    one tensor (n = 1 stays a runtime value), device lr / gscale / found_inf, bf16 grads."""
    from triton_aot import Recorder, bind_like_launcher, compile_like_launcher, specialised

    from llmpar.kernels import adamw_lowbit as tk

    st = make_state((300,), bits, master=master)
    rec = Recorder()
    monkeypatch.setattr(tk, "_adamw_lowbit_kernel", rec)
    flat = {k: (None if v is None else [t.view(-1) for t in v]) for k, v in st.items()}
    tk.step(
        flat["params"],
        [g.to(torch.bfloat16) for g in flat["grads"]],
        flat["m_codes"],
        flat["m_scales"],
        flat["v_codes"],
        flat["v_scales"],
        flat["masters"],
        flat["steps"],
        lowbit.qmap(bits, True),
        lowbit.qmap(bits, False),
        bits=bits,
        lr=torch.tensor(1e-3),
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        gscale=torch.tensor(0.5),
        found_inf=torch.tensor(0.0),
    )
    monkeypatch.undo()
    ((args, kwargs),) = rec.calls
    signature, constexprs, _, _ = bind_like_launcher(tk._adamw_lowbit_kernel, args, kwargs, arch)
    assert "n" not in specialised(signature, constexprs, tk._adamw_lowbit_kernel)
    kernel = compile_like_launcher(tk._adamw_lowbit_kernel, args, kwargs, arch=arch)
    # IEEE like the CUDA twin and the contract: every division and square root rounds to nearest (an approximate one
    # moves codes that sit on a midpoint, so the backends would disagree there)
    ptx = kernel.asm["ptx"]
    approx = sorted(
        set(re.findall(r"\b(div\.full\.\w+|div\.approx\.\w+|sqrt\.approx\.[\w.]+|rcp\.approx\.[\w.]+)", ptx))
    )
    assert not approx, f"approximate ops in the sm_{arch} PTX: {approx}"
    assert re.search(r"\bdiv\.rn\.f32\b", ptx) and re.search(r"\bsqrt\.rn\.f32\b", ptx), "no IEEE div / sqrt found"


# ------------------------------------------------------------------------------------------ GPU (CUDA, Triton)

needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on(st, device):
    return {k: (None if v is None else [t.to(device) for t in v]) for k, v in st.items()}


def _torch_path(*args, qmap_m, qmap_v, **kw):
    """lowbit.adamw_lowbit_step (its maps are its own) with a kernel step's signature."""
    lowbit.adamw_lowbit_step(*args, **kw)
    return True


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ("cuda", "triton"))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("master", (False, True), ids=("fp32", "bf16_master"))
def test_gpu_matches_reference(backend, bits, master):
    from llmpar.ops._dispatch import cuda_unavailable_reason, triton_unavailable_reason

    device = torch.device("cuda")
    why = (
        cuda_unavailable_reason(device, op="adamw_lowbit_step")
        if backend == "cuda"
        else triton_unavailable_reason(device)
    )
    replay = why is not None and why.startswith("CPU replay")  # tests/gpu_replay.py: Triton runs as the torch path
    if why is not None and not replay:
        pytest.fail(f"{backend} cannot run on this GPU machine: {why}")
    fn = lk.cuda_step if backend == "cuda" else _torch_path if replay else lk.triton_step
    gscale = torch.tensor(0.37, device=device) if master else None
    st = make_state(sizes(bits), bits, master=master)
    for k in range(3):
        before = clone_state(st)
        on_gpu = _on(st, device)
        assert run(fn, on_gpu, bits, gscale=gscale) is True
        st = _on(on_gpu, "cpu")
        check_against_reference(before, st, bits, gscale=1.0 if gscale is None else 0.37, zero_block=k == 0)
    on_gpu = _on(st, device)
    frozen = clone_state(on_gpu)
    run(fn, on_gpu, bits, found_inf=torch.tensor(1.0, device=device))
    for name, v in frozen.items():
        for a, b in zip(v or (), on_gpu[name] or ()):
            assert torch.equal(a, b), f"{name} changed under found_inf"
