"""Backend choice: LLMPAR_BACKEND forcing, clear errors for unavailable backends, the extension loader's checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llmpar.ops import _dispatch, _ext, backend_report, pack_bucket, select_backend

CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "tpu")
    with pytest.raises(ValueError, match="LLMPAR_BACKEND='tpu' is not a backend; use one of cuda, triton, torch"):
        select_backend(CPU)


@pytest.mark.parametrize("value", ["", "auto", "torch", "TORCH"])
def test_auto_and_forced_torch_on_cpu(monkeypatch, value):
    monkeypatch.setenv("LLMPAR_BACKEND", value)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_backend(CPU) == "torch"
    tensors = [torch.randn(5), torch.randn(123)]
    flat = pack_bucket(tensors, scale=2.0)
    torch.testing.assert_close(flat, torch.cat(tensors) * 2.0, rtol=0, atol=0)


def test_forced_cuda_on_cpu_tensors_names_backend_and_reason(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    with pytest.raises(
        RuntimeError,
        match=r"LLMPAR_BACKEND=cuda but the cuda backend cannot run pack_bucket: "
        r"tensors are on cpu; the CUDA extension runs on CUDA tensors only",
    ):
        pack_bucket([torch.randn(5)])


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_forced_cuda_without_cuda_says_why(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="cuda backend cannot run pack_bucket: no CUDA device"):
        select_backend("cuda", op="pack_bucket")


def test_forced_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(
        RuntimeError, match="LLMPAR_BACKEND=triton but the triton backend cannot run pack_bucket: .*TRITON_INTERPRET"
    ):
        pack_bucket([torch.randn(5)])


def test_forced_triton_when_triton_missing(monkeypatch):
    from llmpar.kernels import bucket

    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    monkeypatch.setattr(bucket, "HAS_TRITON", False)
    monkeypatch.setattr(bucket, "TRITON_IMPORT_ERROR", "triton is not importable (No module named 'triton')")
    with pytest.raises(RuntimeError, match=r"triton backend cannot run .*No module named 'triton'"):
        select_backend(CPU, op="pack_bucket")


def test_interpreter_set_too_late(monkeypatch):
    from llmpar.kernels import bucket

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bucket, "INTERPRETED", False)
    assert "set after llmpar.kernels was imported" in _dispatch.triton_unavailable_reason(CPU)
    assert select_backend(CPU) == "torch"  # auto mode falls back quietly


def test_forced_kernel_backend_with_unfit_inputs(monkeypatch):
    # pretend triton can run
    monkeypatch.setattr(_dispatch, "_unavailable_reason", lambda backend, device, op=None: None)
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    with pytest.raises(TypeError, match="cannot use the triton kernel: dtype torch.float64"):
        pack_bucket([torch.randn(5, dtype=torch.float64)])
    monkeypatch.setenv("LLMPAR_BACKEND", "")
    assert select_backend(CPU, kernel_unfit="dtype torch.float64") == "torch"


def test_backend_report_shape():
    report = backend_report()
    for key in ("cuda_ext", "triton", "torch"):
        assert isinstance(report[key]["available"], bool) and report[key]["detail"]
    assert report["torch"]["available"] is True
    assert report["default_cpu"] in ("torch", "triton")
    if not HAS_CUDA:
        assert report["default_cuda"] is None
    if torch.version.cuda is None:  # CPU-only torch: no wheel build can match it, no JIT either
        assert report["cuda_ext"]["available"] is False


def test_cache_dir_keyed_by_versions(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMPAR_EXT_CACHE", str(tmp_path))
    d = _ext.cache_dir()
    assert d.parent == tmp_path
    assert d.name == f"torch{torch.__version__.split('+')[0]}-cu{(torch.version.cuda or 'none').replace('.', '')}"


def test_prebuilt_for_other_torch_is_skipped_with_warning(monkeypatch, tmp_path):
    fake = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    fake.write_bytes(b"\x7fELF junk LLMPAR_BUILD_INFO torch=1.0.0 cuda=9.9\x00 junk")
    monkeypatch.setattr(_ext, "_prebuilt_path", lambda: fake)
    assert _ext._build_info(fake) == ("1.0.0", "9.9")
    with pytest.warns(RuntimeWarning, match=r"built for torch 1\.0\.0 but torch .* is running; ignoring it"):
        assert _ext._try_prebuilt() is None


def test_no_jit_switch(monkeypatch):
    monkeypatch.setenv("LLMPAR_NO_JIT", "1")
    assert _ext.jit_unavailable_reason() == "LLMPAR_NO_JIT=1 turns the JIT build off"
    assert os.environ["LLMPAR_NO_JIT"] == "1"


def test_ext_status_without_cuda_does_not_build():
    status = _ext.load(build=False)
    if not HAS_CUDA and torch.version.cuda is None:
        assert not status.available and "CPU-only build" in status.reason


def test_cuda_backend_missing_op_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_ext, "load", lambda build=True: _ext.ExtStatus(available=True, source="wheel", reason="x"))
    why = _dispatch.cuda_unavailable_reason(torch.device("cuda"), op="no_such_op_xyz")
    assert why == "llmpar._C (wheel) has no op llmpar::no_such_op_xyz: built from older sources? rebuild it"


def test_fp32_gemm_without_tf32_prefers_cublas(monkeypatch):
    """A float32 GEMM may use tensor cores only as TF32; where torch forbids TF32, Triton's kernel would run on the FMA
    units and lose to cuBLAS: automatic choice sends it to torch, a forced triton still runs it (IEEE products)."""
    from types import SimpleNamespace

    from llmpar.ops import gemm_backends as gemm_ops

    monkeypatch.setattr(
        _dispatch, "_unavailable_reason", lambda backend, device, ops=(): "no ext" if backend == "cuda" else None
    )
    cuda32 = SimpleNamespace(dtype=torch.float32, device=torch.device("cuda"))
    monkeypatch.setattr(gemm_ops, "tf32_allowed", lambda: False)
    why = gemm_ops._triton_slow(cuda32)
    assert why is not None and "TF32" in why
    assert gemm_ops._triton_slow(SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda"))) is None
    assert gemm_ops._triton_slow(SimpleNamespace(dtype=torch.float32, device=CPU)) is None  # the interpreter
    monkeypatch.setenv("LLMPAR_BACKEND", "")
    assert select_backend("cuda", triton_slow=why) == "torch"
    assert select_backend("cuda", triton_slow=None) == "triton"
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    assert select_backend("cuda", triton_slow=why) == "triton"
    monkeypatch.setattr(gemm_ops, "tf32_allowed", lambda: True)
    assert gemm_ops._triton_slow(cuda32) is None


def test_tf32_allowed_follows_both_torch_apis():
    """tf32_allowed reads what torch itself uses (a subprocess: the settings are process-global, and reading the
    legacy flag raises once both APIs were used)."""
    code = (
        "import torch; from llmpar.ops._dispatch import tf32_allowed as t\n"
        "out = [t()]\n"
        "torch.backends.cuda.matmul.allow_tf32 = True; out.append(t())\n"
        "torch.set_float32_matmul_precision('highest'); out.append(t())\n"
        "torch.set_float32_matmul_precision('high'); out.append(t())\n"
        "m = torch.backends.cuda.matmul\n"
        "if hasattr(m, 'fp32_precision'):\n"
        "    m.fp32_precision = 'ieee'; out.append(t()); m.fp32_precision = 'tf32'; out.append(t())\n"
        "else:\n"
        "    out += [False, True]\n"
        "print(out)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[False, True, False, True, False, True]"
