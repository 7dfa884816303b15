"""Backend choice for the fused ops: CUDA extension -> Triton -> torch, by the tensors' device and what is available.

``LLMPAR_BACKEND=cuda|triton|torch`` forces one backend; a forced backend that cannot run raises a RuntimeError
naming it and why (extension not built, no CUDA device, triton missing, ...). On CPU tensors Triton runs only under
its interpreter (``TRITON_INTERPRET=1``, set before llmpar.kernels is imported); otherwise CPU work goes to torch.
"""

from __future__ import annotations

import os

import torch

import llmpar.ops._ext as _ext

BACKENDS = ("cuda", "triton", "torch")
ENV = "LLMPAR_BACKEND"


def forced_backend() -> str | None:
    """The backend named by ``LLMPAR_BACKEND``, or None when unset/empty/"auto"."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a backend; use one of {', '.join(BACKENDS)} or unset it")
    return value


def _triton_module():
    from llmpar.kernels import bucket  # the kernels module records whether it was imported in interpreter mode

    return bucket


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why Triton cannot run on ``device`` now, or None when it can."""
    kernels = _triton_module()
    if not kernels.HAS_TRITON:
        return kernels.TRITON_IMPORT_ERROR or "triton is missing"
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"Triton runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), not on {device.type}"
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "tensors are on CPU and TRITON_INTERPRET is not 1 (Triton needs its interpreter on CPU)"
    if not kernels.INTERPRETED:
        return "TRITON_INTERPRET=1 was set after llmpar.kernels was imported; set it before importing"
    return None


def has_ext_op(name: str) -> bool:
    """Whether a CUDA kernel of ``llmpar::<name>`` is registered (by the loaded extension: the schemas themselves are
    defined in Python, llmpar/ops/_library.py, so ``hasattr(torch.ops.llmpar, name)`` says nothing about the build)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"llmpar::{name}", "CUDA")
    except RuntimeError:  # no such operator at all
        return False


def cuda_unavailable_reason(
    device: torch.device, *, build: bool = True, op: str | None = None, ops: tuple[str, ...] = ()
) -> str | None:
    """Why the CUDA extension cannot run ``op`` and every op of ``ops`` (``llmpar::<name>``; none: any) on ``device``,
    or None when it can. May JIT-build the extension when ``build``."""
    if device.type != "cuda":
        return f"tensors are on {device.type}; the CUDA extension runs on CUDA tensors only"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    status = _ext.load(build=build)
    if not status.available:
        return f"llmpar._C is unavailable: {status.reason}"
    for name in ((op,) if op is not None else ()) + tuple(ops):
        if not has_ext_op(name):
            return f"llmpar._C ({status.source}) has no op llmpar::{name}: built from older sources? rebuild it"
    return None


def _unavailable_reason(backend: str, device: torch.device, ops: tuple[str, ...] = ()) -> str | None:
    if backend == "cuda":
        return cuda_unavailable_reason(device, ops=ops)
    if backend == "triton":
        return triton_unavailable_reason(device)
    return None


def _ext_ops(op: str, cuda_ops: tuple[str, ...] | None) -> tuple[str, ...]:
    if cuda_ops is not None:
        return tuple(cuda_ops)
    return (op,) if op.isidentifier() and op != "op" else ()


def select_backend(
    device: torch.device | str,
    *,
    kernel_unfit: str | None = None,
    op: str = "op",
    cuda_ops: tuple[str, ...] | None = None,
    cuda_unfit: str | None = None,
    triton_slow: str | None = None,
) -> str:
    """The backend that runs ``op`` on tensors on ``device``.

    kernel_unfit: None when the inputs suit the CUDA/Triton kernels, else why not (dtype, layout, ...): such calls go
    to torch, or raise a TypeError when a kernel backend is forced.
    cuda_ops: the extension ops the CUDA backend calls for ``op`` (default: ``op`` itself); all must be registered.
    cuda_unfit: None when the CUDA ops can serve this call, else why not (an activation without a cuBLASLt epilogue,
    ...): such calls skip the CUDA backend, or raise a TypeError when it is forced.
    triton_slow: None, or why the Triton kernel would be slower than torch for this call (float32 GEMMs without TF32
    run on the FMA units, where cuBLAS is faster): automatic choice then skips Triton; a forced triton still runs.
    """
    device = torch.device(device)
    forced = forced_backend()
    ext_ops = _ext_ops(op, cuda_ops)
    if forced is not None:
        if forced == "torch":
            return "torch"
        why = _unavailable_reason(forced, device, ext_ops)
        if why is not None:
            raise RuntimeError(f"{ENV}={forced} but the {forced} backend cannot run {op}: {why}")
        unfit = kernel_unfit if kernel_unfit is not None else cuda_unfit if forced == "cuda" else None
        if unfit is not None:
            raise TypeError(
                f"{ENV}={forced} but {op} cannot use the {forced} kernel: {unfit}; unset {ENV} to fall back to torch"
            )
        return forced
    if kernel_unfit is not None:
        return "torch"
    if cuda_unfit is None and _unavailable_reason("cuda", device, ext_ops) is None:
        return "cuda"
    if triton_slow is None and _unavailable_reason("triton", device) is None:
        return "triton"
    return "torch"


def tf32_allowed() -> bool:
    """Whether float32 matmuls may use TF32, as torch decides for its own: the new setting
    (``torch.backends.cuda.matmul.fp32_precision``) when set, else the legacy ``allow_tf32`` (reading that one raises
    once the two were mixed), else ``torch.get_float32_matmul_precision()``."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except (RuntimeError, AttributeError):
        return torch.get_float32_matmul_precision() != "highest"


def backend_report() -> dict:
    """What each backend can do here, for ``llmpar env``. Never builds the extension.

    Keys: forced, cuda_ext, triton, torch (dicts with ``available`` and ``detail``), default_cuda, default_cpu.
    """
    has_cuda = torch.cuda.is_available()
    ext = _ext.load(build=False)
    jit_ok = not ext.available and _ext.jit_unavailable_reason() is None
    kernels = _triton_module()
    triton_cpu = triton_unavailable_reason(torch.device("cpu"))
    triton_cuda = kernels.HAS_TRITON and has_cuda
    if not kernels.HAS_TRITON:
        triton_detail = kernels.TRITON_IMPORT_ERROR or "triton is missing"
    else:
        where = [w for w, ok in (("CUDA", triton_cuda), ("CPU interpreter", triton_cpu is None)) if ok]
        triton_detail = f"triton {kernels.triton.__version__}: runs on {', '.join(where) or 'nothing here'}"
        if triton_cpu is not None:
            triton_detail += f"; CPU: {triton_cpu}"
    return {
        "forced": os.environ.get(ENV) or None,
        "cuda_ext": {
            "available": ext.available or jit_ok,
            "source": ext.source or ("jit" if jit_ok else None),
            "detail": ext.reason,
            "cache_dir": str(_ext.cache_dir()),
        },
        "triton": {
            "available": triton_cuda or triton_cpu is None,
            "importable": kernels.HAS_TRITON,
            "detail": triton_detail,
        },
        "torch": {"available": True, "detail": f"torch {torch.__version__} (always there)"},
        "default_cuda": ("cuda" if ext.available or jit_ok else "triton" if triton_cuda else "torch")
        if has_cuda
        else None,
        "default_cpu": "triton" if triton_cpu is None else "torch",
    }
