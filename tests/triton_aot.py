"""Ahead-of-time Triton compiles with the specialisations the launchers really apply, on a machine without a GPU.

A kernel launch ``kernel[grid](*args, **kw)`` goes through Triton's binder, which turns every int argument equal to 1
into a constant (unless the kernel lists it in ``do_not_specialize``) and marks ints and pointers divisible by 16
(``tt.divisibility``). Compiling with hand-written signatures skips both, so code that breaks on them (``seed.to(...)``
on a specialised ``seed == 1``) compiled in the tests and failed on the first GPU. Here:

    rec = Recorder()                                   # stands in for the kernel: records (args, kwargs)
    monkeypatch.setattr(module, "_kernel", rec)        # then call the real launcher on CPU tensors
    kernel = compile_like_launcher(module_kernel, *rec.calls[0], arch=90)

``compile_like_launcher`` runs the args through the same binder ``JITFunction.run`` uses (built for a CUDA target),
so the signature, constants and divisibility attributes are the launcher's, then compiles to a cubin.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
except ImportError as err:  # pragma: no cover - depends on the triton version
    pytest.skip(f"this triton has no ahead-of-time compile API: {err}", allow_module_level=True)

SMEM_LIMIT = {80: 166912, 90: 232448}  # max dynamic shared memory per block: A100, H100/H200 (227 KB)


class Recorder:
    """Records ``kernel[grid](*args, **kwargs)`` calls instead of launching."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.grids: list[Any] = []

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append((args, kwargs))
            self.grids.append(grid)

        return launch


def _unwrap(fn: Any) -> Any:
    while not hasattr(fn, "params"):  # an Autotuner / Heuristics wraps the JITFunction
        fn = fn.fn
    return fn


def bind_like_launcher(fn: Any, args: tuple, kwargs: dict, arch: int) -> tuple[dict, dict, dict, Any]:
    """(signature, constexprs, attrs, options) as ``JITFunction.run`` derives them from these args for ``arch``."""
    fn = _unwrap(fn)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def compile_like_launcher(fn: Any, args: tuple, kwargs: dict, *, arch: int, cubin: bool = True):
    """Compile ``fn`` for sm_``arch`` exactly as a launch with ``args``/``kwargs`` would specialise it."""
    signature, constexprs, attrs, options = bind_like_launcher(fn, args, kwargs, arch)
    src = ASTSource(fn=_unwrap(fn), signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    except RuntimeError as err:
        if "ptxas" in str(err) and ("not found" in str(err) or "No such file" in str(err)):
            pytest.skip(f"triton's ptxas is unavailable here: {err}")
        raise
    if cubin:
        assert kernel.asm["cubin"], "no machine code produced"
        assert f".target sm_{arch}" in kernel.asm["ptx"]
    return kernel


def specialised(signature: dict, constexprs: dict, fn: Any) -> dict[str, Any]:
    """Argument name -> the constant the binder made of it (ints equal to 1), for non-constexpr params only."""
    fn = _unwrap(fn)
    out = {}
    for (i, *rest), value in constexprs.items():
        p = fn.params[i]
        if not rest and not p.is_constexpr:
            out[p.name] = value
    return out


def cuobjdump() -> str | None:
    """A cuobjdump binary: Triton's own (it ships one beside its ptxas), else the CUDA toolkit's, else None."""
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.access(bundled, os.X_OK):
        return bundled
    home = os.environ.get("CUDA_HOME")
    found = os.path.join(home, "bin", "cuobjdump") if home else ""
    return found if os.access(found, os.X_OK) else shutil.which("cuobjdump")


def res_usage(kernel) -> dict[str, int]:
    """{"REG", "STACK", "SHARED", "LOCAL"}: ``cuobjdump -res-usage`` of a compiled kernel's cubin (no GPU needed).
    STACK / LOCAL are bytes per thread: nonzero when registers spilled (or an array went to local memory)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (neither Triton's nor the CUDA toolkit's)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    assert m, f"cuobjdump -res-usage printed no resource line:\n{out}"
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups())))
