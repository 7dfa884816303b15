"""pytest plugin: replay the GPU tests (``-m gpu``) on the CPU, to check their argument flow where no GPU is.

    PYTHONPATH=tests python -m pytest -p gpu_replay -m gpu tests/test_ops_gemm_ext.py tests/test_ops_bucket.py ...

The GPU tests only run on a GPU machine (bench/gpu_check.sh), where a mistake in a test body (a tensor left over from
a loop, a wrong shape handed to ``opcheck``) costs a lease to find. This plugin runs the same bodies here, with:
  - the device swapped: ``torch.cuda.is_available()`` is True (so ``skipif`` marks and tests/conftest.py let the GPU
    tests run), and a TorchFunctionMode maps every "cuda" device (``device=`` arguments, ``torch.device("cuda")``,
    ``Tensor.cuda()``, ``Tensor.to("cuda")``) to the CPU; ``.cuda()`` / ``.to("cuda")`` copy, as they do from the
    CPU on a GPU machine;
  - each CUDA op replaced by its CPU reference: the extension counts as loaded with every op of
    ``llmpar.ops._library.OPS`` that has one (``torch.ops.llmpar.*`` on CPU tensors run those references), so
    ``LLMPAR_BACKEND=cuda`` takes the CUDA path's Python side; Triton kernels are replaced by the torch path
    (``LLMPAR_BACKEND=triton`` runs torch, and automatic choice never picks Triton);
  - 16-bit matrix products (``F.linear``, ``matmul``, ``@``, ``mm``) formed in float32 and rounded once: the same
    values to within one rounding, and seconds instead of minutes for the large float16 cases on CPUs without
    float16 matrix units.
What it checks: shapes, dtypes and arguments flow through every GPU test body as written, and each body's own
assertions hold against the references. What it cannot check: the kernels' numerics (the "CUDA" results here are
the references themselves) and anything that needs a real device (streams, events, graphs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

REPLAY_REASON = "CPU replay of a GPU test (tests/gpu_replay.py)"
_MATMULS = {F.linear, torch.matmul, torch.mm, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm}
_HALF = (torch.float16, torch.bfloat16)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class CpuForCuda(TorchFunctionMode):
    """Maps every CUDA device to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.device and args and _is_cuda(args[0]):
            return torch.device("cpu")
        if func is torch.Tensor.cuda:
            return args[0].clone()
        copy = False
        if "device" in kwargs and (_is_cuda(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs["device"], copy = "cpu", True
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args, copy = (args[0], "cpu", *args[2:]), True
        if func is torch.Tensor.to and copy:
            kwargs["copy"] = True
        if func in _MATMULS and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]):
            a, b = args[0], args[1]
            if a.dtype in _HALF and a.dtype == b.dtype:
                rest = [r.float() if isinstance(r, torch.Tensor) else r for r in args[2:]]
                bias = kwargs.get("bias")
                if isinstance(bias, torch.Tensor):
                    kwargs["bias"] = bias.float()
                return func(a.float(), b.float(), *rest, **kwargs).to(a.dtype)
        return func(*args, **kwargs)


def _replay_ops() -> set[str]:
    from llmpar.ops._library import OPS

    return {name for name, op in OPS.items() if op.reference is not None}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-gpu-replay", action="store_true", help="load tests/gpu_replay.py but do not patch")
    parser.addoption(
        "--gpu-replay-all",
        action="store_true",
        help="replay every parametrized case (default: a covering subset, see covering_cases)",
    )


def _values(item: pytest.Item) -> set[tuple[str, str]]:
    spec = getattr(item, "callspec", None)
    return {(k, repr(v)) for k, v in spec.params.items()} if spec is not None else set()


def covering_cases(items: list[pytest.Item]) -> list[pytest.Item]:
    """A subset of ``items`` in which every test function appears and every value of each of its parameters
    appears at least once (greedy: the case adding the most unseen (parameter, value) pairs first, ties to the
    earliest). The argument flow of a body depends on each parameter's value far more than on their combinations;
    ``--gpu-replay-all`` replays every combination."""
    by_function: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_function.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    keep: set[int] = set()
    for group in by_function.values():
        seen: set[tuple[str, str]] = set()
        todo = set().union(*(_values(i) for i in group))
        keep.add(id(group[0]))
        seen |= _values(group[0])
        while todo - seen:
            best = max(group, key=lambda i: (len(_values(i) - seen), -group.index(i)))
            keep.add(id(best))
            seen |= _values(best)
    return [i for i in items if id(i) in keep]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.stash.get(_KEY, False) or config.getoption("--gpu-replay-all"):
        return
    keep = covering_cases(items)
    if len(keep) < len(items):
        kept = {id(i) for i in keep}
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--no-gpu-replay"):
        return
    config.addinivalue_line("markers", "gpu: needs a CUDA device (replayed on CPU by tests/gpu_replay.py)")
    mp = pytest.MonkeyPatch()
    config.add_cleanup(mp.undo)
    real_available, real_opcheck = torch.cuda.is_available, torch.library.opcheck

    def opcheck(*args: Any, **kwargs: Any) -> Any:
        """torch.library.opcheck with the real torch.cuda.is_available: its compile checks would look for CUDA."""
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.cuda, "is_available", real_available)
            return real_opcheck(*args, **kwargs)

    mp.setattr(torch.cuda, "is_available", lambda: True)  # before collection: skipif marks see a device
    mp.setattr(torch.cuda, "device_count", lambda: 1)
    mp.setattr(torch.library, "opcheck", opcheck)
    config.stash[_KEY] = True


_KEY = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _gpu_replay(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Around every replayed test: the device mode and the CPU references in place of the CUDA / Triton kernels."""
    if not request.config.stash.get(_KEY, False):
        yield
        return
    from llmpar.ops import _dispatch, _ext

    ops = _replay_ops()
    status = _ext.ExtStatus(available=True, source="cpu-replay", reason=REPLAY_REASON)
    real_forced = _dispatch.forced_backend

    def cuda_reason(device, *, build=True, op=None, ops_=(), **kw):
        names = ((op,) if op is not None else ()) + tuple(kw.get("ops", ops_))
        missing = [n for n in names if n not in ops]
        return f"llmpar::{missing[0]} has no CPU reference to replay" if missing else None

    monkeypatch.setattr(_ext, "load", lambda build=True: status)
    monkeypatch.setattr(_dispatch, "has_ext_op", lambda name: name in ops)
    monkeypatch.setattr(_dispatch, "cuda_unavailable_reason", cuda_reason)
    monkeypatch.setattr(
        _dispatch, "triton_unavailable_reason", lambda device: "CPU replay: the Triton kernels run as the torch path"
    )
    monkeypatch.setattr(_dispatch, "forced_backend", lambda: "torch" if real_forced() == "triton" else real_forced())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with CpuForCuda():
        yield
