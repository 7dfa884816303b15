"""The ``"activation_checkpointing"`` block: the blocks the model exposes are recomputed in backward.

    "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false,
                                 "number_checkpoints": null, ...}     # the block present: checkpointing is on

Blocks (:func:`exposed_blocks`, the model anatomy's :func:`llmpar.models.anatomy.blocks`): each element of the
outermost ``nn.ModuleList`` / ``nn.Sequential`` of modules with params (a transformer's layers; the model's own
children when it is an ``nn.Sequential``), else the model's own modules among ``model.pipeline_blocks()``. Each
one's ``forward`` is replaced (on the instance: names, params, hooks and ZeRO-3 units stay as they are) by
``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``: its forward keeps only its inputs, backward
runs it again (same RNG state, so dropout matches) before its gradient. The planner's "full" recompute: one layer
input of 2 s b h bytes kept per layer (``llmpar.planning.memory``).

Keys (DeepSpeed's meaning where it carries over):
    number_checkpoints=N: the first N blocks only (Megatron's "block" method; DeepSpeed sizes a buffer with it);
        default every block.
    cpu_checkpointing: each block's saved inputs go to (pinned) host memory as the forward passes it and come back
        for the recompute (``torch.autograd.graph.save_on_cpu`` around the checkpoint). On a CPU model there is no
        other memory: no effect (logged).
    partition_activations: with tensor parallelism (a tp group of > 1 ranks) each tp rank keeps 1/tp of each block's
        saved inputs, all-gathered over tp when the block is recomputed (DeepSpeed / Megatron: those inputs are the
        same on every tp rank). Without tp there is nothing to split; under sequence parallelism the inputs are
        already split over tp: both no effect (logged). With cpu_checkpointing the kept piece goes to the host.
    contiguous_memory_optimization: no effect (torch's caching allocator already reuses the freed blocks).
    synchronize_checkpoint_boundary: synchronize the CUDA device before each checkpointed block (a debugging aid).
    profile: no effect (logged).

Selective recomputation (the planner's "selective": the s x s attention scores are not kept, ~5 a s / h of
34 + 5 a s / h per layer) is what ``F.scaled_dot_product_attention`` does with or without this block: its fused
kernels (flash / memory-efficient on CUDA, flash on the CPU) keep only the log-sum-exp and recompute the scores in
backward; ``llmpar.models.GPT`` uses it (``tests/test_activation_ckpt.py`` measures the saved bytes linear in s).

Both engines apply it: the plain one (ZeRO 0-3: a stage-3 unit is re-gathered before its recompute, by the node
on its outputs) and the pipeline one (its stages hold the model's own blocks, wrapped before the split).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llmpar.distributed.collectives import Group, GroupRef, all_gather_flat, group_rank, group_size
from llmpar.models.anatomy import blocks as anatomy_blocks
from llmpar.runtime.blocks import ActivationCheckpointingConfig

logger = logging.getLogger("llmpar")

SaveContext = Callable[[], contextlib.AbstractContextManager]


def exposed_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks the model exposes (module docstring; the rule:
    :func:`llmpar.models.anatomy.blocks`), in registration order."""
    return anatomy_blocks(model)


