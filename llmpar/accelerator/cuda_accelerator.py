"""``torch.cuda`` under DeepSpeed's accelerator names (``llmpar.accelerator``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmpar.accelerator.abstract_accelerator import Accelerator


class CudaAccelerator(Accelerator):
    """``torch.cuda`` under DeepSpeed's names."""

    _name = "cuda"
    _backend = "nccl"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    Stream = property(lambda self: torch.cuda.Stream)
    Event = property(lambda self: torch.cuda.Event)

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached, max_memory_cached = memory_reserved, max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(
            self.current_device() if device_index is None else device_index
        ).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 7

    def is_triton_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], None]) -> None:
        torch.cuda._lazy_call(callback)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()


__all__ = ["CudaAccelerator"]
