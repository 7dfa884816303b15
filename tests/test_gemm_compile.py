"""The fused GEMM kernel (llmpar.kernels.gemm) as the first GPU will compile it, checked on a machine without a GPU.

Every kernel here is compiled from a real launch: the launchers (linear_fwd, linear_bwd_input, linear_bwd_weight) run
on CPU tensors with the kernel swapped for a recorder, and the recorded arguments go through Triton's own binder
(tests/triton_aot.py), so strides equal to 1 become constants and 16-byte divisibility hints are set exactly as on
the GPU. Checked:
  - 64-bit addresses: every offset of a 2-D tile pointer is int64 in the TTIR, and no 32-bit product is widened
    after the fact (k * stride passes 2**31 in a weight gradient over 64k tokens x 32k features);
  - shared memory: every Hopper config x flag variant x dtype either is pruned by the bound of
    kernels/gemm_configs.py or compiles for sm_90 within that bound and within 227 KB; the pruner the autotuner calls
    keeps exactly those, and the autotune key holds every flag.
"""

from __future__ import annotations

import re

import pytest
import torch
from triton_aot import SMEM_LIMIT, Recorder, bind_like_launcher, compile_like_launcher

from llmpar.kernels import gemm, gemm_configs

if gemm.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: kernels are interpreted in this process", allow_module_level=True)

_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
# dtype variant -> (torch dtype, allow_tf32)
DTYPES = {
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
}
VARIANTS = ("fwd_max", "fwd_min", "dgrad", "dgrad_gate", "wgrad_max", "wgrad_min")


def launcher_calls(
    dtype: torch.dtype, tf32: bool, m: int = 256, k: int = 128, n: int = 384, *, misalign: int = 0
) -> dict[str, tuple[tuple, dict]]:
    """variant -> (args, kwargs) of the kernel launch each launcher makes (on CPU tensors). ``misalign``: tensors
    start that many elements into their storage (a ZeRO flat-buffer slice), so no pointer is 16-byte aligned."""
    rec = Recorder()
    g = torch.Generator().manual_seed(0)

    def t(*shape, dt=dtype):
        base = torch.randn(torch.Size(shape).numel() + misalign, generator=g).to(dt)
        return base[misalign:].view(*shape)

    x, w, b, r, y, pre = t(m, k), t(n, k), t(n), t(m, n), t(m, n), t(m, n)
    go, gx, gw, main, gb = t(m, n), t(m, k), t(n, k), t(n, k, dt=torch.float32), t(n, dt=torch.float32)
    launches = {
        "fwd_max": lambda: gemm.linear_fwd(x, w, b, r, y, pre, 1, allow_tf32=tf32),
        "fwd_min": lambda: gemm.linear_fwd(x, w, None, None, y, None, 0, allow_tf32=tf32),
        "dgrad": lambda: gemm.linear_bwd_input(go, w, None, 0, gx, allow_tf32=tf32),
        "dgrad_gate": lambda: gemm.linear_bwd_input(go, w, pre, 1, gx, allow_tf32=tf32),
        "wgrad_max": lambda: gemm.linear_bwd_weight(go, x, pre, 1, main, gb, accumulate=True, allow_tf32=tf32),
        "wgrad_min": lambda: gemm.linear_bwd_weight(go, x, None, 0, gw, None, allow_tf32=tf32),
    }
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm, "_gemm_kernel", rec)
        for name, launch in launches.items():
            rec.calls.clear()
            launch()
            assert len(rec.calls) == 1, name
            out[name] = rec.calls[0]
    return out


def with_config(kwargs: dict, cfg: tuple) -> dict:
    """The launcher's kwargs with an autotune config in place of the interpreter's tile (as the autotuner passes)."""
    bm, bn, bk, g, stages, warps = cfg
    out = {k: v for k, v in kwargs.items() if k not in _TILE}
    out.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_stages=stages, num_warps=warps)
    return out


def bound_of(args: tuple, kwargs: dict, cfg: tuple) -> int:
    named = dict(zip(gemm._gemm_kernel.arg_names, args))
    return gemm_configs.smem_bound(
        cfg,
        named["a_ptr"].element_size(),
        named["b_ptr"].element_size(),
        named["z_ptr"].element_size(),
        gate=kwargs["GATE_ACT"] != 0,
        rowsum=kwargs["ROWSUM"],
    )


