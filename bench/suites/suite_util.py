"""What the op suites share: the devices here, the implementations timed in each group, why one cannot run, and the
call that times a case.

Implementations (the last part of each test id; ``extra_info["impl"]``):
    torch           the plain PyTorch baseline (from the tests' references where they have one)
    llmpar          llmpar's op as dispatched here (CUDA extension -> Triton -> torch; torch on CPU)
    llmpar-triton   llmpar with LLMPAR_BACKEND=triton (CUDA only: the CPU interpreter is far too slow to time)
    llmpar-cuda     llmpar with LLMPAR_BACKEND=cuda (the ``llmpar._C`` extension, CUDA only, where built)
Every case of one op, size and device sits in one pytest-benchmark group, so its table compares them directly;
``bench/benchmark_table.py`` turns a saved run into ratios vs the torch row of each group.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
IMPLS = ("torch", "llmpar", "llmpar-triton", "llmpar-cuda")
WARMUP = 3  # untimed calls before timing (Triton compiles and autotunes on its first call); they size the rounds
MAX_ROUNDS = 100  # a busy machine's slow calls cannot stretch a case past this many
TRITON_CPU = (
    "Triton on CPU runs only under its interpreter (TRITON_INTERPRET=1), far too slow to benchmark; "
    "the Triton cases run on CUDA"
)


def device_cases(sizes: dict[str, list[Any]], ident: Callable[[Any], str] = str) -> list[Any]:
    """``pytest.param(device, size)`` for every device here and each of its sizes (``sizes[device.type]``; only the
    first, smallest, with ``LLMPAR_BENCH_QUICK=1``, for smoke runs); the device's name is its id and what is saved."""
    quick = os.environ.get("LLMPAR_BENCH_QUICK", "") not in ("", "0")
    return [
        pytest.param(Device(d.type), s, id=f"{d.type}-{ident(s)}")
        for d in DEVICES
        for s in (sizes[d.type][:1] if quick else sizes[d.type])
    ]


def grid(sizes: dict[str, list[Any]], ident: Callable[[Any], str], **axes: Any) -> Callable[[Any], Any]:
    """A decorator parametrizing a test over ``device_cases(sizes, ident)`` then each of ``axes`` in order (name ->
    values): the test id reads ``<device>-<size>-<axis values...>``."""

    def decorate(test: Any) -> Any:
        test = pytest.mark.parametrize("device,size", device_cases(sizes, ident))(test)
        for name, values in axes.items():
            test = pytest.mark.parametrize(name, list(values))(test)
        return test

    return decorate


class Device(str):
    """A device name ("cpu", "cuda") that pytest-benchmark saves as text; ``.type`` and ``torch.device(d)`` work."""

    @property
    def type(self) -> str:
        return str(self)


def skip_reason(impl: str, device: torch.device, cuda_ops: tuple[str, ...] = ()) -> str | None:
    """Why ``impl`` cannot run on ``device`` (None: it can). ``cuda_ops``: the ``llmpar::`` ops llmpar-cuda calls."""
    from llmpar.ops._dispatch import cuda_unavailable_reason, triton_unavailable_reason

    if impl == "llmpar-triton":
        return TRITON_CPU if device.type == "cpu" else triton_unavailable_reason(device)
    if impl == "llmpar-cuda":
        if device.type != "cuda":
            return "the CUDA extension (llmpar._C) runs on CUDA tensors only"
        return cuda_unavailable_reason(device, build=False, ops=cuda_ops)
    return None


def require(impl: str, device: torch.device, cuda_ops: tuple[str, ...] = ()) -> None:
    """Skip the test, with the reason, when ``impl`` cannot run on ``device``."""
    reason = skip_reason(impl, device, cuda_ops)
    if reason is not None:
        pytest.skip(reason)


@contextlib.contextmanager
def forced_backend(impl: str) -> Iterator[None]:
    """LLMPAR_BACKEND set to the backend ``impl`` names (llmpar-triton -> triton) while timing; as it was after."""
    backend = impl.partition("-")[2]
    old = os.environ.get("LLMPAR_BACKEND")
    if backend:
        os.environ["LLMPAR_BACKEND"] = backend
    try:
        yield
    finally:
        if backend:
            if old is None:
                os.environ.pop("LLMPAR_BACKEND", None)
            else:
                os.environ["LLMPAR_BACKEND"] = old


def once(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build(*key)`` (inputs on the CPU) memoised for the latest key only, handed out as fresh copies on a device:
    ``once(build)(device, *key)``. The impls of one case run back to back, so each case's inputs (float64 random
    draws, slow at LLM sizes) are built once, and each impl still starts from the same untouched values."""
    cached = functools.lru_cache(maxsize=1)(build)

    def fresh(device: Any, *key: Any) -> Any:
        return _copy(cached(*key), device)

    return fresh


def _copy(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=True)
    if isinstance(value, dict):
        return {k: _copy(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v, device) for v in value)
    return value


def rounds_for(call_s: float, max_time_s: float, min_rounds: int) -> int:
    """Rounds that fill ``max_time_s`` at ``call_s`` per call, at least ``min_rounds``, at most ``MAX_ROUNDS``."""
    return max(min_rounds, min(MAX_ROUNDS, math.ceil(max_time_s / max(call_s, 1e-9))))


def run(benchmark: Any, fn: Callable[[], Any], *, device: torch.device, group: str, impl: str, **info: Any) -> None:
    """Time ``fn`` (no arguments; inputs built beforehand) as ``impl`` in ``group`` on ``device``.

    ``WARMUP`` untimed calls, whose median sizes the rounds (``--benchmark-max-time`` worth, within
    [``--benchmark-min-rounds``, ``MAX_ROUNDS``]), then ``benchmark.pedantic`` runs them: a fixed count, so one slow
    call on a shared machine cannot turn into hundreds of rounds the way pytest-benchmark's own calibration can. On
    CUDA each call ends with a synchronize, so its time is the GPU's."""
    benchmark.group = f"{group} {device.type}"
    benchmark.extra_info.update(impl=impl, baseline=impl == "torch", device=device.type, **info)

    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with forced_backend(impl):
        rounds = 1
        if not benchmark.disabled:
            times = []
            for _ in range(WARMUP):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            rounds = rounds_for(
                statistics.median(times),
                float(getattr(benchmark, "_max_time", 0.2)),
                int(getattr(benchmark, "_min_rounds", 5)),
            )
        benchmark.pedantic(call, rounds=rounds, iterations=1)


def bucket_ident(size: tuple[int, int]) -> str:
    """A bucket size ``(elements, tensors)`` as a test id: ``4Mx64``."""
    return f"{size[0] / 2**20:g}Mx{size[1]}"


def bucket_shapes(numel: int, n: int) -> list[tuple[int]]:
    """n odd sizes summing to about numel: a few big, many small (a model's gradients)."""
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(n, generator=g) ** 3 + 1e-3
    sizes = (weights / weights.sum() * numel).long().clamp(min=1) | 1
    return [(int(s),) for s in sizes]


@once
def bucket_tensors(size: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors of a bucket of ``size``: the tests' ``make_tensors`` (tests/test_ops_bucket.py) at
    :func:`bucket_shapes`."""
    from test_ops_bucket import make_tensors

    return make_tensors(bucket_shapes(*size), dtype)