class PartitionedInputs(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors split over ``group``: each rank keeps its 1/size (padded) slice of every floating-point tensor
    (optionally on the host), and the whole is all-gathered when autograd unpacks it. For tensors that are the same
    on every rank of the group (a block's input under tensor parallelism); ``held_bytes`` counts the bytes kept
    since it was made. One instance can be entered again and again (not nested)."""

    def __init__(self, group: Group | GroupRef, *, to_host: bool = False) -> None:
        self.group, self.to_host = group, to_host
        self.size, self.rank = group_size(group), group_rank(group)
        self.held_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if not t.is_floating_point() or t.numel() < self.size:
            return t, None
        flat = t.detach().reshape(-1)
        n = -(-flat.numel() // self.size)
        a, z = min(self.rank * n, flat.numel()), min((self.rank + 1) * n, flat.numel())
        host = self.to_host and t.device.type != "cpu"
        piece = torch.zeros(
            n, dtype=t.dtype, device="cpu" if host else t.device, pin_memory=host and torch.cuda.is_available()
        )
        piece[: z - a].copy_(flat[a:z])
        self.held_bytes += piece.numel() * piece.element_size()
        return piece, (t.shape, t.numel(), t.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        piece, meta = packed
        if meta is None:
            return piece
        shape, numel, device = meta
        full = torch.empty(piece.numel() * self.size, dtype=piece.dtype, device=device)
        all_gather_flat(
            full,
            piece.to(device, non_blocking=True),
            self.group,
            what="all-gather of a partitioned activation checkpoint",
        )
        return full[:numel].view(shape)


def checkpoint_blocks(
    model: nn.Module, *, first: int | None = None, save: SaveContext | None = None, synchronize: bool = False
) -> list[str]:
    """Recompute the model's blocks (:func:`exposed_blocks`, the first ``first`` of them) in backward; ``save``: a
    context (factory) entered around each checkpoint, whose saved-tensor hooks take the blocks' saved inputs
    (``save_on_cpu``, :class:`PartitionedInputs`). Returns the names of the blocks wrapped (a block wrapped before
    is left as it is)."""
    blocks = exposed_blocks(model)
    if not blocks:
        raise ValueError(
            '"activation_checkpointing": the model exposes no blocks to recompute (an nn.ModuleList / '
            "nn.Sequential of modules, or pipeline_blocks()); checkpoint inside the model with "
            "torch.utils.checkpoint instead"
        )
    chosen = blocks[:first] if first is not None else blocks
    for _, module in chosen:
        _wrap(module, save, synchronize)
    return [n for n, _ in chosen]


def _wrap(module: nn.Module, save: SaveContext | None, synchronize: bool) -> None:
    if getattr(module, "_llmpar_recompute", None) is not None:
        return
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()
        with save() if save is not None else contextlib.nullcontext():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    module._llmpar_recompute = inner  # type: ignore[assignment]


def apply_activation_checkpointing(
    model: nn.Module, cfg: ActivationCheckpointingConfig, tp_group: Group | None = None
) -> list[str]:
    """The block's settings applied to ``model`` (module docstring); returns the blocks wrapped ([] when off)."""
    if not cfg.enabled:
        return []
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    to_host = cfg.cpu_checkpointing and device.type != "cpu"
    if cfg.cpu_checkpointing and not to_host:
        logger.info("activation_checkpointing.cpu_checkpointing: the model is on the CPU already: no effect")
    tp = group_size(tp_group) if tp_group is not None else 1
    partition = cfg.partition_activations and tp > 1
    if cfg.partition_activations and not partition:
        logger.info("activation_checkpointing.partition_activations: no tensor parallelism: nothing to partition")
    elif partition and any(getattr(m, "sequence_parallel", False) for m in model.modules()):
        partition = False
        logger.info(
            "activation_checkpointing.partition_activations: sequence parallelism already splits the "
            "block inputs over tp: no effect"
        )
    for flag in ("contiguous_memory_optimization", "profile"):
        if getattr(cfg, flag):
            logger.info("activation_checkpointing.%s: no effect in llmpar", flag)
    save: SaveContext | None = None
    if partition:
        parts = PartitionedInputs(GroupRef(tp_group), to_host=to_host)
        save = lambda: parts  # noqa: E731
    elif to_host:
        save = lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())  # noqa: E731
    names = checkpoint_blocks(
        model, first=cfg.number_checkpoints, save=save, synchronize=cfg.synchronize_checkpoint_boundary
    )
    logger.info(
        "activation checkpointing: %d block(s) recomputed in backward (%s%s)",
        len(names),
        ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        "; inputs split over tp" if partition else "; inputs on the host" if to_host else "",
    )
    return names


__all__ = ["PartitionedInputs", "apply_activation_checkpointing", "checkpoint_blocks", "exposed_blocks"]
