"""``llmpar env``: what this machine offers llmpar. The first thing to run when something is off.

Versions (Python, torch, CUDA, Triton, DeepSpeed...), devices, which op backends can run (CUDA extension built
or JIT-buildable, Triton, torch), distributed backends, where the launcher (torchrun, mpirun, srun) placed this
process and from which variables, and the environment switches llmpar reads.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from typing import Any

ENV_SWITCHES = (
    "LLMPAR_BACKEND",
    "LLMPAR_BUILD_CUDA",
    "TRITON_INTERPRET",
    "CUDA_HOME",
    "TORCH_CUDA_ARCH_LIST",
    "MAX_JOBS",
    "OMP_NUM_THREADS",
)
OPTIONAL_PACKAGES = ("triton", "numpy", "deepspeed", "transformers", "ninja", "pytest", "safetensors")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if info["cuda_available"]:
        info["gpus"] = [
            {
                "index": i,
                "name": torch.cuda.get_device_name(i),
                "capability": "sm_%d%d" % torch.cuda.get_device_capability(i),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
    else:
        info["gpus"] = []
    info["cpu_threads"] = torch.get_num_threads()
    return info


def _distributed() -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False}
    out: dict[str, Any] = {"available": True}
    for name in ("gloo", "nccl", "mpi", "ucc"):
        probe = getattr(dist, f"is_{name}_available", None)
        out[name] = bool(probe()) if probe is not None else False
    if out["nccl"]:
        try:
            import torch.cuda.nccl as nccl

            v = nccl.version()
            out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as err:  # noqa: BLE001 - report, never fail
            out["nccl_version"] = f"unknown ({err})"
    return out


def _backends() -> dict[str, Any]:
    try:
        ops = importlib.import_module("llmpar.ops")
        return ops.backend_report()
    except Exception as err:  # noqa: BLE001 - a broken backend must not break the report
        return {"error": f"{type(err).__name__}: {err}"}


def _launch() -> dict[str, Any]:
    """What ``init_distributed`` would read: rank, sizes, master and the launcher variables they came from."""
    from llmpar.launcher_env import discover

    try:
        info = discover()
    except ValueError as err:  # a bad launcher variable: show it, the rest of the report still matters
        return {"error": str(err)}
    return {
        "source": info.source,
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "local_world_size": info.local_world_size,
        "master_addr": info.master_addr,
        "master_port": info.master_port,
        "master_from": info.master_from,
        "read": info.read,
        "description": info.describe(),
    }


def collect() -> dict[str, Any]:
    """Everything the report shows, as plain data (what ``--json`` prints)."""
    import torch

    import llmpar

    return {
        "llmpar": llmpar.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "packages": {p: _version(p) for p in OPTIONAL_PACKAGES},
        "nvcc": shutil.which("nvcc"),
        "devices": _devices(),
        "op_backends": _backends(),
        "distributed": _distributed(),
        "launch": _launch(),
        "env": {k: os.environ[k] for k in ENV_SWITCHES if k in os.environ},
    }


def _yes(flag: Any) -> str:
    return "yes" if flag is True else ("no" if flag is False else str(flag))


def format_report(data: dict[str, Any]) -> str:
    lines = ["llmpar environment", "=" * 60]

    def row(key: str, value: Any) -> None:
        lines.append(f"{key:<28} {value}")

    row("llmpar", data["llmpar"])
    row("python", f"{data['python']} ({data['platform']})")
    row("torch", data["torch"])
    for pkg, ver in data["packages"].items():
        row(pkg, ver or "not installed")
    row("nvcc", data["nvcc"] or "not found")
    dev = data["devices"]
    lines.append("-" * 60)
    row("CUDA available", f"{_yes(dev['cuda_available'])} (torch built with CUDA {dev['torch_cuda']})")
    for gpu in dev["gpus"]:
        row(f"  gpu {gpu['index']}", f"{gpu['name']} {gpu['capability']} {gpu['memory_gib']} GiB")
    row("CPU threads (torch)", dev["cpu_threads"])
    lines.append("-" * 60)
    backends = data["op_backends"]
    if "error" in backends:
        row("op backends", f"report failed: {backends['error']}")
    else:
        for name, value in backends.items():
            if isinstance(value, dict):
                usable = value.get("available", value.get("importable"))
                status = _yes(usable)
                reason = value.get("reason") or value.get("detail") or ""
                row(f"op backend {name}", f"{status}  {reason}".rstrip())
            elif value is not None:
                row(f"op backend {name}", value)
    lines.append("-" * 60)
    d = data["distributed"]
    if not d.get("available"):
        row("torch.distributed", "not available")
    else:
        for name in ("gloo", "nccl", "mpi", "ucc"):
            extra = f" ({d['nccl_version']})" if name == "nccl" and "nccl_version" in d else ""
            row(f"distributed {name}", _yes(d[name]) + extra)
    launch = data["launch"]
    row("launcher", f"error: {launch['error']}" if "error" in launch else launch["description"])
    if data["env"]:
        lines.append("-" * 60)
        for k, v in data["env"].items():
            row(k, v)
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    data = collect()
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("env", help="report versions, devices and available backends")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)
