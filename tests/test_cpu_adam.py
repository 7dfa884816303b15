"""llmpar.ops.cpu_adamw_step and its C++ kernel (csrc/cpu/, the CPU extension): the host step of ZeRO-Offload.

- numerics against float64 math on random data (never zeros) of odd sizes in one call, several steps, weight decay,
  bias correction, a grad scale and both branches of the m lerp: fp32 tolerances, and at most ~2x the error of
  torch's fused CPU AdamW; every ISA (AVX-512, AVX2, scalar) gives the same bits; the torch path agrees
- the copies written in the same pass (``outs``) equal ``param.to(dtype)`` bit for bit (round to nearest even), on
  ties, subnormals, overflow, inf and NaN too
- found_inf skips; opcheck; bad inputs raise ValueError / TypeError naming the argument before anything changes
- the extension: torch-free kernels, one registration point, portable flags, a stale lock does not hang the build,
  the fallback to torch (one log line)
- ZeRO-Offload on CPU ranks: the step with the kernel equals the torch path; bf16 params are exactly the masters'
  rounding
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llmpar.ops import _cpu_ext, _ext
from llmpar.ops._library import CPU_OPS
from llmpar.ops.cpu_adam import ISAS as ALL_ISAS
from llmpar.ops.cpu_adam import cpu_adamw_step, cpu_backend, isa_code

from multirank import run_ranks

ISAS = ALL_ISAS[:3]  # the fp32 kernel has no VBMI build: under avx512vbmi it runs the AVX-512 one

ROOT = Path(__file__).resolve().parents[1]
CPU_SRC = ROOT / "csrc" / "cpu"
SIZES = (5, 123, 4097, 1_000_003)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def kernel():
    status = _cpu_ext.load()
    if not status.available:
        why = _cpu_ext.jit_unavailable_reason()
        if why is None:  # a compiler and ninja are here: the build must work
            pytest.fail(f"the CPU extension did not build: {status.reason}")
        pytest.skip(f"no CPU extension: {status.reason}")
    return status


def _rand(n, *, seed, scale=1.0, positive=False, dtype=torch.float32):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    x = torch.where(x == 0, torch.full_like(x, 0.5 * scale), x)
    return (x.abs() + 0.1 * scale if positive else x).to(dtype)


def _state(sizes=SIZES, seed=0):
    """params, grads, exp_avgs, exp_avg_sqs (float32) and steps (3.0, 4.0, ...), one per size."""
    p = [_rand(n, seed=seed + 10 * i) for i, n in enumerate(sizes)]
    g = [_rand(n, seed=seed + 10 * i + 1) for i, n in enumerate(sizes)]
    m = [_rand(n, seed=seed + 10 * i + 2, scale=0.1) for i, n in enumerate(sizes)]
    v = [_rand(n, seed=seed + 10 * i + 3, positive=True) for i, n in enumerate(sizes)]
    s = [torch.tensor(3.0 + i) for i in range(len(sizes))]
    return p, g, m, v, s


def _clone(state):
    return tuple([t.clone() for t in lst] for lst in state)


def _reference(state, steps, *, lr, beta1, beta2, eps, weight_decay, gscale):
    """The AdamW math in float64 from the same float32 start (torch.optim.AdamW's, decoupled weight decay)."""
    p, g, m, v, s = ([t.double() for t in lst] for lst in state)
    for _ in range(steps):
        for i in range(len(p)):
            t = float(s[i]) + 1
            s[i] = torch.tensor(t, dtype=torch.float64)
            gi = g[i] * gscale
            p[i] = p[i] * (1 - lr * weight_decay)
            m[i] = m[i] + (1 - beta1) * (gi - m[i])
            v[i] = beta2 * v[i] + (1 - beta2) * gi * gi
            p[i] = p[i] - lr / (1 - beta1**t) * m[i] / (v[i].sqrt() / (1 - beta2**t) ** 0.5 + eps)
    return p, m, v


def _rel_err(got, want):
    return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want))


