"""Loading the CPU extension ``llmpar._C_cpu`` (csrc/cpu/: the vectorised AdamW of the ZeRO-Offload host step).

Order, decided once per process (thread-safe, cached):
1. ``llmpar._C_cpu`` built into the wheel (``LLMPAR_BUILD_CPU=1``), if its build info names the running torch.
2. JIT build of the shipped sources (``llmpar/csrc/cpu``) with ``torch.utils.cpp_extension.load`` and ninja on first
   use, into ``$LLMPAR_EXT_CACHE`` (default ``~/.cache/llmpar/ext``) under ``cpu-torch<version>-<hash of the sources
   and flags>``: a later process only loads it (ninja finds it up to date), an edited source builds anew.
   ``LLMPAR_NO_JIT=1`` turns the JIT build off.
3. Unavailable, with the reason (logged once): the callers run their torch path.

Concurrent first uses (test processes, torchrun ranks on one host) build once: the build runs under an exclusive
``fcntl.flock`` on ``<build dir>/build.flock``, which the OS drops when its process dies. torch's own lock file
(``<build dir>/lock``) stays behind when a build is killed midway and every later ``load`` would wait on it forever:
it is removed while the flock is held, when no other build can be running.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

import llmpar.ops._ext as _ext

log = logging.getLogger("llmpar")

NAME = "llmpar_C_cpu"  # the JIT-built library (the wheel's is the module llmpar._C_cpu)
_lock = threading.Lock()


def jit_unavailable_reason() -> str | None:
    """Why the CPU extension cannot be JIT-built here, or None when it can."""
    from torch.utils import cpp_extension

    if os.environ.get("LLMPAR_NO_JIT", "0") == "1":
        return "LLMPAR_NO_JIT=1 turns the JIT build off"
    if os.name != "posix":
        return f"the JIT build of the CPU extension needs a POSIX system (this is {os.name})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _kwargs() -> dict:
    return _ext.build_config().cpu_extension_kwargs(_ext._csrc_dir(), relative_to=None)


def build_dir(kw: dict | None = None) -> Path:
    """Where the JIT build goes: keyed by the torch version and a hash of the sources, headers and flags."""
    kw = kw or _kwargs()
    digest = hashlib.sha256(repr(kw["extra_compile_args"]).encode())
    for path in sorted(Path(kw["include_dirs"][0]).glob("*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return _ext.cache_dir().parent / f"cpu-torch{_ext._torch_base_version()}-{digest.hexdigest()[:12]}"


def _jit_build() -> _ext.ExtStatus:
    import fcntl

    from torch.utils import cpp_extension

    why = jit_unavailable_reason()
    if why is not None:
        return _ext.ExtStatus(
            available=False, source=None, reason=f"not built into the wheel and cannot JIT-build: {why}"
        )
    kw = _kwargs()
    folder = build_dir(kw)
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(folder / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or by the OS if this process dies
        (folder / "lock").unlink(missing_ok=True)  # torch's FileBaton, left behind by a build killed midway
        if not (folder / f"{NAME}.so").exists():
            log.warning(
                "llmpar: JIT-building the CPU extension (AdamW kernel) into %s (once per source version, ~30 s)", folder
            )
        try:
            cpp_extension.load(
                name=NAME,
                sources=kw["sources"],
                extra_include_paths=kw["include_dirs"],
                extra_cflags=kw["extra_compile_args"]["cxx"],
                extra_ldflags=[f for f in kw["extra_link_args"] if "$ORIGIN" not in f],  # (the wheel's)
                build_directory=str(folder),
                is_python_module=False,
                verbose=os.environ.get("LLMPAR_VERBOSE") == "1",
            )
        except Exception as exc:  # noqa: BLE001 - a failed build must degrade to the torch path, with the reason
            lines = str(exc).strip().splitlines()
            return _ext.ExtStatus(
                available=False, source=None, reason=f"JIT build failed: {lines[-1] if lines else repr(exc)}"
            )
    return _ext.ExtStatus(
        available=True,
        source="jit",
        path=str(folder),
        reason=f"JIT-built in {folder} (built or loaded in {time.perf_counter() - start:.1f} s)",
    )


@functools.lru_cache(maxsize=None)
def _load_once() -> _ext.ExtStatus:
    status = _ext.prebuilt_status(
        "llmpar._C_cpu",
        _ext._prebuilt_path("llmpar._C_cpu"),
        "rebuild with LLMPAR_BUILD_CPU=1, or it is JIT-built on first use",
    )
    if status is None:
        try:
            status = _jit_build()
        except (OSError, ImportError) as exc:  # no shipped sources, an unwritable cache, ...: the torch path runs
            status = _ext.ExtStatus(available=False, source=None, reason=f"cannot JIT-build: {exc!r}")
    if status.available:
        log.info("llmpar: CPU extension: %s", status.reason)
    else:
        log.warning(
            "llmpar: the CPU AdamW kernel is unavailable (%s); the CPU steps run torch's fused AdamW", status.reason
        )
    return status


def load() -> _ext.ExtStatus:
    """The CPU extension's status, loading it (and JIT-building it if needed) on the first call of the process."""
    with _lock:
        return _load_once()


def loaded() -> bool:
    """Whether the kernel of ``llmpar::cpu_adamw_step`` is registered now (never builds)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("llmpar::cpu_adamw_step", "CPU")
    except RuntimeError:
        return False
