"""The grouped GEMM kernels (llmpar.kernels.grouped_gemm) as the first GPU will compile them, on a machine without one.

Each launcher runs on CPU tensors with the kernel swapped for a recorder; the recorded arguments go through Triton's
own binder (tests/triton_aot.py), so constants and 16-byte divisibility hints are those of a real launch. Every config
of the architecture's table, in bf16, either is pruned by ``smem_bound`` or compiles within that bound and the
device's shared memory, and the configs the autotuner keeps are exactly those: on sm_90 for every variant but the
plain forward (its bound and tiles are the weight grad's), on sm_80 for the variant with the most shared memory (the
SwiGLU keeping [g, u]) and the weight grad. fp32 compiles (sm_90) with the first config it keeps; every 2-D tile
offset is int64. (Each compile takes ~1 s: the sweep is cut to what differs.)
"""

from __future__ import annotations

import pytest
import torch
from test_gemm_compile import assert_int64_tile_offsets
from triton_aot import SMEM_LIMIT, Recorder, compile_like_launcher

from llmpar.kernels import grouped_gemm as gg

if gg.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: kernels are interpreted in this process", allow_module_level=True)

VARIANTS = ("plain", "swiglu", "swiglu_kept", "swiglu_backward", "wgrad")
TABLES = {80: gg.AMPERE_CONFIGS, 90: gg.HOPPER_CONFIGS}
_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K")


def launch_of(variant: str, dtype: torch.dtype) -> tuple[object, tuple, dict]:
    """(kernel, args, kwargs) of the launch the launcher makes for ``variant`` (CPU tensors, odd group sizes)."""
    g = torch.Generator().manual_seed(0)
    counts = [0, 100, 37, 0, 163]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    m, k, n = sum(counts), 256, 384
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(len(counts), 2 * n, k, generator=g).to(dtype).transpose(1, 2)
    rec = Recorder()
    name = "_grouped_wgrad_kernel" if variant == "wgrad" else "_grouped_mm_kernel"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gg, name, rec)
        if variant == "wgrad":
            gg.grouped_wgrad(torch.randn(m, 2 * n).to(dtype), x, offs, torch.empty(len(counts), 2 * n, k, dtype=dtype))
        elif variant == "plain":
            gg.grouped_mm(x, w, offs, torch.empty(m, 2 * n, dtype=dtype))
        elif variant in ("swiglu", "swiglu_kept"):
            pre = torch.empty(m, 2 * n, dtype=dtype) if variant == "swiglu_kept" else None
            gg.grouped_mm(x, w, offs, torch.empty(m, n, dtype=dtype), epi=1, pre=pre)
        else:
            dh = torch.randn(m, n).to(dtype)
            gg.grouped_mm(x, w, offs, torch.empty(m, 2 * n, dtype=dtype), epi=2, dh=dh)
    assert len(rec.calls) == 1
    return getattr(gg, name), *rec.calls[0]


def with_config(kwargs: dict, cfg: tuple) -> dict:
    out = {key: v for key, v in kwargs.items() if key not in _TILE}
    out.update(dict(zip(_TILE, cfg[:3])), num_stages=cfg[3], num_warps=cfg[4])
    return out


def _bound(kwargs: dict, cfg: tuple, dtype: torch.dtype) -> int:
    size = torch.tensor([], dtype=dtype).element_size()
    return gg.smem_bound(cfg, size, size, epi=kwargs.get("EPI", 0))


SWEEP = [(90, v) for v in VARIANTS if v != "plain"] + [(80, "swiglu_kept"), (80, "wgrad")]


@pytest.mark.slow(
    reason="compiles every config of the table (4-5, ~1 s each on a quiet machine, cold cache): the only "
    "check before a GPU run that no config the autotuner may pick overflows shared memory"
)
@pytest.mark.parametrize("arch, variant", SWEEP)
def test_every_config_fits_or_is_pruned(monkeypatch, arch, variant):
    kernel, args, kwargs = launch_of(variant, torch.bfloat16)
    limit, kept = SMEM_LIMIT[arch], []
    for cfg in TABLES[arch]:
        bound = _bound(kwargs, cfg, torch.bfloat16)
        if bound > limit:
            continue  # pruned before tuning: never launched
        compiled = compile_like_launcher(kernel, args, with_config(kwargs, cfg), arch=arch)
        assert compiled.metadata.shared <= bound, f"sm_{arch} {cfg}: {compiled.metadata.shared} B > bound {bound} B"
        kept.append(cfg)
    assert kept, f"no sm_{arch} config fits {variant}"
    # the autotuner's pruner keeps exactly these, on a device of this architecture
    monkeypatch.setattr(gg, "smem_limit", lambda device: limit)
    configs = [gg.triton.Config(dict(zip(_TILE, c[:3])), num_stages=c[3], num_warps=c[4]) for c in TABLES[arch]]
    named = {"a_ptr": args[0], "b_ptr": args[1], "c_ptr": args[2]}
    pruned = gg._prune(TABLES[arch], variant == "wgrad")(configs, named, **kwargs)
    assert [(*(c.kwargs[t] for t in _TILE), c.num_stages, c.num_warps) for c in pruned] == kept


@pytest.mark.parametrize("variant", ["swiglu_backward", "wgrad"])  # the most shared memory / the other kernel
def test_fp32_first_config_and_int64_offsets(variant):
    """fp32 (IEEE products: slow to compile, so sm_90 and two variants) with the first config it keeps."""
    kernel, args, kwargs = launch_of(variant, torch.float32)
    cfg = gg.fitting(TABLES[90], SMEM_LIMIT[90], 4, 4, epi=kwargs.get("EPI", 0))[0]
    compiled = compile_like_launcher(kernel, args, with_config(kwargs, cfg), arch=90)
    assert compiled.metadata.shared <= min(_bound(kwargs, cfg, torch.float32), SMEM_LIMIT[90]), cfg
    assert assert_int64_tile_offsets(compiled.asm["ttir"]) >= 3  # A, B and C tiles at least