@pytest.mark.parametrize(
    "beta1, gscale, out_dtype",
    [(0.9, 0.37, torch.bfloat16), (0.3, 1.0, None), (0.0, 2.5, torch.float16), (0.9, 1.0, torch.float32)],
)
def test_matches_float64_reference(kernel, beta1, gscale, out_dtype):
    """beta1 0.3: torch's lerp takes its other branch (weight >= 0.5); beta1 0: no first-moment bias correction."""
    hyper = {**HYPER, "beta1": beta1}
    state = _state()
    p, g, m, v, s = _clone(state)
    outs = None if out_dtype is None else [torch.empty(n, dtype=out_dtype) for n in SIZES]
    for _ in range(3):
        assert cpu_adamw_step(p, g, m, v, s, gscale=gscale, outs=outs, **hyper)
    want_p, want_m, want_v = _reference(state, 3, gscale=gscale, **hyper)
    assert [float(t) for t in s] == [6.0, 7.0, 8.0, 9.0]
    assert _rel_err(p, want_p) < 1e-6 and _rel_err(m, want_m) < 1e-6 and _rel_err(v, want_v) < 1e-6
    # at most ~2x the error of torch's fused CPU AdamW on the same data (it divides by 1 / gscale)
    tp, tg, tm, tv, ts = _clone(state)
    for _ in range(3):
        torch._foreach_add_(ts, 1.0)
        torch._fused_adamw_(
            tp,
            [x.clone() for x in tg],
            tm,
            tv,
            [],
            ts,
            lr=hyper["lr"],
            beta1=beta1,
            beta2=hyper["beta2"],
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            amsgrad=False,
            maximize=False,
            grad_scale=torch.tensor(1 / gscale),
        )
    for ours, theirs, want in ((p, tp, want_p), (m, tm, want_m), (v, tv, want_v)):
        assert _rel_err(ours, want) <= 2 * _rel_err(theirs, want) + 1e-8
    if outs is not None:
        for o, t in zip(outs, p):
            assert torch.equal(o, t.to(out_dtype))
    assert all(torch.equal(a, b) for a, b in zip(g, state[1])), "the kernel only reads the grads"


def _edge_values() -> torch.Tensor:
    """float32 values where rounding is delicate: bf16 and fp16 ties either way, fp16 overflow (65520 is a tie to
    inf) and subnormals (2^-25 a tie to 0), float32 subnormals, signed zeros, inf, NaN, and random bit patterns."""
    g = torch.Generator().manual_seed(7)
    hi = torch.randint(0, 1 << 16, (4000,), generator=g, dtype=torch.int64) << 16
    ties = torch.cat([hi | 0x8000, hi | 0x7FFF, hi | 0x8001, (hi | 0x10000) & 0xFFFF0000 | 0x8000])
    rand = torch.randint(0, 1 << 32, (20000,), generator=g, dtype=torch.int64)
    bits = torch.cat([ties, rand]).to(torch.int64)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    special = [
        65504.0,
        65519.996,
        65520.0,
        65535.0,
        65536.0,
        2.0**-14,
        2.0**-24,
        2.0**-25,
        1.5 * 2.0**-25,
        3 * 2.0**-26,
        2.0**-24 * 2.5,
        2.0**-24 * 3.5,
        1e-40,
        -1e-45,
        3.4e38,
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-9,
        1.0 + 2.0**-11,
    ]
    sp = torch.tensor(special, dtype=torch.float32)
    fp16_sub = torch.arange(1, 3000, dtype=torch.float64) * 2.0**-26  # every fp16 subnormal tie and between
    return torch.cat([bits, sp, -sp, fp16_sub.float(), -fp16_sub.float()])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_outs_round_to_nearest_even_like_torch(kernel, monkeypatch, isa, out_dtype):
    """lr = 0, weight_decay = 0 and m > 0 leave every param as it is (p + (-0 * m) / denom = p, -0.0 included; NaN
    stays NaN), so ``outs`` is the rounding of the values above, to compare with torch's own conversion."""
    monkeypatch.setenv("LLMPAR_CPU_ISA", isa)
    p = _edge_values()
    n = p.numel()
    before = p.clone()
    out = torch.empty(n, dtype=out_dtype)
    assert cpu_adamw_step(
        [p],
        [_rand(n, seed=1)],
        [_rand(n, seed=2, positive=True)],
        [_rand(n, seed=3, positive=True)],
        [torch.tensor(0.0)],
        outs=[out],
        **{**HYPER, "lr": 0.0, "weight_decay": 0.0},
    )
    num = ~before.isnan()  # (a signalling NaN comes out quiet)
    assert torch.equal(p[num].view(torch.int32), before[num].view(torch.int32)) and p[~num].isnan().all()
    want = before.to(out_dtype)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[out_dtype]
    assert torch.equal(out[~nan].view(bits), want[~nan].view(bits)), f"{isa}: rounding differs from torch"