# ------------------------------------------------------------------------------------ 64-bit address arithmetic

_LINE = re.compile(r"^\s*(%[\w.#]+) = ([\w.]+) (.*?) : (.*?)(?: loc\(.*)?$")


def assert_int64_tile_offsets(ttir: str) -> int:
    """Every tt.addptr on a 2-D tile of pointers has int64 offsets, and every product feeding one is an int64
    product (a 32-bit product widened afterwards would have overflowed already). Returns the addptrs checked."""
    defs = {}
    for line in ttir.splitlines():
        m = _LINE.match(line)
        if m:
            defs[m.group(1)] = (m.group(2), re.findall(r"%[\w.#]+", m.group(3)), m.group(4), line.strip())
    checked = 0
    for _name, (op, operands, types, line) in defs.items():
        if op != "tt.addptr" or not re.search(r"tensor<\d+x\d+x!tt\.ptr", types):
            continue
        checked += 1
        assert types.rstrip().endswith("xi64>"), f"32-bit offsets on a 2-D tile pointer:\n{line}"
        todo, seen = [operands[1]], set()
        while todo:
            v = todo.pop()
            if v in seen or v not in defs:  # a block argument (loop index, kernel argument)
                continue
            seen.add(v)
            vop, vargs, vtypes, vline = defs[v]
            if vop in ("arith.muli", "arith.addi"):
                assert re.search(r"(^|x)i64>?\s*$", vtypes.strip()), f"32-bit index arithmetic in an offset:\n{vline}"
            if vop == "arith.extsi":  # a widened index: must not be a 32-bit product
                src = defs.get(vargs[0])
                assert src is None or src[0] != "arith.muli", f"a 32-bit product widened to 64 bits:\n{src[3]}"
                continue
            if vop != "tt.addptr":
                todo.extend(vargs)
    return checked


