"""A model as a sequence of blocks, the unit a pipeline split cuts at.

``to_blocks(model)`` returns ``[(name, module), ...]`` whose modules, applied one after the other, compute the model:

* ``nn.Sequential``: its children, named by their keys;
* anything with a ``pipeline_blocks()`` method returning such a list;
* llmpar's ``GPT``: ``embed`` (tok_emb + pos_emb + dropout: ids [B, T] -> x [B, T, d]), ``blocks.0`` ...
  ``blocks.{n-1}`` (x -> x), ``head`` (ln_f + lm_head: x -> logits [B, T, V]).

The blocks hold the model's own submodules (no copies), so parameter sharing (tied embeddings) stays visible to
the split, and tensor-parallel plans still match the original module names (``tok_emb``, ``attn.qkv``, ``lm_head``).
"""
from __future__ import annotations

import torch
from torch import nn

from llmpar.models.gpt import GPT


class GPTEmbedding(nn.Module):
    """ids [B, T] (int) -> dropout(tok_emb(ids) + pos_emb(arange(T))): [B, T, d]. Shares ``gpt``'s modules."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb = gpt.tok_emb
        self.pos_emb = gpt.pos_emb
        self.drop = gpt.drop
        self.seq_len = gpt.config.seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, tokens], got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than seq_len={self.seq_len}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class GPTHead(nn.Module):
    """x [B, T, d] -> lm_head(ln_f(x)): logits [B, T, V]. Shares ``gpt``'s modules."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f = gpt.ln_f
        self.lm_head = gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def to_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as an ordered list of ``(name, block)``; see the module docstring for what is accepted."""
    if isinstance(model, GPT):
        blocks: list[tuple[str, nn.Module]] = [("embed", GPTEmbedding(model))]
        blocks += [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
        blocks.append(("head", GPTHead(model)))
    elif hasattr(model, "pipeline_blocks"):
        blocks = list(model.pipeline_blocks())
    elif isinstance(model, nn.Sequential):
        blocks = list(model.named_children())
    else:
        raise TypeError(f"model is a {type(model).__name__}: pass an nn.Sequential, llmpar's GPT, or a module with a "
                        "pipeline_blocks() method returning [(name, module), ...]")
    if not blocks:
        raise ValueError(f"model {type(model).__name__} has no blocks to split")
    for item in blocks:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], nn.Module)):
            raise TypeError(f"pipeline blocks must be (name, nn.Module) pairs, got {item!r}")
    return blocks


class StageModule(nn.Sequential):
    """The blocks of one pipeline stage, applied in order. Child names are the block names with ``.`` -> ``_``
    (``blocks.3`` -> ``blocks_3``), so parameter names read ``blocks_3.attn.qkv.weight``."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], *, stage_index: int, block_names: list[str]) -> None:
        super().__init__()
        for name, block in blocks:
            self.add_module(stage_key(name), block)
        self.stage_index = stage_index
        self.block_names = list(block_names)


def stage_key(block_name: str) -> str:
    return block_name.replace(".", "_")


__all__ = ["GPTEmbedding", "GPTHead", "StageModule", "stage_key", "to_blocks"]
