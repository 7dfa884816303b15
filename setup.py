"""Build llmpar. Pure Python by default; the CUDA extension ``llmpar._C`` is compiled from csrc/ when asked.

Switches (environment variables):
  LLMPAR_BUILD_CUDA=1     compile csrc/ into llmpar._C with torch's CUDAExtension (needs nvcc, no GPU needed).
                          Without it the wheel is pure Python and llmpar JIT-builds the extension on first use
                          when CUDA is present (llmpar/ops/_ext.py).
  LLMPAR_BUILD_CPU=1      compile csrc/cpu/ (the vectorised CPU AdamW of ZeRO-Offload) into llmpar._C_cpu with torch's
                          CppExtension (a C++ compiler, no CUDA). Without it llmpar JIT-builds it on first use
                          (llmpar/ops/_cpu_ext.py; g++ and ninja), or runs torch's fused CPU AdamW.
  TORCH_CUDA_ARCH_LIST    target architectures, default "8.0;9.0" (Ampere and Hopper).
  MAX_JOBS                parallel compile jobs for ninja.
  CUDA_HOME               the toolkit root whose lib64/ (or lib/) holds libcudart.

To build against the torch you already have installed (recommended, the ABI then matches):
  LLMPAR_BUILD_CUDA=1 pip wheel --no-build-isolation .
Plain `LLMPAR_BUILD_CUDA=1 pip wheel .` also works: torch is then added to the isolated build environment.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
BUILD_CUDA = os.environ.get("LLMPAR_BUILD_CUDA", "0").lower() in ("1", "true", "yes", "on")
BUILD_CPU = os.environ.get("LLMPAR_BUILD_CPU", "0").lower() in ("1", "true", "yes", "on")
DEFAULT_ARCHS = "8.0;9.0"

packages = find_packages(include=["llmpar", "llmpar.*"]) + ["llmpar.kernels", "llmpar.csrc"]
package_dir = {"llmpar.kernels": "kernels", "llmpar.csrc": "csrc"}
package_data = {
    "llmpar": ["data/*.txt"],
    # the CUDA sources ship in the wheel so that the extension can be JIT-built on first use
    "llmpar.csrc": ["*.cu", "*.cuh", "*.cpp", "*.h", "cpu/*.cpp", "cpu/*.h"],
}

ext_modules: list = []
cmdclass: dict = {}
setup_requires: list[str] = []

if BUILD_CUDA or BUILD_CPU:
    try:
        import torch  # noqa: F401
    except ImportError:
        # first pass of an isolated PEP 517 build: ask pip for torch, it runs setup.py again with it
        setup_requires = ["torch", "ninja"]
    else:
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

        sys.path.insert(0, str(ROOT / "csrc"))
        # csrc/build_config.py: sources and flags, shared with the JIT loaders
        from build_config import cpu_extension_kwargs, extension_kwargs

        if BUILD_CUDA:
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
            ext_modules.append(CUDAExtension(name="llmpar._C", **extension_kwargs(ROOT / "csrc", relative_to=ROOT)))
        if BUILD_CPU:
            ext_modules.append(
                CppExtension(name="llmpar._C_cpu", **cpu_extension_kwargs(ROOT / "csrc", relative_to=ROOT))
            )
        cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    packages=packages,
    package_dir=package_dir,
    package_data=package_data,
    include_package_data=False,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    setup_requires=setup_requires,
)
