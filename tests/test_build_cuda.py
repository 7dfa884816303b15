"""csrc/ builds: the kernel .cu files compile with nvcc alone (no torch) for sm_80/sm_90; build_config is sane.

The full extension build (torch headers, wheel, cubins, import) is .ci/build_cuda_ext.sh; on a GPU machine
bench/gpu_check.sh builds and runs it.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


def _build_config():
    spec = importlib.util.spec_from_file_location("llmpar_build_config", CSRC / "build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvcc() -> str | None:
    cuda_home = Path("/usr/local/cuda-13.0")
    return shutil.which("nvcc") or (str(cuda_home / "bin/nvcc") if (cuda_home / "bin/nvcc").exists() else None)


def test_extension_kwargs():
    cfg = _build_config()
    kw = cfg.extension_kwargs(CSRC, relative_to=ROOT)
    assert {"csrc/bucket_kernels.cu", "csrc/bucket_ops.cpp"} <= set(kw["sources"])
    assert kw["sources"] == sorted(kw["sources"], key=lambda s: (not s.endswith(".cu"), s))
    assert all((ROOT / s).is_file() for s in kw["sources"])
    flags = kw["extra_compile_args"]
    assert "-O3" in flags["cxx"] and "-O3" in flags["nvcc"]
    assert not any(f.startswith("-std") for f in flags["cxx"] + flags["nvcc"]), "torch chooses the C++ standard"
    assert "--use_fast_math" not in flags["nvcc"], "fast math flushes denormal gradients"
    absolute = cfg.extension_kwargs(CSRC, relative_to=None)
    assert all(Path(s).is_absolute() for s in absolute["sources"])
    assert any("$ORIGIN/../torch/lib" in f for f in kw["extra_link_args"])


def test_kernel_sources_are_torch_free():
    for src in CSRC.glob("*.cu*"):
        text = src.read_text()
        assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", text), f"{src.name} includes torch headers"


def _cuda_kernels(built_only: bool = False) -> set[str]:
    """Op names the csrc/*.cpp files give a CUDA kernel (``m.impl("name", ...)`` inside
    ``TORCH_LIBRARY_IMPL(llmpar, CUDA, m)``); ``built_only``: of the files this machine builds (gemm_lt.cpp needs
    cublasLt.h)."""
    names = set()
    cfg = _build_config()
    for src in CSRC.glob("*.cpp"):
        if built_only and src.name in cfg.CUBLASLT_SOURCES and cfg.cublaslt_include_dir() is None:
            continue
        for block in re.findall(r"TORCH_LIBRARY_IMPL\(llmpar, CUDA, m\)\s*\{(.*?)\n?\}", src.read_text(), re.S):
            names |= set(re.findall(r'm\.impl\(\s*"([A-Za-z_][A-Za-z0-9_]*)"', block))
    return names


def test_schemas_live_in_python_only():
    """csrc/*.cpp define no schema and no Meta/fake impl: llmpar/ops/_library.py is the one registration point, and
    the CUDA kernels of csrc cover exactly its ops."""
    from llmpar.ops._library import OPS

    for src in CSRC.glob("*.cpp"):
        text = src.read_text()
        for banned in ("TORCH_LIBRARY(", "TORCH_LIBRARY_FRAGMENT(", "m.def(", "TORCH_LIBRARY_IMPL(llmpar, Meta"):
            assert banned not in text, f"{src.name} has {banned!r}: define ops in llmpar/ops/_library.py"
        assert set(re.findall(r"TORCH_LIBRARY_IMPL\((\w+), (\w+), m\)", text)) <= {("llmpar", "CUDA")}, src.name
    assert {"pack_bucket", "adamw_step", "linear_lt", "linear_lt_aux", "bias_act_backward"} <= set(OPS)
    assert _cuda_kernels() == set(OPS), (
        f"no CUDA kernel: {set(OPS) - _cuda_kernels()}; no schema: {_cuda_kernels() - set(OPS)}"
    )


def test_ci_build_checks_every_defined_op():
    """.ci/build_cuda_ext.sh imports the built wheel, in both load orders, and requires a CUDA kernel for every op of
    llmpar/ops/_library.py (its OPS table, not a copy of the names)."""
    script = (ROOT / ".ci" / "build_cuda_ext.sh").read_text()
    check = re.search(r"check_import\(\) \{(.*?)\n\}", script, re.S)
    assert check, "check_import of .ci/build_cuda_ext.sh moved: update this test"
    body = check.group(1)
    assert "for order in so_first schemas_first" in body
    assert "for name in _library.OPS:" in body and "_dispatch.has_ext_op(name)" in body and "assert not missing" in body
    assert not re.search(r"'(pack_bucket|adamw_step|linear_lt)'", body), "the script must not list op names itself"


def test_version_marker_matches_loader():
    from llmpar.ops._ext import _MARKER

    text = (CSRC / "bucket_ops.cpp").read_text()
    assert '"LLMPAR_BUILD_INFO torch="' in text and '" cuda="' in text
    assert _MARKER.search(b"..LLMPAR_BUILD_INFO torch=2.14.1 cuda=13.0\x00").groups() == (b"2.14.1", b"13.0")


KERNEL_FILES = sorted(p.name for p in CSRC.glob("*.cu"))


@pytest.fixture(scope="module")
def nvcc_runs(tmp_path_factory):
    """nvcc on every kernel file (sm_90 and sm_80, -std=c++17, warnings are errors, no torch include path), all
    started at once by the first test that asks (each is seconds of one core); {source: (command, process)}."""
    tmp_path = tmp_path_factory.mktemp("nvcc")
    runs = {}
    for source in KERNEL_FILES:
        cmd = [
            _nvcc(),
            "-c",
            "-std=c++17",
            "-O3",
            "-Werror=all-warnings",
            f"-I{CSRC}",
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_80,code=sm_80",
            str(CSRC / source),
            "-o",
            str(tmp_path / source.replace(".cu", ".o")),
        ]
        runs[source] = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    yield runs
    for _, proc in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("source", KERNEL_FILES)
def test_kernels_compile_with_nvcc_alone(nvcc_runs, source):
    cmd, proc = nvcc_runs[source]
    stdout, stderr = proc.communicate(timeout=120)  # a hang fails, speed is not tested
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{stdout}\n{stderr}"
    assert Path(cmd[-1]).stat().st_size > 0


def _jit_prereqs() -> str | None:
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return "CPU-only torch"
    if _nvcc() is None or cpp_extension.CUDA_HOME is None:
        return "nvcc / CUDA_HOME not found"
    if not cpp_extension.is_ninja_available():
        return "ninja missing"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_jit_prereqs() is not None, reason=f"JIT build needs CUDA torch + nvcc + ninja: {_jit_prereqs()}")
def test_jit_build_compiles_and_registers(tmp_path):
    """The JIT fallback (llmpar/ops/_ext.py) builds the shipped sources; no GPU needed to compile and load.

    In a subprocess: a process can hold only one llmpar op library (the wheel's or the JIT one)."""
    import os
    import sys

    code = (
        "import torch\nfrom llmpar.ops import _dispatch, _ext\n_ext.jit_unavailable_reason = lambda: None\n"
        "s = _ext._jit_build()\nassert s.available and s.source == 'jit', s\n"
        f"for name in {sorted(_cuda_kernels(built_only=True))!r}:\n"
        "    assert _dispatch.has_ext_op(name), name\n"
        "    print(getattr(torch.ops.llmpar, name).default._schema)\n"
    )
    env = {**os.environ, "LLMPAR_EXT_CACHE": str(tmp_path), "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in _cuda_kernels(built_only=True):
        assert f"llmpar::{name}(" in proc.stdout, name


# ------------------------------------------------------------------------------------------ CUDA graph capture
_TABLE_OPS = {
    "adamw_ops.cpp": ("adamw_step", "sum_squares"),
    "adamw_lowbit_ops.cpp": ("adamw_lowbit_step",),
    "bucket_ops.cpp": ("pack_bucket", "unpack_bucket"),
    "quant_ops.cpp": ("pack_quantize",),
}


def test_table_ops_refuse_graph_capture():
    """Every op that copies a per-call table from pinned host memory checks the capture status first (a replay would
    read the reused buffer: csrc/capture_check.h): the files that pin memory are exactly those, each includes the
    guard and names its ops in it, and the check runs before the pinned allocation."""
    guard = (CSRC / "capture_check.h").read_text()
    assert "currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None" in guard
    pinning = {p.name for p in CSRC.glob("*.cpp") if "pinned_memory(true)" in p.read_text()}
    assert pinning == set(_TABLE_OPS), pinning
    for name, ops in _TABLE_OPS.items():
        text = (CSRC / name).read_text()
        assert '#include "capture_check.h"' in text, name
        for op in ops:
            assert re.search(rf'llmpar_refuse_capture\([^;]*"{op}"', text) or f'"{op}")' in text, (name, op)
        first_guard, first_pin = text.index("llmpar_refuse_capture("), text.index("pinned_memory(true)")
        assert name == "bucket_ops.cpp" or first_guard < first_pin, f"{name}: guard after the pinned allocation"
