"""Sources and compiler flags of ``llmpar._C`` and ``llmpar._C_cpu``, shared by setup.py (CUDAExtension,
CppExtension) and the JIT loaders (llmpar/ops/_ext.py, llmpar/ops/_cpu_ext.py).

Torch-free on purpose: setup.py imports it by path before anything of llmpar is importable.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Every csrc/*.cu is a kernel file that compiles with nvcc alone (no torch headers); every csrc/*.cpp is torch-facing
# binding code that adds CUDA kernels with TORCH_LIBRARY_IMPL(llmpar, CUDA, m) (the schemas and fake impls of the ops
# are defined once, in llmpar/ops/_library.py); bucket_ops.cpp also holds the module init and the build info.
# Globbed, so that a new kernel file is built by setup.py and the JIT alike without touching this list.

# No -std flag: torch picks the standard its headers need (c++17 on older torch, c++20 on recent ones) and nvcc rejects
# a second -std. The kernel .cu files stay C++17-clean (tests/test_build_cuda.py compiles them with -std=c++17).
CXX_FLAGS = ["-O3"]
# No --use_fast_math: it implies -ftz=true, which flushes denormal gradients to zero; the kernels only multiply and
# cast, where fast math buys nothing anyway.
NVCC_FLAGS = ["-O3", "-lineinfo"]


def _version_defines() -> list[str]:
    """-D flags recording the torch and CUDA versions built against (read back by llmpar/ops/_ext.py)."""
    try:
        import torch
    except ImportError:
        return []
    # unquoted pp-number tokens (2.14.1, 13.0): they survive the shell that ninja runs commands in
    return [
        f"-DLLMPAR_TORCH_VERSION={torch.__version__.split('+')[0]}",
        f"-DLLMPAR_CUDA_VERSION={torch.version.cuda or 'none'}",
    ]


# csrc/gemm_lt.cpp (cuBLASLt epilogues) needs cublasLt.h; it is built only where the header is found (the CUDA
# toolkit, or the nvidia-cublas wheel that CUDA torch installs). No link flag: it dlopens torch's libcublasLt.
CUBLASLT_SOURCES = ("gemm_lt.cpp",)


def cublaslt_include_dir() -> Path | None:
    """The folder holding cublasLt.h: $CUDA_HOME/include, else the nvidia wheels' include folders; None if absent.

    ``LLMPAR_NO_CUBLASLT=1`` says None (builds the extension without gemm_lt.cpp)."""
    if os.environ.get("LLMPAR_NO_CUBLASLT", "0") == "1":
        return None
    roots = [os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"]
    candidates = [Path(r) / "include" for r in roots]
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        candidates += sorted(Path(base).glob("*/include"))  # nvidia/cu13/include, nvidia/cublas/include
    for folder in candidates:
        if (folder / "cublasLt.h").is_file():
            return folder
    return None


def kernel_sources(csrc_dir: Path) -> list[Path]:
    return sorted(Path(csrc_dir).glob("*.cu"))


def sources(csrc_dir: Path) -> list[Path]:
    """All .cu/.cpp sources of the extension, absolute, in a stable order."""
    cpp = sorted(Path(csrc_dir).glob("*.cpp"))
    if cublaslt_include_dir() is None:
        cpp = [p for p in cpp if p.name not in CUBLASLT_SOURCES]
    return kernel_sources(csrc_dir) + cpp


def extension_kwargs(csrc_dir: Path, relative_to: Path | None = None) -> dict:
    """Keyword arguments for ``CUDAExtension(name=..., **kw)``; llmpar/ops/_ext.py maps them onto ``load()``.

    ``relative_to``: make source paths relative to this folder (setuptools wants paths relative to setup.py).
    """
    csrc_dir = Path(csrc_dir).resolve()
    srcs = sources(csrc_dir)
    if relative_to is not None:
        srcs = [p.relative_to(Path(relative_to).resolve()) for p in srcs]
    cxx = list(CXX_FLAGS) + _version_defines()
    nvcc = list(NVCC_FLAGS)
    if os.environ.get("LLMPAR_PTXAS_VERBOSE"):  # register / spill report per kernel
        nvcc.append("-Xptxas=-v")
    lt_include = cublaslt_include_dir()
    if lt_include is not None:  # searched after the toolkit's own folders (a wheel's cuda_runtime.h must not win)
        cxx += ["-idirafter", str(lt_include)]
    return {
        "sources": [str(p) for p in srcs],
        "include_dirs": [str(csrc_dir)],
        "extra_compile_args": {"cxx": cxx, "nvcc": nvcc},
        # an installed wheel finds libtorch/libc10 and the CUDA runtime wheel next to it even when torch is not
        # imported first (llmpar/_C.so -> site-packages/torch/lib, site-packages/nvidia/cu13/lib)
        "extra_link_args": [
            "-Wl,-rpath,$ORIGIN/../torch/lib",
            "-Wl,-rpath,$ORIGIN/../nvidia/cu13/lib",
            "-Wl,-rpath,$ORIGIN/../nvidia/cuda_runtime/lib",
        ],  # cu12 wheels' layout
    }


# The CPU extension llmpar._C_cpu: csrc/cpu/*.cpp (the vectorised AdamW of the ZeRO-Offload host step), built without
# CUDA. Portable flags: no -march=native (the binary must run on any x86-64 the wheel or the JIT cache lands on); the
# AVX2 / AVX-512 kernels are compiled with target pragmas in their own files and chosen at run time. No contraction of
# a * b + c into FMAs: every ISA then rounds exactly like the others (and like torch's fused CPU AdamW's source).
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers; libgomp.so.1 resolves to the copy torch loaded.
CPU_CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
CPU_LINK_FLAGS = ["-fopenmp"]


def cpu_sources(csrc_dir: Path) -> list[Path]:
    """The .cpp files of llmpar._C_cpu (csrc/cpu/), absolute, sorted."""
    return sorted((Path(csrc_dir) / "cpu").glob("*.cpp"))


def cpu_extension_kwargs(csrc_dir: Path, relative_to: Path | None = None) -> dict:
    """Keyword arguments for ``CppExtension(name="llmpar._C_cpu", **kw)``; llmpar/ops/_cpu_ext.py maps them onto
    ``load()``. ``relative_to``: as in :func:`extension_kwargs`."""
    csrc_dir = Path(csrc_dir).resolve()
    srcs = cpu_sources(csrc_dir)
    if relative_to is not None:
        srcs = [p.relative_to(Path(relative_to).resolve()) for p in srcs]
    return {
        "sources": [str(p) for p in srcs],
        "include_dirs": [str(csrc_dir / "cpu")],
        "extra_compile_args": {"cxx": list(CPU_CXX_FLAGS) + _version_defines()},
        "extra_link_args": list(CPU_LINK_FLAGS) + ["-Wl,-rpath,$ORIGIN/../torch/lib"],
    }
