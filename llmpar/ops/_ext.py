"""Loading the CUDA extension ``llmpar._C``: the prebuilt one from the wheel, else a JIT build on first use.

Order, decided once per process (thread-safe, cached):
1. ``llmpar._C`` built into the wheel (``LLMPAR_BUILD_CUDA=1``), if its build info (a marker string in the .so,
   read WITHOUT loading it) names the running torch version. A mismatch warns and goes on to 2: a stale .so would
   fail to load or, worse, load against the wrong ABI; and once loaded its ops could not be replaced.
2. JIT build of the shipped sources (``llmpar/csrc``) with ``torch.utils.cpp_extension.load`` and ninja, when
   CUDA is available; cached in ``$LLMPAR_EXT_CACHE`` or ``~/.cache/llmpar/ext/torch<ver>-cu<ver>``.
   ``LLMPAR_NO_JIT=1`` turns the JIT build off.
3. Unavailable, with the reason.

The extension only registers CUDA kernels (``TORCH_LIBRARY_IMPL(llmpar, CUDA, m)``); the schemas and fake impls of the
``llmpar::`` ops live in ``llmpar/ops/_library.py``. Loading the .so before or after that module is imported both work
(the dispatcher keeps a kernel registered before its schema until the schema arrives).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("llmpar")

_MARKER = re.compile(rb"LLMPAR_BUILD_INFO torch=([0-9A-Za-z.]+) cuda=([0-9A-Za-z.]+)")


@dataclass(frozen=True, kw_only=True)
class ExtStatus:
    available: bool
    source: str | None  # "wheel" | "jit" | None
    reason: str  # where it came from, or why it is unavailable
    path: str | None = None


_lock = threading.Lock()
_status: ExtStatus | None = None


def _torch_base_version() -> str:
    return torch.__version__.split("+")[0]


def cache_dir() -> Path:
    """Where the JIT build goes: keyed by torch and CUDA versions so that an upgrade never reuses a stale build."""
    root = os.environ.get("LLMPAR_EXT_CACHE") or os.path.join(Path.home(), ".cache", "llmpar", "ext")
    cuda = (torch.version.cuda or "none").replace(".", "")
    return Path(root) / f"torch{_torch_base_version()}-cu{cuda}"


def _csrc_dir() -> Path:
    spec = importlib.util.find_spec("llmpar.csrc")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the package llmpar.csrc (CUDA sources) is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def build_config() -> ModuleType:
    """csrc/build_config.py of the shipped sources (sources and flags of both extensions), imported by path: it is
    torch-free and outside the llmpar import graph, as setup.py uses it."""
    path = _csrc_dir() / "build_config.py"
    spec = importlib.util.spec_from_file_location("llmpar_csrc_build_config", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prebuilt_path(name: str = "llmpar._C") -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _build_info(so: Path) -> tuple[str, str] | None:
    match = _MARKER.search(so.read_bytes())
    return (match.group(1).decode(), match.group(2).decode()) if match else None


def _try_prebuilt() -> ExtStatus | None:
    return prebuilt_status(
        "llmpar._C", _prebuilt_path(), "rebuild with LLMPAR_BUILD_CUDA=1, or it is JIT-built when CUDA is available"
    )


def prebuilt_status(module: str, so: Path | None, hint: str) -> ExtStatus | None:
    """``module``, an extension built into the wheel at ``so`` (None: not there), imported if it was built for the
    running torch; else None, with a warning saying why and ``hint`` when it is there but unusable."""
    if so is None:
        return None
    info = _build_info(so)
    running = _torch_base_version()
    if info is not None and info[0] != running:
        warnings.warn(
            f"{module} at {so} was built for torch {info[0]} but torch {running} is running; ignoring it ({hint})",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    try:
        importlib.import_module(module)
    except (ImportError, OSError) as exc:
        warnings.warn(f"{module} at {so} does not load ({exc}); falling back", RuntimeWarning, stacklevel=4)
        return None
    return ExtStatus(available=True, source="wheel", reason=f"prebuilt {so.name} (torch {running})", path=str(so))


def jit_unavailable_reason() -> str | None:
    """Why a JIT build cannot run here, or None when it can."""
    from torch.utils import cpp_extension

    if os.environ.get("LLMPAR_NO_JIT", "0") == "1":
        return "LLMPAR_NO_JIT=1 turns the JIT build off"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if cpp_extension.CUDA_HOME is None:
        return "nvcc not found (set CUDA_HOME to the toolkit root)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _jit_build() -> ExtStatus:
    from torch.utils import cpp_extension

    why = jit_unavailable_reason()
    if why is not None:
        return ExtStatus(available=False, source=None, reason=f"not built into the wheel and cannot JIT-build: {why}")
    kw = build_config().extension_kwargs(_csrc_dir(), relative_to=None)
    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    log.warning("llmpar: JIT-building the CUDA extension into %s (once per torch/CUDA version, ~1 min)", build_dir)
    try:
        cpp_extension.load(
            name="llmpar_C",
            sources=kw["sources"],
            extra_include_paths=kw["include_dirs"],
            extra_cflags=kw["extra_compile_args"]["cxx"],
            extra_cuda_cflags=kw["extra_compile_args"]["nvcc"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("LLMPAR_VERBOSE") == "1",
        )
    except Exception as exc:  # noqa: BLE001 - a failed build must degrade to the next backend, with the reason
        msg = str(exc).strip().splitlines()
        return ExtStatus(available=False, source=None, reason=f"JIT build failed: {msg[-1] if msg else exc!r}")
    return ExtStatus(available=True, source="jit", reason=f"JIT-built in {build_dir}", path=str(build_dir))


def load(*, build: bool = True) -> ExtStatus:
    """The extension's status, loading it (and JIT-building it when ``build``) on first call."""
    global _status
    if _status is not None:
        return _status
    with _lock:
        if _status is not None:
            return _status
        status = _try_prebuilt()
        if status is None:
            if not build:
                why = jit_unavailable_reason()
                return ExtStatus(
                    available=False,
                    source=None,
                    reason="not built yet; JIT-builds on first use"
                    if why is None
                    else f"not built into the wheel and cannot JIT-build: {why}",
                )
            status = _jit_build()
        _status = status
        return status