def test_every_isa_gives_the_same_bits(kernel, monkeypatch):
    results = {}
    for isa in ISAS:
        monkeypatch.setenv("LLMPAR_CPU_ISA", isa)
        p, g, m, v, s = _clone(_state(seed=5))
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        for _ in range(2):
            cpu_adamw_step(p, g, m, v, s, gscale=0.5, outs=outs, **HYPER)
        results[isa] = (p, m, v, outs)
    for isa in ISAS[:-1]:
        for got, want in zip(results[isa], results[ISAS[-1]]):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{isa} differs from {ISAS[-1]}"
    monkeypatch.setenv("LLMPAR_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="LLMPAR_CPU_ISA='sse9' is not an instruction set"):
        isa_code()


@pytest.mark.parametrize("isa", ISAS[1:])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_streamed_outs_of_a_large_call(kernel, monkeypatch, isa, out_dtype):
    """From 2^21 elements a call writes the outs with streaming stores, from the first address aligned to a whole
    vector of them (a head before it, a tail after): outs that start off that alignment, the same results."""
    monkeypatch.setenv("LLMPAR_CPU_ISA", isa)
    sizes = (3, 2_100_001, 77)
    state = _state(sizes=sizes, seed=6)
    p, g, m, v, s = _clone(state)
    outs = [torch.empty(n + k, dtype=out_dtype)[k:] for n, k in zip(sizes, (1, 3, 5))]
    cpu_adamw_step(p, g, m, v, s, outs=outs, **HYPER)
    p2, g2, m2, v2, s2 = _clone(state)
    cpu_adamw_step(p2, g2, m2, v2, s2, **HYPER)
    for got, want in ((p, p2), (m, m2), (v, v2)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    for o, t in zip(outs, p):
        assert torch.equal(o, t.to(out_dtype))


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_kernel_matches_torch_path_and_found_inf_skips(kernel, monkeypatch, found):
    runs = {}
    for backend in ("cpp", "torch"):
        monkeypatch.setenv("LLMPAR_BACKEND", "torch" if backend == "torch" else "auto")
        assert cpu_backend() == backend
        p, g, m, v, s = _clone(_state(sizes=(5, 4097, 123), seed=3))
        outs = [torch.empty(t.numel(), dtype=torch.bfloat16) for t in p]
        sentinel = [o.fill_(7.0).clone() for o in outs]
        for _ in range(3):
            applied = cpu_adamw_step(
                p, g, m, v, s, gscale=torch.tensor(0.8), found_inf=torch.tensor(found), outs=outs, **HYPER
            )
            assert applied == (found == 0)
        runs[backend] = (p, m, v, s, outs, sentinel)
    if found:
        start = _state(sizes=(5, 4097, 123), seed=3)
        for p, m, v, s, outs, sentinel in runs.values():  # nothing changed, nothing written, no step counted
            for got, want in ((p, start[0]), (m, start[2]), (v, start[3]), (s, start[4]), (outs, sentinel)):
                assert all(torch.equal(a, b) for a, b in zip(got, want))
        return
    cpp, ref = runs["cpp"], runs["torch"]
    for got, want in zip(cpp[:3], ref[:3]):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    assert [float(t) for t in cpp[3]] == [float(t) for t in ref[3]] == [6.0, 7.0, 8.0]
    for outs, params in ((cpp[4], cpp[0]), (ref[4], ref[0])):
        assert all(torch.equal(o, t.bfloat16()) for o, t in zip(outs, params))


def _op_args(out_dtype):
    shapes = [(5,), (3, 41), (123,)]
    p, g, m, v, s = _state(sizes=[torch.Size(x).numel() for x in shapes], seed=9)
    p, g, m, v = ([t.view(shape) for t, shape in zip(lst, shapes)] for lst in (p, g, m, v))
    outs = [] if out_dtype is None else [torch.empty(shape, dtype=out_dtype) for shape in shapes]
    return (p, g, m, v, outs, s, 1e-2, 0.9, 0.999, 1e-8, 0.1, 0.7, isa_code())


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_opcheck(kernel, out_dtype):
    torch.library.opcheck(torch.ops.llmpar.cpu_adamw_step.default, _op_args(out_dtype))


def _bad_inputs():
    """(case, mutate(p, g, m, v, s, outs) -> the new lists, error type, message pattern)."""

    def swap(lst, i, t):
        return lst[:i] + [t] + lst[i + 1 :]

    return [
        (
            "param dtype",
            lambda p, g, m, v, s, o: (swap(p, 1, p[1].double()), g, m, v, s, o),
            TypeError,
            r"params\[1\] has dtype",
        ),
        (
            "grad numel",
            lambda p, g, m, v, s, o: (p, swap(g, 0, g[0][:4]), m, v, s, o),
            ValueError,
            r"grads\[0\] has 4 elements, params\[0\] 5",
        ),
        (
            "non-contiguous",
            lambda p, g, m, v, s, o: (p, g, m, swap(v, 2, torch.rand(246)[::2]), s, o),
            ValueError,
            r"exp_avg_sqs\[2\] is not contiguous",
        ),
        (
            "out dtype",
            lambda p, g, m, v, s, o: (p, g, m, v, s, swap(o, 0, o[0].int())),
            TypeError,
            r"outs\[0\] has dtype",
        ),
        (
            "outs mix dtypes",
            lambda p, g, m, v, s, o: (p, g, m, v, s, swap(o, 2, o[2].half())),
            TypeError,
            r"outs\[2\] has dtype",
        ),
        (
            "step dtype",
            lambda p, g, m, v, s, o: (p, g, m, v, swap(s, 1, s[1].double()), o),
            TypeError,
            r"steps\[1\] must be a float32 scalar",
        ),
        (
            "list length",
            lambda p, g, m, v, s, o: (p, g[:2], m, v, s, o),
            ValueError,
            r"grads has 2 tensors but params has 3",
        ),
        (
            "outs length",
            lambda p, g, m, v, s, o: (p, g, m, v, s, o[:1]),
            ValueError,
            r"outs has 1 tensors; give none or one per param \(3\)",
        ),
    ]


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("case, mutate, error, pattern", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_name_the_argument(kernel, monkeypatch, backend, case, mutate, error, pattern):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch" if backend == "torch" else "auto")
    p, g, m, v, s = _state(sizes=(5, 41, 123), seed=4)
    outs = [torch.empty(t.numel(), dtype=torch.bfloat16) for t in p]
    p, g, m, v, s, outs = mutate(p, g, m, v, s, outs)
    before = [t.clone() for t in p + s]
    with pytest.raises(error, match=pattern):
        cpu_adamw_step(p, g, m, v, s, outs=outs, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(p + s, before)), "a rejected call changed something"


# ------------------------------------------------------------------------------------------------- the extension


def test_kernels_are_torch_free_and_ops_register_once():
    """Kernel sources include no torch header; only the bindings (``*_ops.cpp``) do, and they register CPU impls of
    the ops ``_library.py`` defines, each once, and define none."""
    kernels = [p for p in CPU_SRC.iterdir() if p.suffix in (".h", ".cpp") and not p.name.endswith("_ops.cpp")]
    assert {p.name for p in kernels} >= {"adam.h", "adam_impl.h", "adam_scalar.cpp", "adam_avx2.cpp", "adam_avx512.cpp"}
    for src in kernels:
        assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", src.read_text()), f"{src.name} includes torch"
    impls = []
    for binding in sorted(CPU_SRC.glob("*_ops.cpp")):
        ops = binding.read_text()
        for banned in ("TORCH_LIBRARY(", "TORCH_LIBRARY_FRAGMENT(", "m.def(", "TORCH_LIBRARY_IMPL(llmpar, Meta"):
            assert banned not in ops, f"{binding.name} has {banned!r}: define ops in llmpar/ops/_library.py"
        assert set(re.findall(r"TORCH_LIBRARY_IMPL\((\w+), (\w+), m\)", ops)) == {("llmpar", "CPU")}, binding.name
        impls += re.findall(r'm\.impl\(\s*"(\w+)"', ops)
    assert sorted(impls) == sorted(CPU_OPS)


def test_build_config_is_portable_and_shipped():
    cfg = _ext.build_config()
    kw = cfg.cpu_extension_kwargs(ROOT / "csrc", relative_to=ROOT)
    assert sorted(kw["sources"]) == sorted(f"csrc/cpu/{p.name}" for p in CPU_SRC.glob("*.cpp"))
    flags = kw["extra_compile_args"]["cxx"]
    assert "-O3" in flags and "-ffp-contract=off" in flags and "-fopenmp" in flags
    assert not any(f.startswith(("-march", "-mavx", "-mtune", "-ffast-math")) for f in flags), "must run anywhere"
    assert not any("/cpu/" in s for s in cfg.extension_kwargs(ROOT / "csrc", relative_to=ROOT)["sources"])
    setup = (ROOT / "setup.py").read_text()
    assert '"cpu/*.cpp"' in setup and '"cpu/*.h"' in setup and "LLMPAR_BUILD_CPU" in setup


def test_stale_torch_lock_does_not_hang_the_build(kernel):
    """A build killed midway leaves torch's ``lock`` file, on which every later cpp_extension.load would wait."""
    folder = _cpu_ext.build_dir()
    (folder / "lock").write_text("")
    code = (
        "from llmpar.ops import _cpu_ext\ns = _cpu_ext._jit_build()\nassert s.available, s\nassert _cpu_ext.loaded()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (folder / "lock").exists()


def test_unavailable_extension_falls_back_with_one_log_line(kernel, monkeypatch, caplog):
    monkeypatch.setattr(_ext, "prebuilt_status", lambda *a: None)
    monkeypatch.setenv("LLMPAR_NO_JIT", "1")
    _cpu_ext._load_once.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="llmpar"):
            assert not _cpu_ext.load().available
            assert not _cpu_ext.load().available
            assert cpu_backend() == "torch"
        lines = [r.getMessage() for r in caplog.records if "CPU AdamW kernel is unavailable" in r.getMessage()]
        assert len(lines) == 1 and "LLMPAR_NO_JIT=1" in lines[0]
        p, g, m, v, s = _state(sizes=(5, 123), seed=2)
        out = [torch.empty(5, dtype=torch.bfloat16), torch.empty(123, dtype=torch.bfloat16)]
        assert cpu_adamw_step(p, g, m, v, s, outs=out, **HYPER)
        assert all(torch.equal(o, t.bfloat16()) for o, t in zip(out, p))
    finally:
        monkeypatch.undo()
        _cpu_ext._load_once.cache_clear()
        assert _cpu_ext.load().available


# --------------------------------------------------------------------------------------------- the ZeRO step


def zero_offload_body(backend: str, dtype: torch.dtype, stage: int):
    """3 steps of ZeroOptimizer with offload_optimizer on these ranks; returns params, masters, cpu_backend()."""
    import os

    from llmpar.zero import OptimizerConfig, ZeroConfig, ZeroOptimizer

    os.environ["LLMPAR_BACKEND"] = backend
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.Tanh(), torch.nn.Linear(53, 11)).to(dtype)
        named = list(net.named_parameters())
        opt = ZeroOptimizer(
            [{"params": named}],
            OptimizerConfig(lr=2e-2, weight_decay=0.1),
            dist.group.WORLD,
            module=net if stage == 3 else None,
            zero_config=ZeroConfig(
                stage=stage, reduce_bucket_size=500, allgather_bucket_size=500, offload_optimizer={"device": "cpu"}
            ),
            max_grad_norm=0.5,
        )
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            x, y = torch.randn(6, 37, generator=g).to(dtype), torch.randn(6, 11, generator=g).to(dtype)
            ((net(x) - y) ** 2).mean().backward()
            assert opt.step()
        masters = torch.cat([b.state["master"] for b in opt.buffers])
        shards = torch.cat([torch.cat(opt._shards(b)) for b in opt.buffers])
        exact = torch.equal(shards, masters.to(dtype))  # the params: the masters rounded to nearest
        params = torch.cat([p.detach().double().flatten() for p in net.parameters()]) if stage < 3 else shards
        return params, masters, exact, cpu_backend()
    finally:
        os.environ.pop("LLMPAR_BACKEND")


@pytest.mark.parametrize("dtype, stage", [(torch.float32, 2), (torch.bfloat16, 2), (torch.bfloat16, 3)])
def test_zero_offload_step_kernel_equals_torch_path(kernel, dtype, stage):
    cpp = run_ranks(zero_offload_body, 2, "auto", dtype, stage, timeout=120)
    ref = run_ranks(zero_offload_body, 2, "torch", dtype, stage, timeout=120)
    for rank, ((params, masters, exact, used), (rparams, rmasters, rexact, rused)) in enumerate(zip(cpp, ref)):
        assert (used, rused) == ("cpp", "torch")
        assert exact and rexact, f"rank {rank}: params are not the masters rounded"
        torch.testing.assert_close(masters, rmasters, rtol=1e-5, atol=1e-6, msg=f"rank {rank} masters")
        if dtype == torch.float32:
            torch.testing.assert_close(params, rparams, rtol=1e-5, atol=1e-6, msg=f"rank {rank} params")
        else:  # an ulp of difference in a master may move its bf16 rounding by one bf16 ulp
            torch.testing.assert_close(params.double(), rparams.double(), rtol=1e-2, atol=1e-2)
