"""``deepspeed.checkpointing`` (activation checkpointing) for DeepSpeed and Megatron scripts:

    import llmpar as deepspeed
    deepspeed.checkpointing.configure(mpu, partition_activations=False, checkpoint_in_cpu=False)
    hidden = deepspeed.checkpointing.checkpoint(layer, hidden, mask)       # recomputed in backward

:func:`checkpoint` is ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)``: the function's
activations are not kept, it runs again (with the same RNG state, so dropout matches) in backward; unlike a
reentrant checkpoint it gives the params inside gradients when no input requires grad, and each param its gradient
once, as ZeRO's gradient hooks need (ZeRO-3 gathers the params of the units it runs again). It needs no
configuration: :func:`is_configured` is always True, and :func:`configure` checks DeepSpeed's settings without
keeping any (llmpar holds no process-wide state). The settings that would change what :func:`checkpoint` does are
refused, naming what does it in llmpar: ``partition_activations`` and ``checkpoint_in_cpu`` are the config's
``"activation_checkpointing"`` block, which ``llmpar.initialize`` applies to the model's blocks (or wrap the call in
``torch.autograd.graph.save_on_cpu()``). ``contiguous_checkpointing``, ``num_checkpoints``, ``synchronize`` and
``profile`` are accepted and have no effect here. Megatron's model-parallel RNG tracker is not provided.
A DeepSpeed-compatibility module: nothing inside llmpar imports it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.utils.checkpoint

from llmpar.runtime.blocks import activation_checkpointing_block
from llmpar.runtime.config import read_config


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with its activations recomputed in backward (non-reentrant ``torch.utils.checkpoint``);
    returns what the function returns."""
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Check DeepSpeed's activation-checkpointing settings (the arguments, over the ``"activation_checkpointing"``
    block of ``deepspeed_config``, a dict or a JSON path) against what :func:`checkpoint` does (module docstring)."""
    block = {}
    if deepspeed_config is not None:
        block = dict(read_config(deepspeed_config).get("activation_checkpointing", {}))
    given = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    block.update({k: v for k, v in given.items() if v is not None})
    cfg = activation_checkpointing_block(block)
    if cfg.partition_activations:
        raise ValueError(
            "checkpointing.configure(partition_activations=True): not done by checkpointing.checkpoint; "
            'the config\'s "activation_checkpointing": {"partition_activations": true} is (llmpar.'
            "initialize checkpoints the model's blocks, each tp rank keeping 1/tp of their inputs)"
        )
    if cfg.cpu_checkpointing:
        raise ValueError(
            "checkpointing.configure(checkpoint_in_cpu=True): not done by checkpointing.checkpoint; wrap "
            "the call in `with torch.autograd.graph.save_on_cpu(pin_memory=True):`, or use the config's "
            '"activation_checkpointing": {"cpu_checkpointing": true}'
        )


def is_configured() -> bool:
    """Always True: :func:`checkpoint` needs no configuration."""
    return True


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; llmpar keeps none."""


def get_cuda_rng_tracker() -> Any:
    raise NotImplementedError(
        "the model-parallel CUDA RNG tracker (Megatron's) is not provided: checkpoint() restores "
        "the RNG state for the recompute by itself; seed with torch.manual_seed"
    )


def model_parallel_cuda_manual_seed(seed: int) -> None:
    raise NotImplementedError(
        "model_parallel_cuda_manual_seed (per-tp-rank RNG streams) is not provided: seed every "
        "rank with torch.manual_seed(seed); llmpar's tensor-parallel layers take their slice of "
        "the same-seed weights"
    )


__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
]
