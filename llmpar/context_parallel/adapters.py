"""How the engine runs a model with context parallelism: a :class:`ModelAdapter` per model family.

The engine (``llmpar.runtime.engine.Engine``) holds one adapter and one ``ContextParallel`` object ``cp``:

    adapter = adapter_for(model)          # once, at initialize
    adapter.prepare(model, cp)            # route the model's attention through cp
    ...
    args, kwargs, finish = adapter.shard_call(cp, args, kwargs)   # every engine(...) call
    try:
        output = model(*args, **kwargs)   # this rank's slice of the sequence
    finally:
        close(finish)                     # leaves cp.batch if the forward raised (finish already left it)
    return finish(output)                 # the loss: cp.token_mean over every cp rank's real tokens

``shard_call`` receives the *full* batch (every cp rank of a data-parallel group is fed the same one), pads and shards
each sequence tensor along the sequence (:func:`shard_tensor`, this rank's ``SeqShard``), builds position ids from
the global token indices, shifts labels on the full sequence first where the model shifts them itself (so no label is
lost at a shard boundary), and enters ``cp.batch(shard, k_valid)`` (``k_valid`` [B, S_local] bool: False for the
padding the shard added and for masked tokens; None when every key is real). ``finish(output)`` leaves ``cp.batch``
and returns the engine's loss (or the model output carrying it); an adapter whose ``finish`` has a ``close()``
method gets it called when the forward raised (:class:`Finish` does both).

Adapters: :class:`GPTAdapter` (``llmpar.models.GPT``, here) and the transformers causal LMs (Llama / Qwen2 /
Mistral and the MoE Mixtral / Qwen2-MoE / Qwen3-MoE, ``llmpar.context_parallel.hf``, imported only when the model is
a ``transformers.PreTrainedModel``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from llmpar.context_parallel.shard import shard_tensor
from llmpar.distributed.groups import group_size
from llmpar.models.gpt import GPT, IGNORE_INDEX, lm_loss


@runtime_checkable
class ModelAdapter(Protocol):
    """What the engine needs from a model family to run it with context parallelism (module docstring)."""

    def prepare(self, model: nn.Module, cp: Any) -> None:
        """Route ``model``'s attention through ``cp`` (once, before the optimizer is built); raise a ValueError for
        a model the adapter cannot run (every rank, before any collective)."""

    def shard_call(self, cp: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, Callable[[Any], Any]]:
        """``(args, kwargs, finish)``: the forward arguments of this rank's slice of the batch, inside
        ``cp.batch``; ``finish(output)`` leaves it and returns the loss."""


class Finish:
    """``finish`` of :meth:`ModelAdapter.shard_call`: enters ``cp.batch(shard, k_valid)`` when built, leaves it on
    ``close()`` or on the call, which returns ``loss_of(output)``."""

    def __init__(self, cp: Any, shard: Any, k_valid: torch.Tensor | None, loss_of: Callable[[Any], Any]) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(cp.batch(shard, k_valid))
        self._loss_of = loss_of

    def close(self) -> None:
        self._stack.close()

    def __call__(self, output: Any) -> Any:
        self.close()
        return self._loss_of(output)


def close(finish: Callable[[Any], Any]) -> None:
    """Leave ``cp.batch`` after a failed forward, when ``finish`` can (has a ``close()``)."""
    closer = getattr(finish, "close", None)
    if callable(closer):
        closer()


class GPTAdapter:
    """``llmpar.models.GPT`` under context parallelism: ``engine(idx, targets, attention_mask=None)``.

    idx / targets: [B, T] (targets are the next-token labels the GPT's own loss takes, -100 ignored; not shifted
    here), T <= seq_len; attention_mask: [B, T] (1 / True = real token; 0 = padding: its key is masked and its target
    ignored). Each rank runs the GPT on its ``S_local`` tokens with their global positions (padding added to reach
    ``padded_len`` reads position T-1's embedding; it is never attended to and carries no target) and returns
    ``cp.token_mean(sum of its cross entropies, its count of targets != -100)``: the mean over the whole batch's real
    targets, the same on every rank."""

    def __init__(self) -> None:
        self.tp_group: Any = None  # the model's tensor-parallel group (its loss checks targets over it)
        self.vocab_size: int | None = None
        self.seq_len = 0  # the model's longest sequence (its position table)

    def prepare(self, model: nn.Module, cp: Any) -> None:
        if not isinstance(model, GPT):
            raise TypeError(f"GPTAdapter takes a llmpar.models.GPT, got {type(model).__name__}")
        cfg = model.config
        if cfg.dropout:
            raise ValueError(
                f"GPTConfig.dropout={cfg.dropout}: attention dropout is not supported with context "
                "parallelism; build the model with dropout=0.0"
            )
        group = model.tp_group()
        tp = group_size(group) if group is not None else 1
        ulysses = int(getattr(cp, "ulysses_size", 1))
        if (cfg.n_head // tp) % ulysses:
            raise ValueError(
                f"GPTConfig.n_head={cfg.n_head} over tp={tp} leaves {cfg.n_head // tp} heads per rank, "
                f"not divisible by the Ulysses size {ulysses} (context_parallel.ulysses_size / size): "
                "choose n_head divisible by tp * ulysses_size, or the ring mode"
            )
        self.tp_group, self.vocab_size, self.seq_len = group, cfg.vocab_size, cfg.seq_len
        model.__dict__["context_parallel"] = cp  # a plain reference: never a submodule, never in the state dict

    def shard_call(self, cp: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, Callable[[Any], Any]]:
        names = ("idx", "targets", "attention_mask")
        if len(args) > len(names):
            raise TypeError(
                f"engine(idx, targets, attention_mask=None) under context parallelism takes at most 3 "
                f"positional arguments, got {len(args)}"
            )
        given = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(
                    f"engine(...) got an unexpected argument {key!r}: a GPT under context parallelism "
                    f"takes {', '.join(names)}"
                )
            if key in given:
                raise TypeError(f"engine(...) got argument {key!r} twice (positionally and by keyword)")
            given[key] = value
        idx, targets, mask = given.get("idx"), given.get("targets"), given.get("attention_mask")
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            raise ValueError(
                f"idx must be a [batch, tokens] tensor, got {type(idx).__name__} {tuple(getattr(idx, 'shape', ()))}"
            )
        if not isinstance(targets, torch.Tensor):
            raise TypeError(
                "under context parallelism the engine computes the loss: call engine(idx, targets) "
                f"(targets [batch, tokens]), got targets={type(targets).__name__}"
            )
        B, T = idx.shape
        if idx.dtype not in (torch.int64, torch.int32) or targets.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx and targets must hold integer token ids, got {idx.dtype} and {targets.dtype}")
        if T > self.seq_len:
            raise ValueError(
                f"sequence of {T} tokens is longer than the model's seq_len={self.seq_len} (the whole "
                "sequence, before it is split over the context-parallel ranks)"
            )
        if targets.shape != idx.shape:
            raise ValueError(f"targets {tuple(targets.shape)} must have idx's shape {tuple(idx.shape)}")
        if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, T)):
            raise ValueError(
                f"attention_mask must be a [batch={B}, tokens={T}] tensor, got {type(mask).__name__} "
                f"{tuple(getattr(mask, 'shape', ()))}"
            )
        shard = cp.shard(T, idx.device)
        if mask is not None:
            mask = mask.to(idx.device).bool()
            targets = targets.masked_fill(~mask, IGNORE_INDEX)
        index = shard.index.to(idx.device)
        local_idx = shard_tensor(idx, shard, 1, 0)
        local_targets = shard_tensor(targets, shard, 1, IGNORE_INDEX)
        k_valid = None
        if mask is not None or shard.padded_len != T:
            k_valid = (index < T)[None].expand(B, -1)
            if mask is not None:
                k_valid = k_valid & shard_tensor(mask, shard, 1, False)
            k_valid = k_valid.contiguous()
        position_ids = index.clamp(max=T - 1)  # padding reads the last real position's embedding (< seq_len)

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            loss_sum = lm_loss(logits, local_targets, vocab_size=self.vocab_size, group=self.tp_group, reduction="sum")
            count = (local_targets != IGNORE_INDEX).sum()
            return cp.token_mean(loss_sum, count)

        return (local_idx,), {"position_ids": position_ids}, Finish(cp, shard, k_valid, loss_of)


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of ``model``'s family: :class:`GPTAdapter` for ``llmpar.models.GPT``, the transformers adapter
    (``llmpar.context_parallel.hf``) for a ``transformers.PreTrainedModel``; a TypeError naming the model otherwise."""
    if isinstance(model, GPT):
        return GPTAdapter()
    if any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        from llmpar.context_parallel import hf

        return hf.adapter(model)
    raise TypeError(
        f"context parallelism runs llmpar.models.GPT and transformers causal LMs (Llama, Qwen2, "
        f"Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE); got {type(model).__name__}: no adapter shards its batch"
    )


__all__ = ["Finish", "GPTAdapter", "ModelAdapter", "adapter_for", "close"]
