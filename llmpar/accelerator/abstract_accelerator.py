"""What llmpar's accelerators share, under DeepSpeed's ``DeepSpeedAccelerator`` names (``llmpar.accelerator``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


class Accelerator:
    """What both accelerators share (DeepSpeed's ``DeepSpeedAccelerator`` names). ``device_index`` arguments are
    ints; None means the current device."""

    _name = "cpu"
    _backend = "gloo"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self._name!r}, backend={self._backend!r})"

    # device
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:<i>"`` on a GPU, ``"cpu"`` on the host."""
        return self._name if device_index is None or self._name == "cpu" else f"{self._name}:{int(device_index)}"

    def current_device_name(self) -> str:
        return self.device_name(None if self._name == "cpu" else self.current_device())

    def communication_backend_name(self) -> str:
        """The torch.distributed backend: nccl on CUDA, gloo on the CPU."""
        return self._backend

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    # random numbers
    def random(self) -> Any:
        return torch.random

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds the CPU and every CUDA device

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # dtypes
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float]
        if self.is_fp16_supported():
            out.append(torch.half)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def is_triton_supported(self) -> bool:
        return False

    def _tensor(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    BFloat16Tensor = property(lambda self: self._tensor(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor(torch.double))
    FloatTensor = property(lambda self: self._tensor(torch.float))
    HalfTensor = property(lambda self: self._tensor(torch.half))
    IntTensor = property(lambda self: self._tensor(torch.int))
    LongTensor = property(lambda self: self._tensor(torch.long))

    # profiling ranges (NVTX on CUDA; nothing on the CPU)
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        pass

    def range_pop(self, domain: Any = None) -> None:
        pass

    # environment
    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def get_compile_backend(self) -> str:
        return "inductor"

    def create_op_builder(self, class_name: str) -> Any:
        raise NotImplementedError(
            f"DeepSpeed op builders ({class_name}) are not provided: llmpar's fused ops are in "
            "llmpar.ops (FusedAdam / DeepSpeedCPUAdam in llmpar.ops.adam)"
        )

    get_op_builder = create_op_builder

    def build_extension(self) -> Any:
        raise NotImplementedError(
            "DeepSpeed's extension builder is not provided: llmpar builds its CUDA extension "
            "with setup.py (LLMPAR_BUILD_CUDA=1) or on first use"
        )


DeepSpeedAccelerator = Accelerator  # DeepSpeed's name of the base class

__all__ = ["Accelerator", "DeepSpeedAccelerator"]