@pytest.mark.parametrize("variant", ["fwd_max", "dgrad_gate", "wgrad_max"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_tile_offsets_are_int64(variant, dtype):
    dt, tf32 = DTYPES[dtype]
    args, kwargs = launcher_calls(dt, tf32)[variant]
    cfg = gemm_configs.HOPPER_CONFIGS[-1]
    kernel = compile_like_launcher(gemm._gemm_kernel, args, with_config(kwargs, cfg), arch=90, cubin=False)
    assert assert_int64_tile_offsets(kernel.asm["ttir"]) >= 3  # A, B and C tiles at least
    assert "tt.divisibility = 16" in kernel.asm["ttir"], "the launcher's 16-byte divisibility hints are missing"


def test_int64_check_catches_a_32bit_product():
    bad = (
        "%a = arith.muli %k0, %stride_ak : i32 loc(#loc1)\n"
        "%b = tt.splat %a : i32 -> tensor<64x64xi32> loc(#loc2)\n"
        "%c = tt.addptr %p, %b : tensor<64x64x!tt.ptr<bf16>>, tensor<64x64xi32> loc(#loc3)\n"
    )
    with pytest.raises(AssertionError, match="32-bit offsets"):
        assert_int64_tile_offsets(bad)
    widened = bad.replace(
        "%b = tt.splat %a : i32 -> tensor<64x64xi32>",
        "%w = arith.extsi %a : i32 to i64\n%b = tt.splat %w : i64 -> tensor<64x64xi64>",
    ).replace("tensor<64x64xi32> loc(#loc3)", "tensor<64x64xi64> loc(#loc3)")
    with pytest.raises(AssertionError, match="widened"):
        assert_int64_tile_offsets(widened)


# ------------------------------------------------------------------------------------------- shared memory


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_hopper_config_fits_or_is_pruned(monkeypatch, dtype, variant):
    dt, tf32 = DTYPES[dtype]
    args, kwargs = launcher_calls(dt, tf32)[variant]
    limit = SMEM_LIMIT[90]
    kept = []
    for cfg in gemm_configs.HOPPER_CONFIGS:
        bound = bound_of(args, kwargs, cfg)
        if bound > limit:
            continue  # pruned before tuning: never launched
        kernel = compile_like_launcher(gemm._gemm_kernel, args, with_config(kwargs, cfg), arch=90)
        shared = kernel.metadata.shared
        assert shared <= bound, f"{cfg}: {shared} B of shared memory > the bound {bound} B"
        kept.append(cfg)
    assert kept, f"no Hopper config fits {dtype} {variant}"
    # the autotuner's pruner keeps exactly these (on a device with Hopper's limit)
    monkeypatch.setattr(gemm, "smem_limit", lambda device: limit)
    configs = [
        gemm.triton.Config(dict(zip(_TILE, c[:4])), num_stages=c[4], num_warps=c[5])
        for c in gemm_configs.HOPPER_CONFIGS
    ]
    named = dict(zip(gemm._gemm_kernel.arg_names, args))
    flags = {k: v for k, v in kwargs.items() if k in gemm_configs.FLAGS}
    pruned = gemm._prune(gemm_configs.HOPPER_CONFIGS)(configs, named, **flags)
    assert [(*(c.kwargs[t] for t in _TILE), c.num_stages, c.num_warps) for c in pruned] == kept


@pytest.mark.parametrize("dtype", ["bf16", "tf32"])
def test_odd_shapes_and_misaligned_pointers_fit(dtype):
    """No divisibility hints (odd sizes, pointers 2 or 4 bytes into a buffer): the largest fitting tile still fits."""
    dt, tf32 = DTYPES[dtype]
    calls = launcher_calls(dt, tf32, 123, 77, 45, misalign=1)
    for variant in ("fwd_max", "dgrad_gate", "wgrad_max"):
        args, kwargs = calls[variant]
        named = dict(zip(gemm._gemm_kernel.arg_names, args))
        assert named["a_ptr"].data_ptr() % 16 != 0
        _, _, attrs, _ = bind_like_launcher(gemm._gemm_kernel, args, kwargs, 90)
        hinted = {gemm._gemm_kernel.arg_names[path[0]] for path, value in attrs.items() if value}
        assert "a_ptr" not in hinted and "M" not in hinted, f"divisibility hints on misaligned / odd values: {hinted}"
        cfg = next(c for c in gemm_configs.HOPPER_CONFIGS if bound_of(args, kwargs, c) <= SMEM_LIMIT[90])
        kernel = compile_like_launcher(gemm._gemm_kernel, args, with_config(kwargs, cfg), arch=90)
        assert kernel.metadata.shared <= bound_of(args, kwargs, cfg), (variant, cfg)


@pytest.mark.parametrize("variant", ["fwd_max", "dgrad", "dgrad_gate", "wgrad_max"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "tf32"])
def test_first_fitting_ampere_config_compiles(dtype, variant):
    dt, tf32 = DTYPES[dtype]
    args, kwargs = launcher_calls(dt, tf32)[variant]
    cfg = next(c for c in gemm_configs.AMPERE_CONFIGS if bound_of(args, kwargs, c) <= SMEM_LIMIT[80])
    kernel = compile_like_launcher(gemm._gemm_kernel, args, with_config(kwargs, cfg), arch=80)
    assert kernel.metadata.shared <= min(bound_of(args, kwargs, cfg), SMEM_LIMIT[80])


def test_autotune_key_holds_every_flag_and_the_limit_switch(monkeypatch):
    assert set(gemm_configs.FLAGS) <= set(gemm_configs.TUNE_KEY)
    flags = {p.name for p in gemm._gemm_kernel.params if p.is_constexpr and p.name not in (*_TILE, "INTERPRETER")}
    assert flags == set(gemm_configs.FLAGS), "a constexpr flag of _gemm_kernel is missing from the autotune key"
    monkeypatch.setattr(gemm, "_TUNED", {})
    tuner = gemm._tuned_kernel("hopper", "dgrad")
    assert list(tuner.keys) == gemm_configs.TUNE_KEY
    table = gemm_configs.HOPPER_CONFIGS
    assert gemm_configs.fitting(table, SMEM_LIMIT[90], 2, 2, 2, gate=False, rowsum=False) == table
    monkeypatch.setenv(gemm_configs.AUTOTUNE_ENV, "2")
    assert gemm_configs.fitting(table, SMEM_LIMIT[90], 4, 4, 4, gate=True, rowsum=True) == [table[6], table[7]]
    monkeypatch.setenv(gemm_configs.AUTOTUNE_ENV, "two")
    with pytest.raises(ValueError, match="LLMPAR_AUTOTUNE_CONFIGS='two' must be a number"):
        gemm_configs.autotune_limit()
