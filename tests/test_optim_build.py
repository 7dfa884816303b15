"""The AdamW CUDA sources build: adamw_kernels.cu compiles with nvcc alone for sm_90 (and sm_80), adamw_ops.cpp passes
a C++ syntax check against torch's headers, the C enum of modes matches llmpar.ops.adamw.MODES, and the C++/Triton
twins agree on hash and chunk constants.
Running the CUDA ops needs a GPU: tests/test_optim_ops.py runs them there (backend "cuda")."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
CUDA_HOME = Path("/usr/local/cuda-13.0")


def _nvcc() -> str | None:
    return shutil.which("nvcc") or (str(CUDA_HOME / "bin/nvcc") if (CUDA_HOME / "bin/nvcc").exists() else None)


SYNTAX_SOURCES = ("adamw_ops.cpp", "adamw_lowbit_ops.cpp")  # both include capture_check.h
KERNEL_SOURCES = ("adamw_kernels.cu", "adamw_lowbit_kernels.cu")


def _wait(run: tuple[list[str], subprocess.Popen]) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of a compiler run the ``compiles`` fixture started."""
    out, err = run[1].communicate(timeout=240)
    return run[1].returncode, out, err


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """The file's compiler runs, all started at once by the first test that asks (each is seconds of one core:
    nvcc on a kernel file for two architectures, g++ parsing torch/extension.h), keyed by source; each test waits for
    its own. A run whose tool is missing is not started (its test skips)."""
    tmp_path = tmp_path_factory.mktemp("compiles")
    cmds: dict[str, list[str]] = {}
    if _nvcc() is not None:
        for source in KERNEL_SOURCES:
            cmds[source] = [
                _nvcc(),
                "-c",
                "-std=c++17",
                "-O3",
                "-Werror=all-warnings",
                f"-I{CSRC}",
                "-Xptxas=-v",
                "-gencode=arch=compute_90,code=sm_90",
                "-gencode=arch=compute_80,code=sm_80",
                str(CSRC / source),
                "-o",
                str(tmp_path / source.replace(".cu", ".o")),
            ]
    if shutil.which("g++") is not None and (CUDA_HOME / "include/cuda_runtime.h").exists():
        from torch.utils import cpp_extension

        # CPU wheels of torch ship c10/cuda headers but not the generated cuda_cmake_macros.h: stub it for a syntax
        # check
        stub = tmp_path / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
        for source in SYNTAX_SOURCES:
            cmds[source] = [
                "g++",
                "-std=c++20",
                "-fsyntax-only",
                "-Wall",
                "-Werror",
                f"-I{tmp_path}",
                *[f"-I{p}" for p in cpp_extension.include_paths()],
                f"-I{CUDA_HOME / 'include'}",
                f"-I{CSRC}",
                f"-I{sysconfig.get_paths()['include']}",
                str(CSRC / source),
            ]
    pipe = subprocess.PIPE
    runs = {source: (cmd, subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True)) for source, cmd in cmds.items()}
    yield runs
    for _, proc in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_adamw_kernels_compile_with_nvcc_alone(compiles):
    cmd, _ = run = compiles["adamw_kernels.cu"]
    rc, out, err = _wait(run)
    assert rc == 0, f"{' '.join(cmd)}\n{out}\n{err}"
    assert Path(cmd[-1]).stat().st_size > 0
    assert "spill stores" in err and not re.search(r"[1-9]\d* bytes spill stores", err), (
        "a kernel spills registers:\n" + err[-3000:]
    )


def test_adamw_sources_layering():
    for name in ("adamw.cuh", "adamw_kernels.cu"):
        text = (CSRC / name).read_text()
        assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", text), f"{name} includes torch headers"
    ops = (CSRC / "adamw_ops.cpp").read_text()
    assert "TORCH_LIBRARY_IMPL(llmpar, CUDA, m)" in ops, "adamw_ops.cpp adds the CUDA kernels"
    assert "TORCH_LIBRARY(" not in ops and "TORCH_LIBRARY_FRAGMENT" not in ops and "m.def(" not in ops, (
        "the schemas live in llmpar/ops/_library.py only"
    )
    assert "PyInit" not in ops, "bucket_ops.cpp owns the module init"


def test_c_enum_matches_the_mode_table():
    """LlmparAdamwMode (csrc/adamw.cuh) gives every mode of llmpar.ops.adamw.MODES its code, and nothing else."""
    from llmpar.ops.adamw import MODES, mode_code

    cuh = (CSRC / "adamw.cuh").read_text()
    body = re.search(r"enum LlmparAdamwMode\s*\{([^}]*)\}", cuh)
    assert body, "enum LlmparAdamwMode moved: update this test"
    enum = {name.lower(): int(code) for name, code in re.findall(r"LLMPAR_ADAMW_(\w+)\s*=\s*(\d+)", body.group(1))}
    assert enum == {name: mode_code(name) for name in MODES}
    assert sorted(enum.values()) == list(range(len(MODES)))


