"""The host under DeepSpeed's CPU accelerator semantics (``llmpar.accelerator``): no-op streams and events, the
process's resident set size as its memory statistics, gloo."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from typing import Any, Callable

import torch

from llmpar.accelerator.abstract_accelerator import Accelerator


def _status_bytes(field: str) -> int | None:
    """``field`` (``VmRSS`` / ``VmHWM``) of ``/proc/self/status`` in bytes; None where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _NoStream:
    """The CPU's stand-in for a stream (DeepSpeed's CPU accelerator: work runs in order on the host)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NoEvent":
        return event if event is not None else _NoEvent()

    def query(self) -> bool:
        return True


class _NoEvent:
    """The CPU's stand-in for an event: always complete; ``elapsed_time`` is not measured (0.0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


class CpuAccelerator(Accelerator):
    """The host as DeepSpeed's CPU accelerator presents it (module docstring)."""

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        pass

    def current_device(self) -> int:
        """``LOCAL_RANK`` (0 without one), as DeepSpeed's CPU accelerator."""
        raw = os.environ.get("LOCAL_RANK", "0")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable LOCAL_RANK={raw!r} is not an integer") from None

    def device_count(self) -> int:
        """The ranks on this node (``LOCAL_WORLD_SIZE`` / ``LOCAL_SIZE``; 1 without them)."""
        for env in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            raw = os.environ.get(env, "")
            if raw.isdigit() and int(raw) > 0:
                return int(raw)
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    Stream = property(lambda self: _NoStream)
    Event = property(lambda self: _NoEvent)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> _NoStream:
        return _NoStream()

    default_stream = current_stream

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, device_index: int | None = None) -> int:
        """The process's resident set size now (bytes)."""
        rss = _status_bytes("VmRSS")
        return rss if rss is not None else self.max_memory_allocated()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The process's peak resident set size (bytes) since the start or the last reset."""
        peak = _status_bytes("VmHWM")
        if peak is not None:
            return peak
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Reset the peak to the current resident set size (Linux ``/proc/self/clear_refs``; where the kernel does
        not allow it the peak stays the process's)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats
    memory_reserved = memory_cached = memory_allocated
    max_memory_reserved = max_memory_cached = max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        return {
            "allocated_bytes.all.current": self.memory_allocated(),
            "allocated_bytes.all.peak": self.max_memory_allocated(),
        }

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.total_memory() - self.memory_allocated()

    def lazy_call(self, callback: Callable[[], None]) -> None:
        callback()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False


__all__ = ["CpuAccelerator"]