def test_twins_agree_on_constants():
    from llmpar.kernels import adamw as triton_adamw
    from llmpar.ops._library import ADAMW_CHUNK

    cuh = (CSRC / "adamw.cuh").read_text()
    cu = (CSRC / "adamw_kernels.cu").read_text()
    py = (ROOT / "kernels" / "adamw.py").read_text()
    assert not hasattr(triton_adamw, "MODES"), "the mode table lives in llmpar/ops/adamw.py only"
    for const in ("0x21F0AAAD", "0x735A2D97", "0x3C6EF372", "0x5BD1E995"):
        assert const in cu and const in py, f"hash constant {const} differs between the CUDA and Triton kernels"
    threads = int(re.search(r"#define LLMPAR_ADAMW_THREADS (\d+)", cuh).group(1))
    vec = int(re.search(r"#define LLMPAR_ADAMW_VEC (\d+)", cuh).group(1))
    assert threads * vec * 2 == ADAMW_CHUNK  # LLMPAR_ADAMW_CHUNK: the fake impl of sum_squares counts blocks with it
    assert len(triton_adamw.TABLE_ROWS) == int(re.search(r"#define LLMPAR_ADAMW_TABLE_ROWS (\d+)", cuh).group(1))


def test_multi_tensor_kernels_share_one_tensor_search():
    """ "Which tensor does this program own" is written once (kernels/multi_tensor.py) and called by every kernel that
    walks a multi-tensor table, not copied into each (tests/test_optim_ops.py checks the search itself)."""
    kernels = ROOT / "kernels"
    assert [p.name for p in sorted(kernels.glob("*.py")) if "while lo < hi" in p.read_text()] == ["multi_tensor.py"]
    calls = {
        name: (kernels / name).read_text().count("_owner(table_ptr, n, pid)")
        for name in ("adamw.py", "adamw_lowbit.py")
    }
    assert calls == {"adamw.py": 2, "adamw_lowbit.py": 1}, calls  # AdamW + sum of squares; low-bit AdamW


@pytest.mark.skipif(
    shutil.which("g++") is None or not (CUDA_HOME / "include/cuda_runtime.h").exists(),
    reason="g++ or the CUDA headers are missing",
)
@pytest.mark.parametrize("source", SYNTAX_SOURCES)
def test_binding_syntax_against_torch_headers(compiles, source):
    rc, _, err = _wait(compiles[source])
    assert rc == 0, err[-4000:]


# ------------------------------------------------------------------- the low-bit AdamW kernel (issue #33)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_lowbit_kernels_compile_without_spills(compiles):
    cmd, _ = run = compiles["adamw_lowbit_kernels.cu"]
    rc, out, err = _wait(run)
    assert rc == 0, f"{' '.join(cmd)}\n{out}\n{err}"
    # 2 bit widths x (fp32 | bf16 + master) x 3 grad dtypes, each for sm_80 and sm_90
    assert err.count("spill stores") >= 24, err[-3000:]
    assert not re.search(r"[1-9]\d* bytes spill stores", err), "a kernel spills registers:\n" + err


def test_lowbit_twins_agree_on_layout():
    """The CUDA kernel, its Triton twin and the contract agree on block sizes and the table's rows."""
    from llmpar.kernels import adamw_lowbit as triton_lowbit
    from llmpar.ops.lowbit import BLOCK

    cuh = (CSRC / "adamw_lowbit.cuh").read_text()
    assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", cuh + (CSRC / "adamw_lowbit_kernels.cu").read_text())
    assert int(re.search(r"#define LLMPAR_LOWBIT_BLOCK8 (\d+)", cuh).group(1)) == BLOCK[8] == triton_lowbit.BLOCK[8]
    assert int(re.search(r"#define LLMPAR_LOWBIT_BLOCK4 (\d+)", cuh).group(1)) == BLOCK[4] == triton_lowbit.BLOCK[4]
    rows = int(re.search(r"#define LLMPAR_LOWBIT_TABLE_ROWS (\d+)", cuh).group(1))
    assert rows == len(triton_lowbit.TABLE_ROWS)
    ops = (CSRC / "adamw_lowbit_ops.cpp").read_text()
    assert "TORCH_LIBRARY_IMPL(llmpar, CUDA, m)" in ops and "m.def(" not in ops and "PyInit" not in ops
